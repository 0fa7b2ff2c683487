"""Host -> device copies that overlap compute: the student's GPU paths.

Why a module of its own: the student loop moves large tensors from host memory to a
CUDA device every step, and loses throughput when that copy serialises with compute.
The classes here keep those copies off the compute stream and fall back to plain
synchronous copies on CPU so callers need no device branches. The teacher's side of
the same idea (device to shared-memory slots) is :mod:`distill.teacher.transfer`.

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
from collections.abc import Callable, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
WORKER_DEATH_WAIT_S = 2.0
"""How long a failed batch handoff waits for its DataLoader worker to be seen dead."""


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
