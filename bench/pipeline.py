"""Pipeline throughput: samples/s and GB/s delivered into student tensors.

Measures, in one run and side by side, how fast samples of 4 KiB, 256 KiB and
4 MiB reach a training batch tensor in the consuming (student) process:

- ``cold memcpy``: one thread copies batches out of a 1 GiB source ring (far larger
  than the CPU caches) into the batch tensor, with torch's ``copy_`` and with the C
  library's ``memmove``; the faster is kept. The physical limit of one consumer.
- ``memcpy + filler``: the cold memcpy while 1 other process does nothing but
  ``fill_sample`` into its own ring of the pipeline's footprint (``slot_count``
  samples), as fast as it can: what a producer writing memory at the same time costs
  the consumer's copy, with no handoff at all.
- ``shm handoff``: the least any shared-memory transport can do. Each of 1 or 2
  producer processes fills the slots of its own ring in shared memory and sets a
  per-slot flag; the consumer polls the flags (yielding the CPU while it waits) and
  copies each ready run of slots into the batch, as the pipeline's student does. No
  messages, no broker, no checks: the ceiling of a transport in which one process
  writes each sample and another copies it, on this machine (the producers' writes
  share the memory bandwidth with the consumer's copy; ``cold memcpy`` has no producer).
- ``pipe handoff``: the same rings, but waiting sleeps: each producer sends the
  index of every slot it filled down a pipe and blocks on a second pipe for freed
  slots when it has none; the consumer blocks on the first pipe and sends back each
  run it copied. Two small messages per slot, straight between the two processes (no
  broker, no ZeroMQ I/O threads): the ceiling of a transport that does not spin.
- ``copy + pipe handoff`` (method ``pipecopy``; ``--defaults`` adds it and ``pipe``):
  the same, but each producer makes the sample in a buffer of its own and copies it into
  the slot, as a worker must for a ``generator_fn`` that returns its sample (bytes or
  tensors): the ceiling of any transport that serves that API, against which the
  README's generator rows are set.
- ``mp.Queue``: 1 or 2 producer processes put tensors on a
  ``torch.multiprocessing`` queue; the consumer copies each one into the batch.
- ``DataLoader``: a ``torch.utils.data.DataLoader`` with 2 worker processes
  yields collated batches; the consumer copies each batch into its batch tensor.
- ``pipeline``: a broker process and 1 or 2 worker processes of
  ``distill.pipeline`` fill the student's shared-memory slots; the student (this
  process) copies every slot into a batch, either with
  ``DistillIterableDataset(batch_size=B, reuse_batches=True)`` (``pipeline/dataset``:
  one ``index_select`` per ready chunk of slots), or with
  ``StudentClient.request_sample``, ``batch[i].copy_(ref.tensors["x"])`` and
  ``release_slot`` (``pipeline/client``: one copy per sample). Workers announce filled
  slots to the student directly, and the student asks the worker that filled a slot
  to fill it again straight through that worker's datagram socket, past the broker
  (the defaults; ``distill/pipeline/notices.py``: two datagrams per round trip);
  ``pipeline/notices`` is the dataset with ``direct_requests=False`` (every REQUEST
  through the broker, completions direct: two ZeroMQ hops plus one datagram);
  ``pipeline/relay`` the dataset with ``notices=False`` (four ZeroMQ hops). These cells
  are labelled ``pipeline/<method>`` after their ``--methods`` name, not after a module
  (the student's are ``distill/pipeline/student/dataset.py`` and ``client.py``).
- ``defaults``: the README's path with every default (``--defaults``): workers with a
  ``generator_fn`` that fills its own tensor and returns ``BatchConfig.encode`` of it
  (large samples: written straight into the slot, ``distill/pipeline/encode_sink.py``)
  and the Worker's default ``max_batch``, a ``StudentClient(slot_count=16)`` and a
  ``DistillIterableDataset`` without ``slot_count`` or ``batch_size`` (distill chooses
  the ring from the sample size and the CPU cache, ``distill/pipeline/sizing.py``),
  whose samples the consumer copies one by one into the batch (row ``README``). Row
  ``tensors``: the same with the ``generator_fn`` returning the sample's tensor by name
  (and the Worker given ``batch_config``), which the worker copies straight into the
  slot. Row ``batch_fn``: the same student with ``batch_fn`` workers (``fill_sample``
  straight into the slots, default ``max_batch``): the student's default path without
  the generator's own work (its own tensor, then the copy into the slot). Rows ``8
  slots``, ``tensors, 8 slots`` and ``batch_fn, 8 slots``: the three with the seed
  README's explicit ``slot_count=8`` (used exactly as given). Its table sets each
  beside the best tuned pipeline cell of the same size and worker count: what a user who
  follows the README gets, against what the tuned arguments give (issue 23 wants >= 0.9
  at 256 KiB and 4 MiB, and >= 20x softs 0.1.2 at 4 KiB).
- ``softs 0.1.2`` (``--defaults``, when ``softs`` is installed, e.g. ``pip install softs==0.1.2``
  in a throwaway venv; skipped with a line saying so otherwise): the seed's later
  release on the same terms, a softs ``Broker`` process, ``Supplier`` processes whose
  ``generator_fn`` returns each sample's bytes and a ``SoftIterableDataset`` with its
  default ``num_slots=8``, whose samples the consumer copies one by one into the batch:
  what the README's path is compared with at 4 KiB (issue 23 wants >= 20x).
- ``tcp pipeline``: the same with the network medium (``medium="tcp"``): the
  workers are told not to map the student's segment, so every sample crosses
  loopback TCP (worker staging buffer -> ZeroMQ -> the student's slot -> batch).
- ``bare zmq``: what the network medium rides on, without it: 1 or 2 processes
  PUSH samples over loopback TCP to a PULL socket in the consumer, which copies
  each one into the batch. The network medium's reference.

Every producer does the same minimal work per sample, ``fill_sample``: it fills
the sample with one byte derived from a counter (one ``fill_`` call, every byte
written, no random numbers). Every consumer touches every byte it is handed
exactly once, by copying it into a preallocated training batch tensor
(``pipeline/dataset``: the batch tensors the dataset reuses).
Every process runs torch with one thread; processes are started with ``spawn``.

Each cell warms up, then measures for ``--seconds`` cut in 8 sub-windows and
reports the median sub-window rate (the machine may be shared: a burst of foreign
load spoils a sub-window, not the cell). The memcpy reference is measured twice
per size, before and after the other methods, and the faster run is kept. Ratios
compare cells of the same run.

``round trip`` (method ``rtt``): the control path alone. A student with one 4 KiB
slot asks for it, takes it and gives it back, over and over, served by one worker
with ``max_batch=1``: microseconds per round trip, straight to the worker (``lane``),
through the broker with a direct notice back, and relayed by the broker both ways,
alternating, three windows each (median).

``--rounds N`` measures every cell of a size N times, round after round (each
round has its own cold memcpy before and after), and adds a table of each cell's
ratio to its own round's memcpy: median, lowest and highest over the rounds. On a
shared machine one run's ratio can land anywhere in a wide spread (where the
scheduler happens to place the processes, a neighbour's memory traffic); the
median over rounds is the figure to compare, and what the verdict then uses.

``--auth`` adds the pipeline cells over TCP loopback, without and with CurveZMQ
(``pipeline/<consumer> tcp`` and ``... tcp+curve``), and a table of their ratio:
the throughput cost of authentication. Only control messages (REQUEST, WORK, DONE,
COMPLETE, heartbeats) are encrypted; sample data still goes through shared memory.

A second table splits the CPU time of each measuring window by process role
(broker, producers/workers, consumer/student), per delivered sample, read from
``/proc/<pid>/stat`` (all threads: ZeroMQ I/O threads, heartbeats) before and after.

Run it from the repository root::

    python bench/pipeline.py               # full table, about 3 minutes
    python bench/pipeline.py --quick       # smoke run, about a minute
    python bench/pipeline.py --seconds 5   # longer measuring windows
    python bench/pipeline.py --auth --methods dataset,client   # + TCP, TCP + CurveZMQ
    python bench/pipeline.py --sizes 4MiB --methods memcpy,handoff,pipe,dataset --slot-count 6
                                           # every ring and the student's pool: 6 slots
    python bench/pipeline.py --methods dataset,notices,relay,rtt   # direct requests, notices, broker relay
    python bench/pipeline.py --methods memcpy,dataset,client --defaults   # the README's defaults beside tuned
    python bench/pipeline.py --sizes 4MiB --methods memcpy,dataset --rounds 7   # the spread, round by round

Ctrl-C stops it cleanly: child processes are stopped (and die with this process
anyhow), shared-memory segments are unlinked, IPC sockets removed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import itertools
import logging
import os
import queue
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.multiprocessing
import torch.utils.data
import zmq
from children import SPAWN, Children, child_init, run_broker  # bench/children.py

from distill.pipeline import (
    BatchConfig,
    DistillIterableDataset,
    StudentClient,
    TensorSpec,
    Worker,
)
from distill.pipeline.auth import CurveConfig, create_keys
from distill.pipeline.batch import copy_rows
from distill.pipeline.endpoints import SOCKET_NAMES
from distill.pipeline.mediums.shm import SHM_DIR, list_segments

RING_BYTES = 1 << 30
QUICK_RING_BYTES = 256 << 20
DEFAULT_SECONDS = 4.0
QUICK_SECONDS = 0.3
SUB_WINDOWS = 8
FIRST_BATCH_TIMEOUT_S = 30.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Size:
    """One sample size and the batching every method uses for it."""

    label: str
    sample_bytes: int
    batch_size: int
    """Samples per training batch, for every method."""
    slot_count: int
    """Pipeline: slots the student owns (a few batches in flight)."""
    worker_batch: int
    """Pipeline: a worker's ``max_batch`` (slots per WORK)."""


