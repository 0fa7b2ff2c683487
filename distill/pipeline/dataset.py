"""DistillIterableDataset: an infinite IterableDataset over slots filled by workers.

Each process that iterates it (the main process, or every DataLoader worker) gets
its own :class:`SlotPool`: its own shared memory and its own socket, created inside
``__iter__`` so nothing unpicklable crosses into DataLoader workers. The shared
``generation_value`` (from ``StudentClient.generation_value``) is read before each
yield: nothing older than the newest generation is ever yielded.

Two modes:

- ``batch_size=None`` (the seed README's): yields one sample per item, copied out
  of its slot (a slot is reused as soon as the next item is asked for, so a view
  could not outlive it). Use the DataLoader's ``batch_size`` to batch.
- ``batch_size=B``: yields ready-made batches ``{name: Tensor[B, ...]}``; each
  sample is copied exactly once, from its slot into the batch (one
  ``index_select`` per tensor for all the slots that are ready). Each chunk of
  slots is asked for again as soon as it is copied, not when the batch is whole:
  the workers refill it while the rest of the batch arrives, and a batch may be
  larger than ``slot_count`` (large samples need not cost ``batch_size`` slots of
  shared memory). Use ``DataLoader(dataset, batch_size=None)``. This is the fast path.
- ``batch_size=B, reuse_batches=True``: the same, but every batch is written into
  the same tensors (a yielded batch is valid until the next one is asked for).
  Fresh large tensors cost page faults and zeroing (more than the copy itself at
  256 KiB+ samples); reusing them is the fastest way to fill a training batch, for
  loops that consume each batch before asking for the next (``num_workers=0``).

``pin_memory=True`` (CUDA only; with ``batch_size=B``, in the training process)
gathers every batch straight into page-locked memory, so the host-to-device copy
can be ``non_blocking`` and overlap compute (``distill.train.transfer.DevicePrefetcher`` in the application)
without the extra copy a DataLoader's pin-memory thread makes. Fresh pinned batches
come from torch's caching host allocator, which reuses a block only once the copies
reading it have finished; that is why it cannot be combined with ``reuse_batches``.

``with_meta=True`` adds int64 tensors ``generation``, ``request_id`` and ``source``
(which pool filled it) to every sample, so a consumer can check or filter them.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from distill.pipeline.auth import CurveConfig
from distill.pipeline.batch import BatchConfig
from distill.pipeline.client import DEFAULT_RUN, SlotPool
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
META_KEYS = ("generation", "request_id", "source")


class DistillIterableDataset(IterableDataset):
    """Infinite stream of ``dict[str, Tensor]`` samples (or batches) from the workers."""

    def __init__(self, student_rank: int, generation_value: Any, slot_count: int,
                 batch_config: BatchConfig, frontend_endpoint: str | None = None,
                 max_retries: int = 10, retry_delay: float = 0.01, *, run_id: str = DEFAULT_RUN,
                 batch_size: int | None = None, with_meta: bool = False,
                 timeout_s: float | None = None, reuse_batches: bool = False,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_liveness: int = HEARTBEAT_LIVENESS, medium: str = "shm",
                 tcp_host: str | None = None, curve: CurveConfig | None = None,
                 pin_memory: bool = False, notices: bool = True, notice_dir: str | None = None,
                 direct_requests: bool = True) -> None:
        super().__init__()
        _check_pin_memory(pin_memory, batch_size, reuse_batches)
        if reuse_batches and batch_size is None:
            raise ValueError("reuse_batches=True needs batch_size=B (it reuses the batch tensors)")
        self.student_rank = student_rank
        self.generation_value = generation_value
        self.slot_count = slot_count
        self.batch_config = batch_config
        self.frontend_endpoint = frontend_endpoint or default_endpoint("frontend")
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.run_id = run_id
        self.batch_size = batch_size
        self.with_meta = with_meta
        self.timeout_s = timeout_s
        self.reuse_batches = reuse_batches
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.medium = medium
        """``shm`` (one machine) or ``tcp`` (workers elsewhere send the samples over TCP)."""
        self.tcp_host = tcp_host
        if curve is not None:
            curve.client_keys()  # a bad key fails here, not later in every DataLoader worker
        self.curve = curve
        """Paths, not keys: each process that iterates reads (and checks) the keys itself."""
        self.pin_memory = pin_memory
        self.notices = notices
        """Let workers on this machine announce filled slots directly (``notices.py``)."""
        self.notice_dir = notice_dir
        """Where the inbox for those notices goes (None: the default socket directory); the
        workers must be given the same (``Worker(notice_dir=...)``)."""
        self.direct_requests = direct_requests
        """Ask a slot's last local worker to fill it again, past the broker (needs ``notices``)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.reuse_batches and get_worker_info() is not None:
            raise ValueError("reuse_batches=True in a DataLoader worker: the worker hands each batch "
                             "to the training process through shared memory, and reusing it would "
                             "overwrite batches not yet consumed; use num_workers=0 or reuse_batches=False")
        if self.pin_memory and get_worker_info() is not None:
            raise ValueError("pin_memory=True in a DataLoader worker: pin in the training process instead "
                             "(DataLoader(pin_memory=True)), or use num_workers=0")
        pool = self._open_pool()
        try:
            pool.request_free()
            if self.batch_size is None:
                yield from self._samples(pool)
            else:
                yield from self._batches(pool)
        finally:
            pool.close()

    # ------------------------------------------------------------------ internals
    def _open_pool(self) -> SlotPool:
        pool = SlotPool(self.frontend_endpoint, self.run_id, self.slot_count,
                        self.batch_config.nbytes(), self._generation, self._note_generation,
                        role=f"dataset{self.student_rank}",
                        heartbeat_interval_s=self.heartbeat_interval_s,
                        heartbeat_liveness=self.heartbeat_liveness, medium=self.medium,
                        tcp_host=self.tcp_host, curve=self.curve, notices=self.notices,
                        notice_dir=self.notice_dir, direct_requests=self.direct_requests)
        if get_worker_info() is not None:
            # DataLoader workers leave through multiprocessing's exit path, which skips
            # atexit and generator cleanup but runs these finalizers: unlink there.
            multiprocessing.util.Finalize(pool, pool.close, exitpriority=10)
        return pool

    def _generation(self) -> int:
        return self.generation_value.value

    def _note_generation(self, generation: int) -> None:
        with self.generation_value.get_lock():
            if generation > self.generation_value.value:
                self.generation_value.value = generation

    def _next(self, pool: SlotPool) -> tuple[int, int, int]:
        return self._next_many(pool, 1)[0]

    def _next_many(self, pool: SlotPool, max_count: int) -> list[tuple[int, int, int]]:
        """1 to ``max_count`` ready slots (slot, generation, request id) of the current
        generation; waits (warning now and then, up to ``timeout_s``) for the first."""
        started = last_warning = time.monotonic()
        misses = 0
        while True:
            got = pool.next_ready_many(max_count, max(self.retry_delay, 0.001) * 1000 * self.max_retries)
            current = self._generation()
            fresh = [entry for entry in got if entry[1] >= current]
            if len(fresh) < len(got):  # went stale while we looked: ask again
                pool.release_many([entry[0] for entry in got if entry[1] < current])
            if fresh:
                return fresh
            if got:
                continue
            misses += 1
            now = time.monotonic()
            if self.timeout_s is not None and now - started > self.timeout_s:
                raise TimeoutError(f"no sample for {self.timeout_s:.0f}s from {self.frontend_endpoint}: "
                                   "are the broker and workers running, and was set_model called?")
            if now - last_warning > WARN_EVERY_S:
                last_warning = now
                log.warning("waiting %.0fs for samples (generation %d): are workers running, and has "
                            "the leader called set_model?", now - started, self._generation())

    def _samples(self, pool: SlotPool) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            slot, gen, req = self._next(pool)
            _, views = pool.slot_tensors(slot, self.batch_config)
            sample = {name: view.clone() for name, view in views.items()}
            pool.release(slot)
            if self.with_meta:
                sample.update(generation=torch.tensor(gen), request_id=torch.tensor(req),
                              source=torch.tensor(pool.source_id))
            yield sample

    def _new_batch(self) -> dict[str, torch.Tensor]:
        return {s.name: torch.empty((self.batch_size, *s.shape), dtype=s.torch_dtype, pin_memory=self.pin_memory)
                for s in self.batch_config.specs}

    def _batches(self, pool: SlotPool) -> Iterator[dict[str, torch.Tensor]]:
        reused = self._new_batch() if self.reuse_batches else None
        while True:
            batch = dict(reused) if reused is not None else self._new_batch()
            gens, reqs, slots = [], [], []
            while len(slots) < self.batch_size:
                ready = self._next_many(pool, self.batch_size - len(slots))
                chunk = [slot for slot, _, _ in ready]
                pool.gather(chunk, self.batch_config, batch, len(slots))
                pool.release_many(chunk)  # copied out: ask for the slots again at once
                pool.flush()
                slots += chunk
                gens += [gen for _, gen, _ in ready]
                reqs += [req for _, _, req in ready]
            if min(gens) < self._generation():  # the model moved on while we filled the batch
                continue
            if self.with_meta:
                batch.update(generation=torch.tensor(gens), request_id=torch.tensor(reqs),
                             source=torch.full((len(slots),), pool.source_id))
            yield batch


def _check_pin_memory(pin_memory: bool, batch_size: int | None, reuse_batches: bool) -> None:
    """Reject pinned batches where they cannot work, naming the setting to change."""
    if not pin_memory:
        return
    if batch_size is None:
        raise ValueError("pin_memory=True needs batch_size=B (it pins the batch tensors)")
    if reuse_batches:
        raise ValueError("pin_memory=True with reuse_batches=True would overwrite a batch while its "
                         "non-blocking copy to the GPU may still read it; choose one")
    if not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA (page-locked memory is for GPU copies); "
                         "leave it False on CPU")
