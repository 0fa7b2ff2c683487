"""DistillIterableDataset: an infinite IterableDataset over slots filled by workers.

Each process that iterates it (the main process, or every DataLoader worker) gets
its own :class:`SlotPool`: its own shared memory and its own socket, created inside
``__iter__`` so nothing unpicklable crosses into DataLoader workers. The shared
``generation_value`` (from ``StudentClient.generation_value``) is read before each
yield: nothing older than the newest generation is ever yielded.

Modes: ``batch_size=None`` (the seed README's) yields one sample per item, small ones
copied out a chunk at a time and large ones lent (``loans.py``); ``batch_size=B``
yields ready batches, each sample copied exactly once from its slot into the batch
and each chunk of slots asked for again as soon as it is copied (the fast path);
``reuse_batches=True`` writes every batch into the same tensors. ``pin_memory=True``
gathers batches straight into page-locked memory from torch's caching host allocator,
which is why it cannot be combined with ``reuse_batches``.

Every setting is a field of :class:`DatasetConfig`, given as ``config=`` and/or as
keyword arguments; ``slot_count`` left out is chosen by ``sizing.py``. See
docs/pipeline.md, sections The Python API and GPU paths.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from distill.pipeline.auth import CurveConfig
from distill.pipeline.batch import BatchConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS
from distill.pipeline.protocol import DEFAULT_RUN
from distill.pipeline.settings import merge
from distill.pipeline.sizing import check_given_slots, chosen_slots
from distill.pipeline.student.loans import LEND_MIN_BYTES, SlotLoans
from distill.pipeline.student.pool import PoolConfig, SlotPool

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
META_KEYS = ("generation", "request_id", "source", "fill")


@dataclass(frozen=True)
class DatasetConfig:
    """Every setting of a :class:`DistillIterableDataset` (the seed README's arguments first)."""

    student_rank: int | None = None
    slot_count: int | None = None
    """Slots of each process's pool (the main process, or each DataLoader worker); None:
    a byte budget against the last-level cache (``sizing.ring_slots``, logged)."""
    batch_config: BatchConfig | None = None
    frontend_endpoint: str | None = None
    max_retries: int = 10
    retry_delay: float = 0.01
    """How long one wait for a sample lasts (``max_retries x retry_delay`` seconds)."""
    run_id: str = DEFAULT_RUN
    batch_size: int | None = None
    """None: one sample per item (the seed README's); B: ready-made batches (the fast path)."""
    with_meta: bool = False
    timeout_s: float | None = None
    """Raise TimeoutError after this long without a sample (None: wait, warning now and then)."""
    reuse_batches: bool = False
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    medium: str = "shm"
    """``shm`` (one machine) or ``tcp`` (workers elsewhere send the samples over TCP)."""
    tcp_host: str | None = None
    curve: CurveConfig | None = None
    """Paths, not keys: each process that iterates reads (and checks) the keys itself."""
    pin_memory: bool = False
    notices: bool = True
    """Let workers on this machine announce filled slots directly (``notices.py``)."""
    socket_dir: str | os.PathLike | None = None
    """Where the inbox for those notices goes (None: the default socket directory); the
    workers must be given the same (``Worker(socket_dir=...)``)."""
    direct_requests: bool = True
    """Ask a slot's last local worker to fill it again, past the broker (needs ``notices``)."""
    pending_deadline_s: float | None = None
    """See :class:`~distill.pipeline.student.pool.PoolConfig`."""

    def __post_init__(self) -> None:
        missing = [name for name in ("student_rank", "batch_config") if getattr(self, name) is None]
        if missing:
            raise ValueError(f"DistillIterableDataset needs {', '.join(missing)} (the seed README's arguments)")
        _check_pin_memory(self.pin_memory, self.batch_size, self.reuse_batches)
        if self.reuse_batches and self.batch_size is None:
            raise ValueError("reuse_batches=True needs batch_size=B (it reuses the batch tensors)")


class DistillIterableDataset(IterableDataset):
    """Infinite stream of ``dict[str, Tensor]`` samples (or batches) from the workers."""

    def __init__(self, student_rank: int | None = None, generation_value: Any = None,
                 slot_count: int | None = None, batch_config: BatchConfig | None = None,
                 frontend_endpoint: str | None = None, max_retries: int | None = None,
                 retry_delay: float | None = None, *, config: DatasetConfig | None = None,
                 **options: Any) -> None:
        super().__init__()
        cfg = self.config = merge(DatasetConfig, config, {
            "student_rank": student_rank, "slot_count": slot_count, "batch_config": batch_config,
            "frontend_endpoint": frontend_endpoint, "max_retries": max_retries, "retry_delay": retry_delay,
            **options}, "DistillIterableDataset")
        if generation_value is None:
            raise ValueError("DistillIterableDataset needs generation_value (StudentClient.generation_value)")
        self.generation_value = generation_value
        self.frontend_endpoint = cfg.frontend_endpoint or default_endpoint("frontend")
        if cfg.curve is not None:
            cfg.curve.client_keys()  # a bad key fails here, not later in every DataLoader worker
        if isinstance(cfg.slot_count, int) and cfg.slot_count > 0:
            check_given_slots("DistillIterableDataset", cfg.slot_count, cfg.batch_config)

    # The settings the seed README names, as attributes (all of them: ``config``).
    student_rank = property(lambda self: self.config.student_rank)
    @property
    def slot_count(self) -> int:
        """The slots of each pool: as given, or chosen from the sample's bytes (``sizing.py``)."""
        return self.config.slot_count or chosen_slots("DistillIterableDataset", self.config.batch_config)
    batch_config = property(lambda self: self.config.batch_config)
    batch_size = property(lambda self: self.config.batch_size)
    max_retries = property(lambda self: self.config.max_retries)
    retry_delay = property(lambda self: self.config.retry_delay)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.config.reuse_batches and get_worker_info() is not None:
            raise ValueError("reuse_batches=True in a DataLoader worker: the worker hands each batch "
                             "to the training process through shared memory, and reusing it would "
                             "overwrite batches not yet consumed; use num_workers=0 or reuse_batches=False")
        if self.config.pin_memory and get_worker_info() is not None:
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
        cfg = self.config
        pool = SlotPool(generation=self._generation, note_generation=self._note_generation, config=PoolConfig(
            frontend_endpoint=self.frontend_endpoint, run_id=cfg.run_id, slot_count=self.slot_count,
            payload_bytes=cfg.batch_config.nbytes(), role=f"dataset{cfg.student_rank}",
            heartbeat_interval_s=cfg.heartbeat_interval_s, heartbeat_liveness=cfg.heartbeat_liveness,
            medium=cfg.medium, tcp_host=cfg.tcp_host, curve=cfg.curve, notices=cfg.notices,
            socket_dir=cfg.socket_dir, direct_requests=cfg.direct_requests,
            pending_deadline_s=cfg.pending_deadline_s))
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
            if self.config.timeout_s is not None and now - started > self.config.timeout_s:
                raise TimeoutError(f"no sample for {self.config.timeout_s:.0f}s from {self.frontend_endpoint}: "
                                   "are the broker and workers running, and was set_model called?")
            if now - last_warning > WARN_EVERY_S:
                last_warning = now
                log.warning("waiting %.0fs for samples (generation %d) from the broker at %s, which %s: are "
                            "workers running, and has the leader called set_model?", now - started,
                            self._generation(), self.frontend_endpoint, _workers_seen(pool.heart.workers))

    def _samples(self, pool: SlotPool) -> Iterator[dict[str, torch.Tensor]]:
        """One sample per item: every slot ready is taken at once, so the requests and
        notices per sample fall with the pool's size (one datagram each way per chunk, not
        per sample); large samples are lent as views of their slots (``loans.py``), small
        ones copied a chunk at a time."""
        if self.batch_config.nbytes() >= LEND_MIN_BYTES:
            yield from self._lent_samples(pool, SlotLoans(self.batch_config, pool.config.slot_count // 2))
            return
        half = max(1, pool.config.slot_count // 2)
        while True:
            ready = self._next_many(pool, half)  # half a ring: the workers fill the other half meanwhile
            slots = [slot for slot, _, _ in ready]
            chunk = pool.take_out(slots, self.batch_config)
            fills = [pool.fill_number(slot) for slot in slots] if self.config.with_meta else None
            pool.release_many(slots)  # copied out: ask for them again before yielding any
            pool.flush()
            for row, (_, gen, req) in enumerate(ready):
                if gen < self._generation():  # the model moved on while we yielded
                    continue
                sample = {name: tensor[row] for name, tensor in chunk.items()}
                if fills is not None:
                    sample.update(self._meta(pool, gen, req, fills[row]))
                yield sample

    def _lent_samples(self, pool: SlotPool, loans: SlotLoans) -> Iterator[dict[str, torch.Tensor]]:
        """Large samples: views of their slots while the consumer holds them. No more slots
        are taken than may be lent (a consumer that holds the limit gets copies, one at a
        time); slots whose loans ended are asked for again half the ring at a time (and
        before any wait): the workers fill one half while the consumer reads the other, and
        each round trip (a DIRECT, a notice, the headers checked: about 140 us of the
        consumer's CPU here) is spread over half the ring, not a quarter (256 KiB samples,
        the ring chosen: 23.6k -> 27.6k samples/s, ``bench/pipeline.py --defaults``)."""
        with_meta = self.config.with_meta
        payloads: dict[int, memoryview] = {}  # each slot's payload view, made once
        while True:
            pool.release_many(loans.returned())
            for slot, gen, req in self._next_many(pool, max(1, loans.limit - loans.out)):
                if gen < self._generation():
                    pool.release_many([slot])
                    continue
                fill = pool.fill_number(slot) if with_meta else 0
                if loans.room():
                    payload = payloads.get(slot)
                    if payload is None:
                        payload = payloads[slot] = pool.payload_view(slot)
                    sample = loans.lend(slot, payload)
                else:
                    _, views = pool.slot_tensors(slot, self.batch_config)
                    sample = {name: view.clone() for name, view in views.items()}
                    pool.release_many([slot])
                if with_meta:
                    sample.update(self._meta(pool, gen, req, fill))
                yield sample
                del sample  # ours no longer: its loan ends when the consumer lets go
                if loans.waiting() >= max(1, loans.limit):  # half the ring: one ask, one datagram
                    pool.release_many(loans.returned())
                    pool.flush()

    @staticmethod
    def _meta(pool: SlotPool, gen: int, req: int, fill: int) -> dict[str, torch.Tensor]:
        return {"generation": torch.tensor(gen), "request_id": torch.tensor(req),
                "source": torch.tensor(pool.source_id), "fill": torch.tensor(fill)}

    def _new_batch(self) -> dict[str, torch.Tensor]:
        return {s.name: torch.empty((self.batch_size, *s.shape), dtype=s.torch_dtype, pin_memory=self.config.pin_memory)
                for s in self.batch_config.specs}

    def _batches(self, pool: SlotPool) -> Iterator[dict[str, torch.Tensor]]:
        reused = self._new_batch() if self.config.reuse_batches else None
        while True:
            batch = dict(reused) if reused is not None else self._new_batch()
            gens, reqs, slots, fills = [], [], [], []
            while len(slots) < self.batch_size:
                ready = self._next_many(pool, self.batch_size - len(slots))
                chunk = [slot for slot, _, _ in ready]
                pool.gather(chunk, self.batch_config, batch, len(slots))
                if self.config.with_meta:
                    fills += [pool.fill_number(slot) for slot in chunk]
                pool.release_many(chunk)  # copied out: ask for the slots again at once
                pool.flush()
                slots += chunk
                gens += [gen for _, gen, _ in ready]
                reqs += [req for _, _, req in ready]
            if min(gens) < self._generation():  # the model moved on while we filled the batch
                continue
            if self.config.with_meta:
                batch.update(generation=torch.tensor(gens), request_id=torch.tensor(reqs),
                             source=torch.full((len(slots),), pool.source_id), fill=torch.tensor(fills))
            yield batch


def _workers_seen(workers: int | None) -> str:
    """What the broker's last heartbeat answer said of its teacher workers."""
    if workers is None:
        return "has not answered a heartbeat yet"
    return f"has {workers} live worker{'s' if workers != 1 else ''}"


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