SIZES = (
    Size("4 KiB", 4 << 10, batch_size=256, slot_count=2048, worker_batch=512),
    Size("256 KiB", 256 << 10, batch_size=32, slot_count=128, worker_batch=32),
    # 4 MiB: a ring of 32 MiB (distill's MAX_RING_BYTES), filled 4 slots a batch. Measured
    # on the 2-core machine, one run, 1 / 2 workers (docs/benchmarks.md, "A worker batch
    # of 16 MiB"): 3 slots a batch of 1, 2.37k / 2.35k samples/s; 7 slots, 1: 2.75k /
    # 2.72k; 7, 4: 2.76k / 2.76k; 8, 4: 2.91k / 2.93k. 16 slots (64 MiB) leave the cache.
    Size("4 MiB", 4 << 20, batch_size=4, slot_count=8, worker_batch=4),
)


@dataclass
class Result:
    """One measured cell of the table."""

    size: Size
    method: str
    procs: int
    samples: int
    seconds: float
    window_rates: list[float]
    """Samples/s of each sub-window of the measuring window."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds spent during the window, by role."""
    round: int = 0
    """Which round of ``--rounds`` measured it."""

    @property
    def rate(self) -> float:
        """Median samples/s over the sub-windows (robust to bursts of foreign load)."""
        return statistics.median(self.window_rates) if self.window_rates else self.samples / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.rate * self.size.sample_bytes / 1e9

    def us_per_sample(self, role: str) -> float | None:
        cpu = self.cpu_s.get(role)
        return None if cpu is None else cpu / self.samples * 1e6


# --------------------------------------------------------------------------- producers
def fill_sample(out: torch.Tensor, counter: int) -> None:
    """What every producer does per sample: write each byte once, no RNG."""
    out.fill_(counter & 0xFF)


def sample_config(sample_bytes: int) -> BatchConfig:
    return BatchConfig([TensorSpec("x", (sample_bytes,), "uint8")])


def fill_targets(model_id: str, model_cfg: dict | None, targets: list) -> None:
    """The pipeline worker's ``batch_fn``: ``fill_sample`` straight into each slot."""
    for target in targets:
        fill_sample(target.tensors["x"], target.request_id)


def fresh_samples(sample_bytes: int) -> Iterator[torch.Tensor]:
    """Endless ``fill_sample``-ed tensors, each in a fresh buffer (what the mp.Queue,
    DataLoader and bare ZeroMQ producers hand over)."""
    counter = 0
    while True:
        sample = torch.empty(sample_bytes, dtype=torch.uint8)
        fill_sample(sample, counter)
        counter += 1
        yield sample


class ConstantStream(torch.utils.data.IterableDataset):
    """The DataLoader's dataset: endless ``fill_sample``-ed tensors."""

    def __init__(self, sample_bytes: int) -> None:
        super().__init__()
        self.sample_bytes = sample_bytes

    def __iter__(self) -> Iterator[torch.Tensor]:
        return fresh_samples(self.sample_bytes)


# --------------------------------------------------------------------------- child processes
def run_queue_producer(parent_pid: int, ready, samples: queue.Queue, sample_bytes: int) -> None:
    child_init(parent_pid)
    ready.set()
    for sample in fresh_samples(sample_bytes):
        samples.put(sample)


def run_worker(parent_pid: int, ready, endpoints: dict[str, str], sample_bytes: int,
               max_batch: int, local_shm: bool = True, curve: CurveConfig | None = None) -> None:
    child_init(parent_pid)
    worker = Worker(batch_fn=fill_targets, batch_config=sample_config(sample_bytes), max_batch=max_batch,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    local_shm=local_shm, curve=curve)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())  # leave with BYE: the broker stays quiet
    ready.set()
    worker.run()


class EncodedSamples:
    """The README worker's ``generator_fn``: one sample's bytes, ``fill_sample``-ed and
    encoded (the copy the generator API costs)."""

    def __init__(self, sample_bytes: int) -> None:
        self.config = sample_config(sample_bytes)
        self.sample = torch.empty(sample_bytes, dtype=torch.uint8)
        self.counter = 0

    def __call__(self, model_id: str, model_cfg: dict | None) -> bytes:
        self.counter += 1
        fill_sample(self.sample, self.counter)
        return self.config.encode(x=self.sample)


class TensorSamples(EncodedSamples):
    """The generator API's fast path: the same ``fill_sample``-ed sample, returned as its
    tensor by name (the worker copies it straight into the slot: no ``encode``)."""

    def __call__(self, model_id: str, model_cfg: dict | None) -> dict[str, torch.Tensor]:
        self.counter += 1
        fill_sample(self.sample, self.counter)
        return {"x": self.sample}


def run_default_tensor_worker(parent_pid: int, ready, endpoints: dict[str, str], sample_bytes: int) -> None:
    """The README's worker whose ``generator_fn`` returns tensors by name, so it is given
    ``batch_config`` in place of ``slot_size``; all else default."""
    child_init(parent_pid)
    _serve(Worker(generator_fn=TensorSamples(sample_bytes), batch_config=sample_config(sample_bytes),
                  backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]), ready)


def run_default_worker(parent_pid: int, ready, endpoints: dict[str, str], sample_bytes: int) -> None:
    """A worker as the README starts it: ``generator_fn`` and ``slot_size``, all else default."""
    child_init(parent_pid)
    _serve(Worker(generator_fn=EncodedSamples(sample_bytes), slot_size=sample_bytes,
                  backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]), ready)


