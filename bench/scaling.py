"""More teachers, more samples: delivered samples/s against the number of workers.

Teacher-bound on purpose, on a machine without GPUs: each worker's batch function
sleeps ``--delay-ms`` (default 50) per batch of ``--max-batch`` slots (default 8) and
then writes the samples, like a GPU teacher whose forward costs the host no CPU
(``--per-sample``: that long per sample of the batch, a GPU that is saturated). One
worker can then deliver at most ``max_batch / delay`` samples/s (160/s with the
defaults), and N workers N times that, as long as the students take them.

One broker; one student, or two DDP ranks of one run (``--students 2``: rank 0 leads,
rank 1 follows), each a :class:`~distill.pipeline.StudentClient` with ``--slots`` slots
(default 128: enough for 8 workers to hold two batches each) taking samples with
``request_sample``/``release_slot`` as fast as it can (no training). Workers are added
to the running students one phase at a time (1, 2, 4, 8) and then removed (they stop
with BYE: 4, then 2), so every phase but the first measures workers that joined a
running job. Each phase waits ``--settle`` seconds (a student learns of a new worker
with the broker's next heartbeat answer, every 1 s by default), then counts the
samples delivered over ``--seconds``. ``ideal`` is N x the one-worker rate of the same
run; ``ratio`` = delivered / ideal, and ``per worker`` how many samples each worker
process wrote in the window (its share; a worker that idles shows 0).

The README's own order comes next (``--first-repeats`` times for each N of 1, 2, 4, 8;
``--quick``: 2): a fresh broker, N workers started and announced (``--settle``), and
only then the student. The window opens ``FIRST_SETTLE_S`` after the student is ready
(shares should hold within about a second of the first request); ``min share x N`` is
the smallest worker's share over an even one (1.00: even; 0: a worker left idle).

``--app`` asks the same of the application instead (``bench/scaling_app.py``): jobs of
``python -m distill mode=local local.num_workers=N teacher.sleep_per_batch_s=0.05`` that
train, N = ``--app-workers``, and one job to which a worker is added (its ``add_worker.sh``)
and from which it is removed between stages, 1 -> 2 -> 1; the figures are each stage's
``stage_end`` in the job's ``metrics.jsonl``.

Run it from the repository root::

    flock /tmp/distill-cpu.lock python bench/scaling.py                 # about 1 minute
    flock /tmp/distill-cpu.lock python bench/scaling.py --students 2
    flock /tmp/distill-cpu.lock python bench/scaling.py --per-sample --delay-ms 10 --max-batch 32 --slots 64
    python bench/scaling.py --quick                                     # smoke run
    flock /tmp/distill-cpu.lock python bench/scaling.py --app           # about 5 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import scaling_app  # bench/scaling_app.py
import torch
from children import SPAWN, Children, child_init, run_broker  # bench/children.py

from distill.pipeline import BatchConfig, SlotTarget, StudentClient, TensorSpec, Worker

PHASES = (1, 2, 4, 8, 4, 2)
"""Live workers in each phase, in order: added while the students run, then removed."""
SAMPLE_FLOATS = 1024
"""4 KiB samples: small enough that copying them costs nothing next to the teacher."""
RUN_ID = "scaling"
FIRST_SETTLE_S = 1.0
"""Workers first: the window opens this long after the student is ready."""
FIRST_COUNTS = (1, 2, 4, 8)


def batch_config() -> BatchConfig:
    return BatchConfig([TensorSpec("x", (SAMPLE_FLOATS,), "float32")])


class SleepingTeacher:
    """A batch function that sleeps (the teacher's forward on a GPU) and then writes,
    counting in shared memory the samples this worker wrote."""

    def __init__(self, delay_s: float, per_sample: bool, written) -> None:
        self.delay_s, self.per_sample, self.written = delay_s, per_sample, written

    def __call__(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        time.sleep(self.delay_s * len(targets) if self.per_sample else self.delay_s)
        for target in targets:
            target.tensors["x"].fill_(float(target.request_id & 0xFFFF))
        self.written.value += len(targets)  # this process alone writes it


def run_worker(parent_pid: int, ready, endpoints: dict[str, str], delay_s: float, per_sample: bool,
               max_batch: int, written) -> None:
    child_init(parent_pid)
    worker = Worker(batch_fn=SleepingTeacher(delay_s, per_sample, written), batch_config=batch_config(), max_batch=max_batch,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"])
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())  # leaves with BYE
    ready.set()
    worker.run()


def run_student(parent_pid: int, ready, endpoints: dict[str, str], rank: int, slots: int, delivered) -> None:
    """One rank: rank 0 switches the model, others follow; then take samples forever."""
    child_init(parent_pid)
    with StudentClient(rank, slots, batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], run_id=RUN_ID) as client:
        client.hello()
        if rank == 0:
            client.set_model("sleeping-teacher")
        else:
            client.start_sub_listener()
            client.wait_generation(1)
        ready.set()
        while True:
            ref = client.request_sample(timeout_ms=200)
            if ref is not None:
                client.release_slot(ref.slot_id)
                delivered.value += 1  # this process alone writes it


@dataclass
class Phase:
    workers: int
    per_s: float
    per_worker: list[int]
    """Samples each live worker wrote in the window, in the order they joined."""


class Pool:
    """The workers of the run: started and stopped one at a time."""

    def __init__(self, endpoints: dict[str, str], delay_s: float, per_sample: bool, max_batch: int) -> None:
        self.endpoints, self.delay_s, self.per_sample, self.max_batch = endpoints, delay_s, per_sample, max_batch
        self.live: list[tuple[Children, object]] = []

    def resize(self, count: int) -> None:
        while len(self.live) < count:
            kids, written = Children(), SPAWN.Value("q", 0, lock=False)
            kids.start(run_worker, self.endpoints, self.delay_s, self.per_sample, self.max_batch, written)
            self.live.append((kids, written))
        while len(self.live) > count:
            kids, _ = self.live.pop()
            kids.__exit__(None, None, None)

    def written(self) -> list[int]:
        return [written.value for _, written in self.live]

    def close(self) -> None:
        self.resize(0)


def measure(pool: Pool, delivered: list, workers: int, settle_s: float, seconds: float) -> Phase:
    pool.resize(workers)
    time.sleep(settle_s)
    before, wrote_before = sum(d.value for d in delivered), pool.written()
    began = time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - began
    after, wrote_after = sum(d.value for d in delivered), pool.written()
    phase = Phase(workers, (after - before) / elapsed, [a - b for a, b in zip(wrote_after, wrote_before, strict=True)])
    print(f"  {workers} worker(s): {phase.per_s:8.1f} samples/s", file=sys.stderr, flush=True)
    return phase


def workers_first(args: argparse.Namespace, workers: int, seconds: float) -> Phase:
    """The README's order: a fresh broker, ``workers`` workers announced, then the students."""
    sock_dir = tempfile.mkdtemp(prefix="distill-bench-first-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control", "control_pub")}
    delivered = [SPAWN.Value("q", 0, lock=False) for _ in range(args.students)]
    pool = Pool(endpoints, args.delay_ms / 1000, args.per_sample, args.max_batch)
    try:
        with Children() as fixed:
            fixed.start(run_broker, endpoints)
            pool.resize(workers)
            time.sleep(args.settle)  # each worker's READY and first heartbeat are in
            for rank, count in enumerate(delivered):
                fixed.start(run_student, endpoints, rank, args.slots, count)
            try:
                return measure(pool, delivered, workers, FIRST_SETTLE_S, seconds)
            finally:
                pool.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=1, choices=(1, 2), help="DDP ranks of the run")
    parser.add_argument("--slots", type=int, default=128, help="slots per student")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="each worker's sleep per batch")
    parser.add_argument("--per-sample", action="store_true",
                        help="sleep --delay-ms per sample of the batch (a saturated GPU), not per batch")
    parser.add_argument("--max-batch", type=int, default=8, help="slots per worker batch")
    parser.add_argument("--seconds", type=float, default=None, help="measuring window per phase (default 4, quick 1.5)")
    parser.add_argument("--settle", type=float, default=2.0, help="wait after each change of workers")
    parser.add_argument("--quick", action="store_true", help="short windows, phases 1 and 2 only")
    parser.add_argument("--first-repeats", type=int, default=None,
                        help="runs of each N in the workers-first order (default 3, quick 2; 0: none)")
    app = parser.add_argument_group("the application (--app)")
    app.add_argument("--app", action="store_true", help="measure mode=local jobs instead of the library")
    app.add_argument("--app-workers", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4, 8],
                     help="local.num_workers of each job (comma-separated)")
    app.add_argument("--app-layers", type=int, default=3, help="layer stages of each job")
    app.add_argument("--app-steps", type=int, default=150, help="student.steps_per_stage (8 samples a step)")
    app.add_argument("--app-mid-layers", type=int, default=6,
                     help="layer stages of the job whose workers change mid-run (0: no such job)")
    app.add_argument("--app-slots", type=int, default=None, help="pipeline.slot_count (default: the app's)")
    app.add_argument("--app-cache", default=None, help="tiny-teacher cache (default: one in the work dir)")
    args = parser.parse_args(argv)
    if args.app:
        return _run_app(args)
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    phases = PHASES[:2] if args.quick else PHASES
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sock_dir = tempfile.mkdtemp(prefix="distill-bench-scaling-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control", "control_pub")}
    delivered = [SPAWN.Value("q", 0, lock=False) for _ in range(args.students)]
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    pool = Pool(endpoints, args.delay_ms / 1000, args.per_sample, args.max_batch)
    try:
        with Children() as fixed:
            fixed.start(run_broker, endpoints)
            for rank, count in enumerate(delivered):
                fixed.start(run_student, endpoints, rank, args.slots, count)
            try:
                results = [measure(pool, delivered, n, args.settle, seconds) for n in phases]
            finally:
                pool.close()
        repeats = args.first_repeats if args.first_repeats is not None else (2 if args.quick else 3)
        counts = FIRST_COUNTS[:2] if args.quick else FIRST_COUNTS
        print("workers first:", file=sys.stderr, flush=True)
        first = [workers_first(args, n, seconds) for n in counts for _ in range(repeats)]
    except KeyboardInterrupt:
        print("\ninterrupted: children stopped", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    _print_table(results, first, args, seconds, load_before, time.perf_counter() - started)
    return 0


def _run_app(args: argparse.Namespace) -> int:
    if args.quick:
        args.app_workers, args.app_layers, args.app_steps, args.app_mid_layers = [1, 2], 2, 40, 0
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        results, midrun = scaling_app.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: jobs stopped", file=sys.stderr)
        return 130
    print(f"distill scaling benchmark, the application: {os.cpu_count()} CPUs; load average {load_before:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after; total {time.perf_counter() - started:.0f} s")
    scaling_app.print_tables(results, midrun, args)
    best = 1000 / args.delay_ms * args.max_batch
    print(f"\ntheoretical one-worker rate {best:.0f} samples/s")
    return 0


def _print_table(results: list[Phase], first: list[Phase], args: argparse.Namespace, seconds: float,
                 load_before: float, total_s: float) -> None:
    one = results[0].per_s
    per = "sample" if args.per_sample else "batch"
    print(f"distill scaling benchmark: workers sleeping {args.delay_ms:g} ms per {per}, batches of {args.max_batch} "
          f"(4 KiB samples), {args.students} student rank(s) x {args.slots} slots, request_sample/release_slot; "
          f"{os.cpu_count()} CPUs; {seconds:g} s per phase after {args.settle:g} s; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"\n{'order':>13} | {'workers':>7} | {'samples/s':>9} | {'ideal':>7} | {'ratio':>5} | {'min share x N':>13} | "
          "per worker (samples in the window)")
    for order, phases in (("joining", results), ("workers first", first)):
        for phase in phases:
            ideal = phase.workers * one
            total = max(1, sum(phase.per_worker))
            evenness = min(phase.per_worker) * phase.workers / total if phase.per_worker else 0.0
            print(f"{order:>13} | {phase.workers:>7} | {phase.per_s:>9.1f} | {ideal:>7.1f} | {phase.per_s / ideal:>5.2f} | "
                  f"{evenness:>13.2f} | {' '.join(str(n) for n in phase.per_worker)}")
    best = 1000 / args.delay_ms * (1 if args.per_sample else args.max_batch)
    print(f"\ntheoretical one-worker rate {best:.0f} samples/s; total {total_s:.0f} s")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
