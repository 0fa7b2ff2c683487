"""Host <-> device copies that overlap compute: the GPU paths of worker and student.

Why a module of its own: the teacher worker and the student loop both move large
tensors between a CUDA device and host memory every step, and both lose throughput
when that copy serialises with compute. The two classes here keep those copies off
the compute stream, in page-locked (pinned) host memory, and fall back to plain
synchronous copies on CPU so callers need no device branches.

- :class:`DeviceToSlots` (teacher worker): ``start`` enqueues the device-to-host
  copies of a batch's hidden states into a pinned staging buffer on a side stream,
  records an event and returns a ``finish`` callable at once; the worker launches
  the NEXT batch's forward before calling ``finish`` (see ``Worker``'s deferred
  commit), which waits for the event and copies staging -> shared-memory slots on
  the CPU while the GPU computes. Two staging buffers alternate, so batch n+1 never
  overwrites what batch n is still copying.
- :class:`DevicePrefetcher` (student): wraps a batch iterator; while the caller
  trains on batch n, batch n+1 (already in pinned memory) is copied host-to-device
  with ``non_blocking=True`` on a side stream; ``__next__`` makes the compute
  stream wait for that copy's event only.

Shape legend: B batch, P boundary positions, T tokens, D hidden size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
STAGING_BUFFERS = 2
"""Staging buffers per worker: one being filled by the GPU while the other drains into slots."""


def _no_finish() -> None:
    """What ``DeviceToSlots.start`` returns on CPU: the copies already happened."""


class DeviceToSlots:
    """Copies per-sample states from the teacher's device into slot views (see module doc)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: list[torch.Tensor | None] = [None] * STAGING_BUFFERS
        self._events: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self._turn = 0
        self.copy_s = 0.0
        """Seconds the CPU spent writing slots (not waiting for the device): the transport's share."""

    def start(self, states: Sequence[torch.Tensor], dests: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Copy ``states[j][i]`` into ``dests[i][j]`` for every sample i and position j.

        ``states`` are ``[B, T, D]`` tensors on the device (one per position);
        ``dests`` are ``[P, T, D]`` host views (one per sample, e.g. a slot's
        ``hidden``). On CPU the copies are done when this returns; on CUDA they are
        done when the returned callable returns (call it exactly once).
        """
        if len(dests) == 0 or len(states) == 0:
            return _no_finish
        if not self.cuda:
            t0 = time.perf_counter()
            for i, dest in enumerate(dests):
                for j, state_BTD in enumerate(states):
                    dest[j].copy_(state_BTD[i])
            self.copy_s += time.perf_counter() - t0
            return _no_finish
        turn = self._turn
        self._turn = (turn + 1) % STAGING_BUFFERS
        self._wait_free(turn)
        staging_PBTD = self._staging_for(turn, len(dests), states)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward wrote the states
        with torch.cuda.stream(stream):
            for j, state_BTD in enumerate(states):
                # contiguous pinned destination: a non-contiguous one would go through a
                # pageable temporary and make the copy synchronous
                staging_PBTD[j].copy_(state_BTD[:len(dests)], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events[turn] = event
        kept = list(states)  # the allocator must not reuse them before the copy ran

        def finish() -> None:
            event.synchronize()
            kept.clear()
            t0 = time.perf_counter()
            positions = staging_PBTD.shape[0]
            for i, dest in enumerate(dests):
                dest[:positions].copy_(staging_PBTD[:, i])
            self.copy_s += time.perf_counter() - t0
            self._events[turn] = None

        return finish

    def _wait_free(self, turn: int) -> None:
        """Internal guard: a staging buffer whose previous copy was never finished."""
        event = self._events[turn]
        if event is not None:
            log.debug("staging buffer %d still in use: waiting for its copy", turn)
            event.synchronize()

    def _staging_for(self, turn: int, batch: int, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pinned ``[P, B, T, D]`` staging buffer of ``turn`` (each ``[j, :B]`` contiguous),
        grown when needed."""
        shape = (len(states), batch, *states[0].shape[1:])
        staging = self._staging[turn]
        if (staging is None or staging.dtype != states[0].dtype or staging.shape[1] < batch
                or staging.shape[0] != shape[0] or tuple(staging.shape[2:]) != shape[2:]):
            staging = torch.empty(shape, dtype=states[0].dtype, pin_memory=True)
            self._staging[turn] = staging
        return staging[:, :batch]


class DevicePrefetcher:
    """Batches from ``batches`` on ``device``, the next one copied while this one trains.

    On CPU it yields the batches unchanged. On CUDA, host batches should already be
    in pinned memory (``DistillIterableDataset(pin_memory=True)`` or a DataLoader with
    ``pin_memory=True``): from pageable memory a ``non_blocking`` copy is synchronous.
    """

    def __init__(self, batches: Iterator[Batch], device: torch.device | str) -> None:
        self.batches = batches
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._next: tuple[Batch, torch.cuda.Event] | None = None
        self._warned_pageable = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Batch:
        if not self.cuda:
            return next(self.batches)
        if self._next is None:
            self._next = self._load()
        batch, event = self._next
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for tensor in batch.values():
            tensor.record_stream(compute)  # freed memory waits for compute, not just the copy
        self._next = None
        self._next = self._load()  # the next copy runs while the caller computes on this batch
        return batch

    def _load(self) -> tuple[Batch, torch.cuda.Event]:
        host = next(self.batches)
        self._check_pinned(host)
        with torch.cuda.stream(self._stream):
            batch = {name: tensor.to(self.device, non_blocking=True) for name, tensor in host.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        return batch, event

    def _check_pinned(self, host: Batch) -> None:
        if self._warned_pageable or all(t.is_pinned() for t in host.values() if t.device.type == "cpu"):
            return
        self._warned_pageable = True
        log.warning("student batches are in pageable memory: host-to-device copies will not overlap "
                    "compute (use DistillIterableDataset(pin_memory=True) or DataLoader(pin_memory=True))")