def _serve(worker: Worker, ready) -> None:
    """Run ``worker`` until SIGTERM, saying ready first."""
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    ready.set()
    worker.run()


def run_softs_broker(parent_pid: int, ready, frontend: str, backend: str) -> None:
    """softs 0.1.2's broker (a thread of this process), until stopped."""
    child_init(parent_pid)
    import softs  # the optional comparison: only this cell imports it

    softs.Broker(softs.EndpointConfig(frontend=frontend, backend=backend)).start()
    ready.set()
    while True:
        time.sleep(3600)


def run_softs_supplier(parent_pid: int, ready, backend: str, sample_bytes: int) -> None:
    """softs 0.1.2's supplier with the README-style generator (one sample's bytes per call)."""
    child_init(parent_pid)
    import softs

    samples = EncodedSamples(sample_bytes)
    supplier = softs.Supplier(generator_fn=lambda product_id: samples(product_id, None), product_ids=[".*"],
                              endpoint=backend, medium_cls=softs.ShmMedium, slot_size=sample_bytes)
    supplier.start()
    ready.set()
    while True:
        time.sleep(3600)


def run_default_batch_worker(parent_pid: int, ready, endpoints: dict[str, str], sample_bytes: int) -> None:
    """The README's worker with ``batch_fn`` instead of ``generator_fn`` (every other
    argument at its default): the student's default path without the generator API's
    own copies (encode, then bytes into the slot)."""
    child_init(parent_pid)
    _serve(Worker(batch_fn=fill_targets, batch_config=sample_config(sample_bytes),
                  backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]), ready)


def run_filler(parent_pid: int, ready, sample_bytes: int, slots: int) -> None:
    """``memcpy + filler``: fill the samples of a private ring, in turn, forever."""
    child_init(parent_pid)
    ring = torch.empty((slots, sample_bytes), dtype=torch.uint8)
    ready.set()
    counter = 0
    while True:
        fill_sample(ring[counter % slots], counter)
        counter += 1


def run_handoff_producer(parent_pid: int, ready, ring: torch.Tensor, flags: torch.Tensor) -> None:
    """Ideal handoff: fill the next slot of ``ring`` once the consumer has cleared its flag."""
    child_init(parent_pid)
    ready.set()
    full = flags.numpy()
    counter = 0
    while True:
        for slot in range(len(full)):
            while full[slot]:
                os.sched_yield()
            fill_sample(ring[slot], counter)
            counter += 1
            full[slot] = 1  # x86 keeps stores in order: the flag lands after the sample


def run_pipe_producer(parent_pid: int, ready, ring: torch.Tensor, filled, freed, own_buffer: bool = False) -> None:
    """Pipe handoff: fill a free slot and send its index on ``filled``; with no slot
    free, sleep on ``freed`` until the consumer sends some back. ``own_buffer``: fill a
    buffer of the producer's own and copy it into the slot (``memmove``), as a
    ``generator_fn`` that makes its sample and returns it must be served."""
    child_init(parent_pid)
    ready.set()
    free = collections.deque(range(len(ring)))
    scratch = torch.empty(ring.shape[1:], dtype=ring.dtype) if own_buffer else None
    counter = 0
    while True:
        if not free:
            free.extend(np.frombuffer(freed.recv_bytes(), dtype=np.int32).tolist())
        slot = free.popleft()
        if scratch is None:
            fill_sample(ring[slot], counter)
        else:
            fill_sample(scratch, counter)
            ctypes.memmove(ring[slot].data_ptr(), scratch.data_ptr(), scratch.numel())
        counter += 1
        filled.send_bytes(np.int32(slot).tobytes())


def run_zmq_pusher(parent_pid: int, ready, endpoint: str, sample_bytes: int) -> None:
    """Bare ZeroMQ: fill a fresh buffer per sample and PUSH it zero-copy, forever."""
    child_init(parent_pid)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.connect(endpoint)
    ready.set()
    for sample in fresh_samples(sample_bytes):
        sock.send(sample.numpy(), copy=sample_bytes < 65536)


# --------------------------------------------------------------------------- measuring
def _cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(_cpu_s(pid) for pid in pids) for role, pids in roles.items()}


def measure(size: Size, method: str, procs: int, step: Callable[[], int], seconds: float,
            roles: dict[str, list[int]]) -> Result:
    """Run ``step`` (returns samples delivered) for a warm-up, then for ``seconds`` cut
    in ``SUB_WINDOWS`` sub-windows; CPU time per role is read around the whole window."""
    step()  # the first batch waits for the producers
    warm_until = time.perf_counter() + max(0.2, seconds / 4)
    while time.perf_counter() < warm_until:
        step()
    before = _cpu_by_role(roles)
    samples, rates, window_s = 0, [], seconds / SUB_WINDOWS
    start = window_start = time.perf_counter()
    window_samples = 0
    while (now := time.perf_counter()) - start < seconds:
        if now - window_start >= window_s:
            rates.append(window_samples / (now - window_start))
            window_start, window_samples = now, 0
        delivered = step()
        samples += delivered
        window_samples += delivered
    elapsed = time.perf_counter() - start
    after = _cpu_by_role(roles)
    result = Result(size, method, procs, samples, elapsed, rates, {r: after[r] - before[r] for r in roles})
    print(f"  {size.label:<8} {method:<26} x{procs}: {result.rate:>12,.0f} samples/s "
          f"{result.gb_per_s:6.2f} GB/s", file=sys.stderr, flush=True)
    return result


def _batch(size: Size) -> torch.Tensor:
    return torch.empty((size.batch_size, size.sample_bytes), dtype=torch.uint8)


# --------------------------------------------------------------------------- methods
def bench_memcpy(size: Size, seconds: float, ring: torch.Tensor) -> Result:
    """One thread copies the next B samples of a cold source ring into the batch, once
    with torch's ``copy_`` and once with libc ``memmove``; the faster cell is returned."""
    source = ring.view(-1, size.sample_bytes)
    num_batches = source.shape[0] // size.batch_size
    batch, position = _batch(size), 0
    nbytes = size.batch_size * size.sample_bytes

    def torch_step() -> int:
        nonlocal position
        start = position * size.batch_size
        batch.copy_(source[start:start + size.batch_size])
        position = (position + 1) % num_batches
        return size.batch_size

    def memmove_step() -> int:
        nonlocal position
        ctypes.memmove(batch.data_ptr(), source[position * size.batch_size].data_ptr(), nbytes)
        position = (position + 1) % num_batches
        return size.batch_size

    roles = {"consumer": [os.getpid()]}
    cells = [measure(size, f"cold memcpy ({name})", 0, step, seconds / 2, roles)
             for name, step in (("copy_", torch_step), ("memmove", memmove_step))]
    best = max(cells, key=lambda r: r.rate)
    best.method = "cold memcpy"
    return best


def bench_filler(size: Size, seconds: float, ring: torch.Tensor) -> Result:
    """The cold memcpy (the student's copy: ``copy_rows``) beside a process that only fills memory."""
    source = ring.view(-1, size.sample_bytes)
    num_batches = source.shape[0] // size.batch_size
    batch, position = _batch(size), 0

    def step() -> int:
        nonlocal position
        first = position * size.batch_size
        copy_rows(source, torch.arange(first, first + size.batch_size), batch)
        position = (position + 1) % num_batches
        return size.batch_size

    with Children() as kids:
        filler = kids.start(run_filler, size.sample_bytes, size.slot_count)
        return measure(size, "memcpy + filler", 1, step, seconds, {"consumer": [os.getpid()], "producers": [filler]})


