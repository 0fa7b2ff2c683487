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
- :class:`BackgroundBatches` (student, slots gathered in the training process):
  runs the batch iterator in a thread a few batches ahead, so waiting for the
  broker's answers and the copy out of the slots happen while the step computes
  (torch releases the GIL in its kernels) instead of between steps.

Shape legend: B batch, P boundary positions, T tokens, D hidden size.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
WORKER_DEATH_WAIT_S = 2.0
"""How long a failed batch handoff waits for its DataLoader worker to be seen dead."""
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


def loader_batches(loader: Iterable[Batch]) -> Iterator[Batch]:
    """The batches of a ``DataLoader`` with worker processes. A worker killed while it hands
    a batch over (the batch's shared storage still being passed as a file descriptor)
    reaches the training process as a ``ConnectionResetError`` from that handoff, not as
    torch's own error; this turns it into torch's error naming the dead worker (``DataLoader
    worker (pid N) is killed by signal``), which is what the user needs to read."""
    batches = iter(loader)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (ConnectionError, EOFError) as exc:
            _raise_if_a_worker_died(batches, exc)
            raise
        yield batch


def _raise_if_a_worker_died(batches: Iterator[Batch], exc: BaseException) -> None:
    """Raise torch's error for a DataLoader worker that died, waiting up to
    ``WORKER_DEATH_WAIT_S`` for it to be seen dead: its sockets are reset as it exits,
    a moment before the kernel reports it exited (seen in CI: the reset came first)."""
    check = getattr(torch._C, "_error_if_any_worker_fails", None)
    deadline = time.monotonic() + WORKER_DEATH_WAIT_S
    while True:
        if check is not None:
            check()  # raises if a worker of this process's DataLoaders died (not yet reaped)
        dead = [str(w.pid) for w in getattr(batches, "_workers", ()) if not w.is_alive()]
        if dead:  # reaped already: say so in torch's words
            raise RuntimeError(f"DataLoader worker (pid(s) {', '.join(dead)}) exited unexpectedly") from exc
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


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
        with contextlib.suppress(StopIteration):  # this batch is the last: the next call ends it
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


class _Raised:
    """What the producing thread hands over when the iterator raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
"""The producing thread's last item: the iterator is exhausted."""
POLL_S = 0.1
"""How often a blocked producer looks whether it was told to stop."""


class BackgroundBatches:
    """``make_batches()`` iterated in a daemon thread, up to ``depth`` batches ahead.

    The iterator is created, advanced and closed in that thread only (the pipeline's
    sockets must stay in the thread that made them). An exception it raises comes out
    of ``__next__`` in the caller; ``close`` stops the thread, which closes the
    iterator (a ``DistillIterableDataset`` then releases its slots and segment).
    """

    def __init__(self, make_batches: Callable[[], Iterator[Batch]], depth: int = 2, name: str = "batches") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1 batch ahead, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(make_batches,), name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> BackgroundBatches:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, _Raised):
            self._done = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item.error
        return item

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread and wait (bounded) until it has closed the iterator."""
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()  # a producer blocked on a full queue sees the stop
            self._thread.join(POLL_S)
            timeout_s -= POLL_S
            if timeout_s <= 0:
                log.warning("%s: the batch thread did not stop in time; leaving it (daemon)", self._thread.name)
                break
        self._done = True

    def _produce(self, make_batches: Callable[[], Iterator[Batch]]) -> None:
        batches = None
        try:
            batches = make_batches()
            for batch in batches:
                if not self._put(batch):
                    return
            self._put(_END)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._put(_Raised(error))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _put(self, item: object) -> bool:
        """Hand ``item`` over, waiting for room; False once told to stop, also when the
        stop came while it was being handed over (``close`` makes room to wake us): the
        iterator is then not advanced again (a dataset would fill one more batch)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return not self._stop.is_set()
            except queue.Full:
                continue
        return False
