"""Device -> slot copies that overlap the teacher's next forward: the worker's GPU path.

:class:`DeviceToSlots`: ``start`` enqueues the device-to-host copies of a batch's hidden
states into a pinned staging buffer on a side stream, records an event and returns a
``finish`` callable at once; the worker launches the NEXT batch's forward before calling
``finish`` (``Worker``'s deferred commit), which waits for the event and copies staging ->
shared-memory slots on the CPU while the GPU computes. Two staging buffers alternate, so
batch n+1 never overwrites what batch n is still copying. On CPU the copies happen in
``start`` and ``finish`` does nothing, so callers need no device branches.

Shape legend: B batch, P boundary positions, T tokens, D hidden size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

STAGING_BUFFERS = 2
"""Staging buffers per worker: one being filled by the GPU while the other drains into slots."""


def _no_finish() -> None:
    """What ``DeviceToSlots.start`` returns on CPU: the copies already happened."""


class DeviceToSlots:
    """Copies per-sample states from the teacher's devices into slot views (see module doc).

    A teacher spread over several GPUs (a device map) hands over states that live on
    different devices (each on its layer's GPU): each device's copies go on a side stream
    of that device, and ``finish`` waits for all of them.
    """

    def __init__(self, device: torch.device | str | Sequence[torch.device | str]) -> None:
        devices = [device] if isinstance(device, torch.device | str) else list(device)
        self.devices = [torch.device(d) for d in devices]
        self.device = self.devices[0]
        self.cuda = any(d.type == "cuda" for d in self.devices)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staging: list[torch.Tensor | None] = [None] * STAGING_BUFFERS
        self._events: list[list[torch.cuda.Event] | None] = [None] * STAGING_BUFFERS
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
        if not any(state.is_cuda for state in states):
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
        events = []
        for device in sorted({state.device for state in states}, key=str):
            stream = self._stream_of(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the forward wrote the states
            with torch.cuda.stream(stream):
                for j, state_BTD in enumerate(states):
                    if state_BTD.device == device:
                        # contiguous pinned destination: a non-contiguous one would go through a
                        # pageable temporary and make the copy synchronous
                        staging_PBTD[j].copy_(state_BTD[:len(dests)], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            events.append(event)
        self._events[turn] = events
        kept = list(states)  # the allocator must not reuse them before the copy ran

        def finish() -> None:
            for event in events:
                event.synchronize()
            kept.clear()
            t0 = time.perf_counter()
            positions = staging_PBTD.shape[0]
            for i, dest in enumerate(dests):
                dest[:positions].copy_(staging_PBTD[:, i])
            self.copy_s += time.perf_counter() - t0
            self._events[turn] = None

        return finish

    def _stream_of(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of one CUDA device (made on first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _wait_free(self, turn: int) -> None:
        """Internal guard: a staging buffer whose previous copy was never finished."""
        events = self._events[turn]
        if events is not None:
            log.debug("staging buffer %d still in use: waiting for its copy", turn)
            for event in events:
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