def bench_handoff(size: Size, seconds: float) -> Iterator[Result]:
    """1, then 2 producers, each with its own ring in shared memory; the rings hold
    ``slot_count`` slots in all, the footprint of the pipeline student's segment (how
    far the producers may run ahead decides whether a slot is still cached when read).
    The consumer takes slots from the rings in turn, a ready run at a time."""
    for count in (1, 2):
        rings = _shared_rings(size, count)
        flags = [torch.zeros(len(ring), dtype=torch.int64).share_memory_() for ring in rings]
        yield _handoff_cell(size, seconds, rings, flags)


def _shared_rings(size: Size, count: int) -> list[torch.Tensor]:
    """``count`` rings in shared memory holding ``slot_count`` samples in all (2 each at least)."""
    per_ring = max(2, size.slot_count // count)
    return [torch.empty((per_ring, size.sample_bytes), dtype=torch.uint8).share_memory_() for _ in range(count)]


def _handoff_cell(size: Size, seconds: float, rings: list[torch.Tensor], flags: list[torch.Tensor]) -> Result:
    """One producer per ring, started on cleared flags and stopped after the cell."""
    batch = _batch(size)
    full = [flag.numpy() for flag in flags]
    cursors, turn = [0] * len(rings), 0

    def step() -> int:
        nonlocal turn
        filled = 0
        while filled < size.batch_size:
            turn = (turn + 1) % len(rings)
            filled += _take_run(rings[turn], full[turn], cursors, turn, batch, filled)
        return size.batch_size

    with Children() as kids:
        producers = [kids.start(run_handoff_producer, ring, flag) for ring, flag in zip(rings, flags, strict=True)]
        return measure(size, "shm handoff", len(rings), step, seconds,
                       {"consumer": [os.getpid()], "producers": producers})


def _take_run(ring: torch.Tensor, full: np.ndarray, cursors: list[int], turn: int, batch: torch.Tensor,
              filled: int) -> int:
    """Wait for the ring's next slot, then copy the run of ready slots after it (up to the
    end of the ring or of the batch) into ``batch[filled:]`` and clear their flags."""
    first = cursors[turn]
    while not full[first]:
        os.sched_yield()
    last = first + 1
    while last < len(full) and last - first < len(batch) - filled and full[last]:
        last += 1
    run = last - first
    copy_rows(ring, torch.arange(first, last), batch[filled:filled + run])
    full[first:last] = 0
    cursors[turn] = last % len(full)
    return run


def bench_pipe_handoff(size: Size, seconds: float, own_buffer: bool = False) -> Iterator[Result]:
    """1, then 2 producers with rings as in ``bench_handoff``; slots are handed over by
    blocking pipe messages instead of polled flags (``own_buffer``: each sample made in
    the producer's own buffer, then copied into its slot)."""
    for count in (1, 2):
        yield _pipe_cell(size, seconds, _shared_rings(size, count), own_buffer)


def _pipe_cell(size: Size, seconds: float, rings: list[torch.Tensor], own_buffer: bool = False) -> Result:
    """The consumer takes the rings in turn: it sleeps until a slot is filled, copies it
    and any others already filled (up to the batch), and sends their indices back."""
    batch, turn = _batch(size), 0
    with Children() as kids:
        pipes, producers = [], []
        for ring in rings:
            filled_out, filled_in = SPAWN.Pipe(duplex=False)
            freed_out, freed_in = SPAWN.Pipe(duplex=False)
            producers.append(kids.start(run_pipe_producer, ring, filled_in, freed_out, own_buffer))
            pipes.append((filled_out, freed_in))

        def step() -> int:
            nonlocal turn
            done = 0
            while done < size.batch_size:
                turn = (turn + 1) % len(rings)
                filled, freed = pipes[turn]
                slots = [int(np.frombuffer(filled.recv_bytes(), dtype=np.int32)[0])]
                while done + len(slots) < size.batch_size and filled.poll(0):
                    slots.append(int(np.frombuffer(filled.recv_bytes(), dtype=np.int32)[0]))
                copy_rows(rings[turn], torch.tensor(slots), batch[done:done + len(slots)])
                freed.send_bytes(np.array(slots, dtype=np.int32).tobytes())
                done += len(slots)
            return size.batch_size

        return measure(size, PIPE_COPY if own_buffer else "pipe handoff", len(rings), step, seconds,
                       {"consumer": [os.getpid()], "producers": producers})


PIPE_COPY = "copy + pipe handoff"
"""The pipe handoff whose producers make each sample in their own buffer and copy it into
the slot: the ceiling of any transport serving a ``generator_fn`` that returns its sample."""


def bench_queue(size: Size, seconds: float) -> Iterator[Result]:
    """1, then 2 processes put tensors on a torch.multiprocessing.Queue."""
    samples = SPAWN.Queue(maxsize=2 * size.batch_size)
    batch = _batch(size)

    def step() -> int:
        for i in range(size.batch_size):
            batch[i].copy_(samples.get(timeout=FIRST_BATCH_TIMEOUT_S))
        return size.batch_size

    try:
        yield from _producer_cells(size, seconds, "mp.Queue", step, run_queue_producer, samples, size.sample_bytes)
    finally:
        samples.cancel_join_thread()
        samples.close()


def _producer_cells(size: Size, seconds: float, method: str, step: Callable[[], int], target: Callable,
                    *args: object) -> Iterator[Result]:
    """The consumer's ``step`` measured with 1, then 2 producer processes ``target(*args)``."""
    with Children() as kids:
        producers: list[int] = []
        for count in (1, 2):
            producers.append(kids.start(target, *args))
            yield measure(size, method, count, step, seconds, {"consumer": [os.getpid()], "producers": list(producers)})


def bench_dataloader(size: Size, seconds: float, num_workers: int = 2) -> Iterator[Result]:
    """A DataLoader with ``num_workers`` spawned workers collating batches."""
    loader = torch.utils.data.DataLoader(ConstantStream(size.sample_bytes), batch_size=size.batch_size,
                                         num_workers=num_workers, multiprocessing_context="spawn")
    batch = _batch(size)
    batches = iter(loader)

    def step() -> int:
        batch.copy_(next(batches))
        return size.batch_size

    try:
        roles = {"consumer": [os.getpid()], "producers": [w.pid for w in batches._workers]}
        yield measure(size, "DataLoader", num_workers, step, seconds, roles)
    finally:
        batches._shutdown_workers()  # what the iterator's __del__ does, but now


@dataclass
class Transport:
    """Where the pipeline cells' broker listens, and with which keys (``--auth``)."""

    label: str
    """Appended to the method name: '' (ipc), 'tcp' or 'tcp+curve'."""
    endpoints: dict[str, str]
    broker: CurveConfig | None = None
    worker: CurveConfig | None = None
    student: CurveConfig | None = None
    broker_pid: int = 0


def transports(sock_dir: str, auth: bool) -> list[Transport]:
    """ipc always; with ``auth``, TCP loopback without and with CurveZMQ (keys in ``sock_dir``)."""
    ipc = Transport("", {name: f"ipc://{sock_dir}/{name}.sock" for name in SOCKET_NAMES})
    if not auth:
        return [ipc]
    keys_dir = os.path.join(sock_dir, "keys")
    create_keys(keys_dir, ["worker", "student"])
    curve = Transport("tcp+curve", _loopback_endpoints(), broker=CurveConfig.from_keys_dir(keys_dir),
                      worker=CurveConfig.from_keys_dir(keys_dir, "worker"),
                      student=CurveConfig.from_keys_dir(keys_dir, "student"))
    return [ipc, Transport("tcp", _loopback_endpoints()), curve]


def _loopback_endpoints() -> dict[str, str]:
    ports = {}
    for name in SOCKET_NAMES:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports[name] = sock.getsockname()[1]
    return {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}


def bench_pipeline(size: Size, seconds: float, transport: Transport, consumers: list[str]) -> Iterator[Result]:
    """1, then 2 worker processes fill the student's slots; the student is this process."""
    config = sample_config(size.sample_bytes)
    endpoints = transport.endpoints
    suffix = f" {transport.label}" if transport.label else ""
    with Children() as kids:
        workers = []
        for count in (1, 2):
            workers.append(kids.start(run_worker, endpoints, size.sample_bytes, size.worker_batch,
                                      True, transport.worker))
            roles = {"consumer": [os.getpid()], "broker": [transport.broker_pid], "producers": list(workers)}
            for consumer in consumers:
                slots = size.slot_count if consumer == "client" else 1
                with StudentClient(0, slots, config, endpoints["frontend"], endpoints["control"],
                                   endpoints["control_pub"], curve=transport.student,
                                   run_id=cell_run_id()) as client:
                    client.hello()
                    _settle(client, count)
                    client.set_model(f"bench-{size.sample_bytes}")
                    with _pipeline_step(size, client, config, endpoints, consumer, transport.student) as step:
                        yield measure(size, f"pipeline/{consumer}{suffix}", count, step, seconds, roles)


_CELL_RUNS = itertools.count()


def cell_run_id() -> str:
    """A run of its own for each cell's student. Cells follow each other on one broker, and
    a run's first ``set_model`` claims it for that client's leader secret: a later client
    in the same run would be refused as not its leader until the broker forgets the run
    (``run_grace_s`` after its last peer)."""
    return f"bench-cell-{next(_CELL_RUNS)}"


README_CLIENT_SLOTS, README_DATASET_SLOTS = 16, 8
"""The slot counts of the README's student example."""


DEFAULT_WORKERS = {"defaults (README)": (run_default_worker, None),
                   "defaults, tensors": (run_default_tensor_worker, None),
                   "defaults, batch_fn": (run_default_batch_worker, None),
                   "defaults, 8 slots": (run_default_worker, README_DATASET_SLOTS),
                   "defaults, tensors, 8 slots": (run_default_tensor_worker, README_DATASET_SLOTS),
                   "defaults, batch_fn, 8 slots": (run_default_batch_worker, README_DATASET_SLOTS)}
"""Each default row: its workers (the README's ``generator_fn`` returning bytes, the
same returning tensors by name, or ``batch_fn``) and the dataset's ``slot_count`` (None:
left out, as docs/pipeline.md shows it, and distill chooses the ring; or the seed
README's explicit 8, used exactly as given)."""


def bench_defaults(size: Size, seconds: float, endpoints: dict[str, str], broker_pid: int) -> Iterator[Result]:
    """The README's path, every argument at its default, with 1 then 2 workers; then the
    same student with tensor-returning and ``batch_fn`` workers; then the three with the
    seed README's explicit ``slot_count=8``."""
    for method, (target, slots) in DEFAULT_WORKERS.items():
        yield from _default_cells(size, seconds, endpoints, broker_pid, method, target, slots)


def _default_cells(size: Size, seconds: float, endpoints: dict[str, str], broker_pid: int, method: str,
                   target: Callable, slots: int | None) -> Iterator[Result]:
    config = sample_config(size.sample_bytes)
    batch = _batch(size)
    with Children() as kids:
        workers = []
        for count in (1, 2):
            workers.append(kids.start(target, endpoints, size.sample_bytes))
            roles = {"consumer": [os.getpid()], "broker": [broker_pid], "producers": list(workers)}
            with StudentClient(0, README_CLIENT_SLOTS, config, endpoints["frontend"], endpoints["control"],
                               endpoints["control_pub"], run_id=cell_run_id()) as client:
                client.hello()
                _settle(client, count)
                client.set_model(f"defaults-{size.sample_bytes}-{count}-{len(method)}")
                dataset = DistillIterableDataset(0, client.generation_value, slots, config,
                                                 endpoints["frontend"], timeout_s=FIRST_BATCH_TIMEOUT_S,
                                                 run_id=client.run_id)
                samples = iter(dataset)
                try:
                    yield measure(size, method, count, _one_by_one(samples, batch), seconds, roles)
                finally:
                    samples.close()


def _settle(client: StudentClient, workers: int, timeout_s: float = 15.0) -> None:
    """Wait until the broker counts exactly ``workers`` live workers: the previous cell's,
    stopped without a goodbye, count until their heartbeats lapse (3 s), and a student
    splits its slots among every worker the broker counts (``custody.direct_share``)."""
    deadline = time.monotonic() + timeout_s
    while client.live_workers != workers and time.monotonic() < deadline:
        time.sleep(0.1)
    if client.live_workers != workers:
        print(f"  (the broker still counts {client.live_workers} workers, not {workers})", file=sys.stderr)


def _one_by_one(samples: Iterator[dict[str, torch.Tensor]], batch: torch.Tensor) -> Callable[[], int]:
    """A step that fills ``batch`` one sample at a time from a per-sample iterator, as the
    README's loop (and softs') does; returns how many samples it took."""
    def step() -> int:
        for row in batch:
            row.copy_(next(samples)["x"])
        return len(batch)

    return step


def softs_installed() -> bool:
    try:
        import softs  # noqa: F401  (the optional comparison)
    except ImportError:
        return False
    return True


def bench_softs(size: Size, seconds: float, sock_dir: str) -> Iterator[Result]:
    """softs 0.1.2 on the README's terms: its dataset's default ``num_slots``, 1 then 2 suppliers."""
    import softs

    frontend, backend = f"ipc://{sock_dir}/softs-frontend.sock", f"ipc://{sock_dir}/softs-backend.sock"
    config = softs.BatchConfig([softs.TensorSpec("x", (size.sample_bytes,), "uint8")])
    batch = _batch(size)
    with Children() as kids:
        broker = kids.start(run_softs_broker, frontend, backend)
        suppliers: list[int] = []
        for count in (1, 2):
            suppliers.append(kids.start(run_softs_supplier, backend, size.sample_bytes))
            dataset = softs.SoftIterableDataset(model_id=f"softs-{size.sample_bytes}", endpoint=frontend,
                                                batch_config=config, medium_cls=softs.ShmMedium,
                                                request_timeout=FIRST_BATCH_TIMEOUT_S)
            samples = iter(dataset)
            try:
                yield measure(size, "softs 0.1.2", count, _one_by_one(samples, batch), seconds,
                              {"consumer": [os.getpid()], "broker": [broker], "producers": list(suppliers)})
            finally:
                samples.close()
                if dataset._client is not None:
                    dataset._client.close()


def print_defaults(results: list[Result], sizes: tuple[Size, ...]) -> None:
    """The README's defaults beside the best tuned pipeline cell, same size, workers and
    round; with ``--rounds``, each figure is the median over the rounds of that round's
    ratio (the verdict's spread follows it)."""
    rounds = max(r.round for r in results) + 1
    print("\nout of the box: the README's API with default arguments / the best tuned pipeline cell "
          f"(same size, same worker count, same round; median of {rounds} round(s))")
    print("/ ideal: against the pipe handoff of the same worker count, whose producers fill the slot (batch_fn "
          "rows) or make the sample in their own buffer and copy it in (generator rows: README, tensors)")
    print(f"{'size':<8} {'row':<20} {'workers':>7} {'defaults/s':>12} {'tuned/s':>12} {'/ tuned':>8} {'/ memcpy':>9} "
          f"{'/ ideal':>8} {'softs/s':>10} {'/ softs':>8}  target")
    for size in sizes:
        for method, procs in itertools.product(DEFAULT_WORKERS, (1, 2)):
            per_round = [_default_ratios(results, size, method, procs, turn) for turn in range(rounds)]
            per_round = [row for row in per_round if row is not None]
            if not per_round:
                continue
            row = {key: _median(r[key] for r in per_round) for key in per_round[0]}
            check = "softs" if size.label == "4 KiB" else "tuned"
            spread = [r[check] for r in per_round if r[check] is not None]
            goal = 20.0 if check == "softs" else 0.9
            verdict = "-" if row[check] is None else (
                f"/ {check} >= {goal:g}: {'met' if row[check] >= goal else 'MISSED'}"
                + (f" [{min(spread):.2f}-{max(spread):.2f}]" if len(spread) > 1 else ""))
            print(f"{size.label:<8} {method.removeprefix('defaults').strip(' (),') or '-':<20} {procs:>7} "
                  f"{row['rate']:>12,.0f} {_fmt(row['tuned_rate'], 0):>12} {_fmt(row['tuned']):>8} "
                  f"{_fmt(row['memcpy']):>9} {_fmt(row['ideal']):>8} {_fmt(row['softs_rate'], 0):>10} "
                  f"{_fmt(row['softs'], 1):>8}  {verdict}")
    if not any(r.method.startswith("softs") for r in results):
        print("(no softs column: softs is not installed; `pip install softs==0.1.2` in a throwaway venv adds it)")


def _default_ratios(results: list[Result], size: Size, method: str, procs: int,
                    turn: int) -> dict[str, float | None] | None:
    """One round's figures for a default row: its rate, and its ratio to the tuned, memcpy,
    ideal and softs cells of that round (None where a cell was not measured)."""
    cells = [r for r in results if r.round == turn]
    defaults = _exact(cells, size, method, procs)
    if defaults is None:
        return None
    tuned = _best(cells, size, "pipeline", procs=procs)
    memcpy = _best(cells, size, "cold memcpy")
    ideal = _exact(cells, size, "pipe handoff" if "batch_fn" in method else PIPE_COPY, procs)
    softs = _exact(cells, size, "softs 0.1.2", procs)
    rate = defaults.rate
    return {"rate": rate, "tuned_rate": tuned.rate if tuned else None, "tuned": rate / tuned.rate if tuned else None,
            "memcpy": rate / memcpy.rate if memcpy else None, "ideal": rate / ideal.rate if ideal else None,
            "softs_rate": softs.rate if softs else None, "softs": rate / softs.rate if softs else None}


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


@contextlib.contextmanager
def _pipeline_step(size: Size, client: StudentClient, config: BatchConfig, endpoints: dict[str, str],
                   consumer: str, curve: CurveConfig | None = None) -> Iterator[Callable[[], int]]:
    """The student's step: a DistillIterableDataset batch, or request_sample/release_slot."""
    if consumer == "client":
        batch = _batch(size)

        def client_step() -> int:
            for i in range(size.batch_size):
                ref = client.request_sample(timeout_ms=FIRST_BATCH_TIMEOUT_S * 1000)
                if ref is None:
                    raise TimeoutError("no sample from the pipeline")
                batch[i].copy_(ref.tensors["x"])
                client.release_slot(ref.slot_id)
            return size.batch_size

        yield client_step
        return
    dataset = DistillIterableDataset(0, client.generation_value, size.slot_count, config,
                                     endpoints["frontend"], batch_size=size.batch_size,
                                     timeout_s=FIRST_BATCH_TIMEOUT_S, reuse_batches=True, curve=curve,
                                     notices=consumer != "relay", direct_requests=consumer == "dataset",
                                     run_id=client.run_id)
    batches = iter(dataset)
    try:
        yield lambda it=batches: len(next(it)["x"])
    finally:
        batches.close()  # its pool unlinks the student's segment


def bench_round_trip(endpoints: dict[str, str], seconds: float) -> dict[str, list[float]]:
    """Microseconds per one-slot round trip (ask, fill, take, give back): straight to the
    worker (``lane``), through the broker with a direct notice back (``notices``), and
    relayed by the broker both ways, alternating: three windows of ``seconds / 3`` each."""
    config = sample_config(4 << 10)
    times: dict[str, list[float]] = {"lane": [], "notices": [], "relay": []}
    with Children() as kids:
        kids.start(run_worker, endpoints, 4 << 10, 1)
        for _ in range(3):
            for label in times:
                with StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"],
                                   endpoints["control_pub"], notices=label != "relay",
                                   direct_requests=label == "lane", run_id=cell_run_id()) as client:
                    client.hello()
                    client.set_model("bench-round-trip")
                    times[label].append(_round_trips(client, seconds / 3))
    return times


def _round_trips(client: StudentClient, seconds: float) -> float:
    """Warm up, then take and give back the one slot for ``seconds``: us per round trip."""
    count, started = -50, 0.0
    while count < 0 or time.perf_counter() - started < seconds:
        ref = client.request_sample(timeout_ms=FIRST_BATCH_TIMEOUT_S * 1000)
        if ref is None:
            raise TimeoutError("no sample from the pipeline")
        client.release_slot(ref.slot_id)
        count += 1
        if count == 0:
            started = time.perf_counter()
    return (time.perf_counter() - started) / max(count, 1) * 1e6


def print_round_trip(times: dict[str, list[float]]) -> None:
    print("\ncontrol path: one 4 KiB slot asked for, filled, taken and given back (us per round trip, "
          "median of 3 windows; 1 worker, max_batch=1)")
    print(f"{'lane':>10} {'notices':>10} {'relay':>10} {'notices / lane':>15} {'relay / lane':>13}")
    lane, notices, relay = (statistics.median(times[label]) for label in ("lane", "notices", "relay"))
    print(f"{lane:>10.0f} {notices:>10.0f} {relay:>10.0f} {notices / lane:>15.2f} {relay / lane:>13.2f}")


def bench_zmq(size: Size, seconds: float) -> Iterator[Result]:
    """1, then 2 processes PUSH samples over loopback TCP; the consumer copies each into the batch."""
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 16)
    pull.bind("tcp://127.0.0.1:*")
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    batch = _batch(size)

    def step() -> int:
        for i in range(size.batch_size):
            if not pull.poll(FIRST_BATCH_TIMEOUT_S * 1000):
                raise TimeoutError("no sample from the pushers")
            frame = pull.recv(copy=False)
            batch[i].copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))
        return size.batch_size

    try:
        yield from _producer_cells(size, seconds, "bare zmq", step, run_zmq_pusher, endpoint, size.sample_bytes)
    finally:
        pull.close(linger=0)


def bench_tcp_pipeline(size: Size, seconds: float, endpoints: dict[str, str],
                       broker_pid: int) -> Iterator[Result]:
    """The network medium: 1, then 2 workers that may not map the student's segment."""
    config = sample_config(size.sample_bytes)
    with Children() as kids:
        workers = []
        for count in (1, 2):
            workers.append(kids.start(run_worker, endpoints, size.sample_bytes, size.worker_batch, False))
            roles = {"consumer": [os.getpid()], "broker": [broker_pid], "producers": list(workers)}
            with StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"],
                               endpoints["control_pub"], run_id=cell_run_id()) as client:
                client.hello()
                client.set_model(f"bench-tcp-{size.sample_bytes}")
                dataset = DistillIterableDataset(0, client.generation_value, size.slot_count, config,
                                                 endpoints["frontend"], batch_size=size.batch_size,
                                                 timeout_s=FIRST_BATCH_TIMEOUT_S, reuse_batches=True,
                                                 medium="tcp", tcp_host="127.0.0.1", run_id=client.run_id)
                batches = iter(dataset)
                try:
                    yield measure(size, "tcp pipeline", count, lambda it=batches: len(next(it)["x"]), seconds,
                                  roles)
                finally:
                    batches.close()


# --------------------------------------------------------------------------- report
def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def print_throughput(results: list[Result]) -> None:
    print(f"\n{'size':<8} {'method':<26} {'procs':>5} {'batch':>5} {'samples/s':>12} {'GB/s':>7} "
          f"{'vs memcpy':>9} {'vs Queue':>9}")
    for r in results:
        memcpy = _best(results, r.size, "cold memcpy")
        mpq = _best(results, r.size, "mp.Queue", procs=r.procs)
        print(f"{r.size.label:<8} {r.method:<26} {r.procs or '-':>5} {r.size.batch_size:>5} "
              f"{r.rate:>12,.0f} {r.gb_per_s:>7.2f} "
              f"{_fmt(r.rate / memcpy.rate if memcpy else None):>9} "
              f"{_fmt(r.rate / mpq.rate if mpq else None, 1):>9}")


# The targets of this benchmark: size -> (reference, the pipeline issue's goal, the
# performance issue's goal) for the best pipeline's samples/s divided by the reference's.
TARGETS = {"4 KiB": ("mp.Queue", 15.0, 25.0), "256 KiB": ("cold memcpy", 0.15, 0.3),
           "4 MiB": ("cold memcpy", 0.5, 0.7)}


def print_ratios(results: list[Result], sizes: tuple[Size, ...]) -> None:
    print("\nbest pipeline cell / best cell of each baseline (same size, same run); "
          "/ handoff, / pipe: against the ideal shared-memory handoffs (polled flags, blocking pipes), "
          "the transport's own ceilings")
    print(f"{'size':<8} {'best pipeline':<30} {'/ memcpy':>9} {'/ handoff':>10} {'/ pipe':>7} {'/ mp.Queue':>11} "
          f"{'/ DataLoader':>13}  target")
    for size in sizes:
        best = _best(results, size, "pipeline")
        if best is None:
            continue
        ratios = {}
        for method in ("cold memcpy", "shm handoff", "pipe handoff", "mp.Queue", "DataLoader"):
            reference = _best(results, size, method)
            ratios[method] = best.rate / reference.rate if reference else None
        print(f"{size.label:<8} {best.method + f' x{best.procs}':<30} {_fmt(ratios['cold memcpy']):>9} "
              f"{_fmt(ratios['shm handoff']):>10} {_fmt(ratios['pipe handoff']):>7} "
              f"{_fmt(ratios['mp.Queue'], 1):>11} {_fmt(ratios['DataLoader'], 1):>13}  {_verdict(size, ratios)}")


def print_rounds(results: list[Result], sizes: tuple[Size, ...]) -> None:
    """Each cell's ratio to the cold memcpy of its own round, over the rounds; the verdict
    by the median round of the best pipeline cell (the table above takes the best of all)."""
    rounds = max(r.round for r in results) + 1
    print(f"\nround by round ({rounds} rounds): each cell / the cold memcpy of its own round; "
          "median [lowest - highest], then every round")
    print(f"{'size':<8} {'method':<26} {'procs':>5} {'median':>7} {'lowest':>7} {'highest':>7}  rounds")
    for size in sizes:
        ratios = _round_ratios(results, size)
        for (method, procs), values in ratios.items():
            print(f"{size.label:<8} {method:<26} {procs or '-':>5} {statistics.median(values):>7.2f} "
                  f"{min(values):>7.2f} {max(values):>7.2f}  {' '.join(f'{v:.2f}' for v in values)}")
        if size.label not in TARGETS or TARGETS[size.label][0] != "cold memcpy":
            continue
        _, goal, stretch = TARGETS[size.label]
        for procs in sorted({procs for method, procs in ratios if method.startswith("pipeline")}):
            best = [max(v[i] for (m, n), v in ratios.items() if m.startswith("pipeline") and n == procs)
                    for i in range(rounds)]
            median = statistics.median(best)
            print(f"{size.label:<8} {'best pipeline, by round':<26} {procs:>5} {median:>7.2f} {min(best):>7.2f} "
                  f"{max(best):>7.2f}  median >= {goal:g}: {'met' if median >= goal else 'MISSED'}; "
                  f">= {stretch:g}: {'met' if median >= stretch else 'MISSED'}")


def _round_ratios(results: list[Result], size: Size) -> dict[tuple[str, int], list[float]]:
    """(method, procs) -> its ratio to its round's cold memcpy, round by round."""
    memcpy = {r.round: r.rate for r in results if r.size == size and r.method.startswith("cold memcpy")}
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in results:
        if r.size == size and r.round in memcpy and not r.method.startswith("cold memcpy"):
            ratios.setdefault((r.method, r.procs), []).append(r.rate / memcpy[r.round])
    return ratios


TCP_TARGET = 0.5
"""The network medium's target: at 4 MiB, >= 0.5x the bare ZeroMQ PUSH/PULL rate."""


def print_tcp_ratios(results: list[Result], sizes: tuple[Size, ...]) -> None:
    print("\nnetwork medium: best tcp pipeline cell / best cell of the baselines (same size, same run)")
    print(f"{'size':<8} {'tcp pipeline':>13} {'bare zmq':>13} {'/ bare zmq':>11} {'/ shm pipeline':>15}  target")
    for size in sizes:
        tcp, bare = _best(results, size, "tcp pipeline"), _best(results, size, "bare zmq")
        if tcp is None:
            continue
        shm = _best(results, size, "pipeline")
        ratio = tcp.rate / bare.rate if bare else None
        verdict = "-" if size.label != "4 MiB" or ratio is None else (
            f">= {TCP_TARGET:g}: {'met' if ratio >= TCP_TARGET else 'MISSED'}")
        print(f"{size.label:<8} {tcp.rate:>13,.0f} {_fmt(bare.rate if bare else None, 0):>13} "
              f"{_fmt(ratio):>11} {_fmt(tcp.rate / shm.rate if shm else None):>15}  {verdict}")


def _verdict(size: Size, ratios: dict[str, float | None]) -> str:
    if size.label not in TARGETS:
        return "-"
    reference, goal, stretch = TARGETS[size.label]
    ratio = ratios[reference]
    if ratio is None:
        return f"(no {reference} cell)"
    return (f"/ {reference} >= {goal:g} (pipeline issue): {'met' if ratio >= goal else 'MISSED'}; "
            f">= {stretch:g} (performance issue): {'met' if ratio >= stretch else 'MISSED'}")


def _exact(results: list[Result], size: Size, method: str, procs: int) -> Result | None:
    """The cell of exactly ``method`` with ``procs`` producers (None: not measured)."""
    return next((r for r in results if r.size == size and r.method == method and r.procs == procs), None)


def _best(results: list[Result], size: Size, method: str, procs: int | None = None) -> Result | None:
    found = [r for r in results if r.size == size and r.method.startswith(method)
             and (procs is None or r.procs == procs)]
    if not found and procs is not None:
        return _best(results, size, method)
    return max(found, key=lambda r: r.rate, default=None)


def print_auth_cost(results: list[Result]) -> None:
    """Each TCP cell with CurveZMQ against the same cell without it (and against ipc)."""
    print("\nthe cost of authentication: pipeline over TCP loopback with CurveZMQ / without "
          "(control messages encrypted; samples still through shared memory)")
    print(f"{'size':<8} {'method':<26} {'procs':>5} {'ipc':>12} {'tcp':>12} {'tcp+curve':>12} "
          f"{'curve/tcp':>9} {'curve/ipc':>9}")
    for r in results:
        if not r.method.endswith(" tcp+curve"):
            continue
        base = r.method.removesuffix(" tcp+curve")
        tcp = next((x for x in results if x.size == r.size and x.procs == r.procs and x.method == f"{base} tcp"), None)
        ipc = next((x for x in results if x.size == r.size and x.procs == r.procs and x.method == base), None)
        print(f"{r.size.label:<8} {base:<26} {r.procs:>5} {_fmt(ipc.rate if ipc else None, 0):>12} "
              f"{_fmt(tcp.rate if tcp else None, 0):>12} {r.rate:>12,.0f} "
              f"{_fmt(r.rate / tcp.rate if tcp else None):>9} {_fmt(r.rate / ipc.rate if ipc else None):>9}")


def print_cpu(results: list[Result]) -> None:
    cores = os.cpu_count() or 1
    print("\nCPU time per delivered sample (us) over the measuring window, by process role "
          "(pipeline: producers = workers, consumer = student);")
    print(f"budget = {cores} cores x wall time per sample: total near budget means CPU-bound")
    print(f"{'size':<8} {'method':<26} {'procs':>5} {'broker':>9} {'producers':>10} {'consumer':>9} "
          f"{'total':>9} {'budget':>9}")
    for r in results:
        roles = [r.us_per_sample(role) for role in ("broker", "producers", "consumer")]
        total = sum(v for v in roles if v is not None)
        budget = cores * r.seconds / r.samples * 1e6
        print(f"{r.size.label:<8} {r.method:<26} {r.procs or '-':>5} {_fmt(roles[0]):>9} "
              f"{_fmt(roles[1]):>10} {_fmt(roles[2]):>9} {total:>9.2f} {budget:>9.2f}")


# --------------------------------------------------------------------------- main
def run_all(sizes: tuple[Size, ...], methods: set[str], seconds: float, ring_bytes: int,
            auth: bool = False, round_trip: dict[str, list[float]] | None = None, rounds: int = 1) -> list[Result]:
    """Every method for every size, ``rounds`` times; one broker process per transport
    serves its pipeline cells. With ``rtt`` in ``methods``, ``round_trip`` gets the
    control path's times."""
    results: list[Result] = []
    ring = None
    if "memcpy" in methods:
        ring = torch.empty(ring_bytes, dtype=torch.uint8)
        ring.fill_(1)  # touch every page once, outside any window
    consumers = [c for c in ("dataset", "notices", "relay", "client") if c in methods]
    sock_dir = tempfile.mkdtemp(prefix="distill-bench-")
    try:
        with Children() as shared:
            routes = transports(sock_dir, auth) if consumers or {"tcp", "rtt", "defaults"} & methods else []
            for route in routes:
                route.broker_pid = shared.start(run_broker, route.endpoints, route.broker)
            if "rtt" in methods and round_trip is not None:
                round_trip.update(bench_round_trip(routes[0].endpoints, seconds))
            for size, turn in itertools.product(sizes, range(rounds)):
                cells: list[Result] = []
                if ring is not None:  # the reference: its faster half, before or after the others
                    cells.append(bench_memcpy(size, seconds / 2, ring))
                if "filler" in methods and ring is not None:
                    cells.append(bench_filler(size, seconds, ring))
                if "handoff" in methods:
                    cells += bench_handoff(size, seconds)
                if "pipe" in methods:
                    cells += bench_pipe_handoff(size, seconds)
                if "pipecopy" in methods:
                    cells += bench_pipe_handoff(size, seconds, own_buffer=True)
                if "queue" in methods:
                    cells += bench_queue(size, seconds)
                if "dataloader" in methods:
                    cells += bench_dataloader(size, seconds)
                for route in routes if consumers else []:
                    cells += bench_pipeline(size, seconds, route, consumers)
                if "defaults" in methods:
                    cells += bench_defaults(size, seconds, routes[0].endpoints, routes[0].broker_pid)
                    if softs_installed():
                        cells += bench_softs(size, seconds, sock_dir)
                if "zmq" in methods:
                    cells += bench_zmq(size, seconds)
                if "tcp" in methods:
                    cells += bench_tcp_pipeline(size, seconds, routes[0].endpoints, routes[0].broker_pid)
                if ring is not None:
                    cells[0] = max(cells[0], bench_memcpy(size, seconds / 2, ring), key=lambda r: r.rate)
                results += [replace(cell, round=turn) for cell in cells]
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    return results


def _leftover_segments() -> list[str]:
    return [name for name in list_segments() if f"_{os.getpid()}_" in name]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, small ring (smoke test)")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"measuring window per cell (default {DEFAULT_SECONDS}, quick {QUICK_SECONDS})")
    parser.add_argument("--sizes", default="4KiB,256KiB,4MiB", help="comma-separated subset of sizes")
    parser.add_argument("--methods",
                        default="memcpy,filler,handoff,pipe,queue,dataloader,dataset,notices,relay,client,zmq,tcp,rtt",
                        help="comma-separated subset of: memcpy, filler (needs memcpy), handoff, pipe, pipecopy, "
                             "queue, dataloader, dataset, notices, relay, client, zmq, tcp, rtt")
    parser.add_argument("--slot-count", type=int, default=None,
                        help="slots of every size's rings and student pool (default: each size's own)")
    parser.add_argument("--worker-batch", type=int, default=None,
                        help="pipeline workers' max_batch, slots per batch (default: each size's own)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every cell this many times and report each ratio's median and spread")
    parser.add_argument("--defaults", action="store_true",
                        help="add the README's path with default arguments beside the tuned cells")
    parser.add_argument("--auth", action="store_true",
                        help="also run the pipeline over TCP loopback, without and with CurveZMQ")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    seconds = args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS)
    wanted = {s.strip().replace(" ", "") for s in args.sizes.split(",")}
    sizes = tuple(s for s in SIZES if s.label.replace(" ", "") in wanted)
    if args.slot_count is not None:
        if args.slot_count < 1:
            raise SystemExit(f"--slot-count {args.slot_count}: must be >= 1")
        sizes = tuple(replace(s, slot_count=args.slot_count) for s in sizes)
    if args.worker_batch is not None:
        if args.worker_batch < 1:
            raise SystemExit(f"--worker-batch {args.worker_batch}: must be >= 1")
        sizes = tuple(replace(s, worker_batch=args.worker_batch) for s in sizes)
    methods = {m.strip() for m in args.methods.split(",")}
    if args.defaults:
        methods |= {"defaults", "pipe", "pipecopy"}  # the ideals its table compares with
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleanup runs on SIGTERM too
    logging.getLogger("distill").setLevel(logging.WARNING)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        round_trip: dict[str, list[float]] = {}
        results = run_all(sizes, methods, seconds, QUICK_RING_BYTES if args.quick else RING_BYTES, args.auth,
                          round_trip, args.rounds)
    except KeyboardInterrupt:
        print("\ninterrupted: children stopped, shared memory released", file=sys.stderr)
        return 130
    finally:
        for name in _leftover_segments():  # never expected: pools unlink their own
            print(f"warning: removing leftover {SHM_DIR}/{name}", file=sys.stderr)
            os.unlink(os.path.join(SHM_DIR, name))
    print(f"distill pipeline benchmark: {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{seconds:g} s per cell (median of {SUB_WINDOWS} sub-windows), 1 torch thread per process, "
          f"spawn; every consumer copies each sample once into a training batch; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print_throughput(results)
    print_ratios(results, sizes)
    if args.rounds > 1:
        print_rounds(results, sizes)
    print_tcp_ratios(results, sizes)
    if "defaults" in methods:
        print_defaults(results, sizes)
    if args.auth:
        print_auth_cost(results)
    print_cpu(results)
    if round_trip:
        print_round_trip(round_trip)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
