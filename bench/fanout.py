"""Fan-out: what a sweep of N runs on the same teacher layer costs the teacher.

N student runs (N = 1, 2, 4; each its own run id, leader and slots, as the jobs of a
sweep) train on the same stage against ONE broker and ONE teacher worker, with
fan-out off (every run's samples are computed for it alone) and on
(``fan_out=True``: one teacher sample fills a slot of every run that asks).
The teacher is the small seeded Llama of ``bench/teacher.py`` (hidden 256, 4
layers, seq_len 128, random weights), ``TeacherTargets`` as the worker's
``batch_fn`` with ``max_batch=8``; the stage trains the last layer (the most teacher
work per sample). Each student process takes samples as fast as it can
(``request_sample``/``release_slot``, no training), so the teacher is the
bottleneck, which is the regime fan-out is for.

Per cell, over a ``--seconds`` window after a warm-up, it reports: samples/s
delivered to each run (mean over the runs), teacher samples computed per sample
delivered (1.0 without fan-out; 1/N ideally with it), and teacher-busy ms (inside
``batch_fn``) per sample delivered. Every process uses 1 torch thread; processes are
started with ``spawn``.

Run it from the repository root::

    python bench/fanout.py            # about 2 minutes
    python bench/fanout.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from children import SPAWN, Children, child_init, run_broker  # bench/children.py
from teacher import HIDDEN, LAYERS, SEED, SEQ_LEN, build_teacher  # bench/teacher.py

from distill.pipeline import SlotTarget, StudentClient, Worker
from distill.stages import Stage, sample_batch_config
from distill.teacher.targets import TeacherTargets

DTYPE = "float32"
MAX_BATCH = 8
SLOTS_PER_STUDENT = 16
RUN_COUNTS = (1, 2, 4)
DEFAULT_SECONDS, QUICK_SECONDS = 6.0, 2.0
WARMUP_S = 1.5


class CountingTargets:
    """``TeacherTargets`` that counts, in shared memory, samples computed and busy time."""

    def __init__(self, inner: TeacherTargets, computed, busy_ns) -> None:
        self.inner, self.computed, self.busy_ns = inner, computed, busy_ns

    def __call__(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        began = time.perf_counter_ns()
        self.inner(model_id, model_cfg, targets)
        with self.computed.get_lock():
            self.computed.value += len(targets)
            self.busy_ns.value += time.perf_counter_ns() - began


def run_worker(parent_pid: int, ready, endpoints: dict[str, str], positions: int, computed, busy_ns) -> None:
    child_init(parent_pid)
    teacher, train_NT = build_teacher()
    worker = Worker(batch_fn=CountingTargets(TeacherTargets(teacher, train_NT, SEED), computed, busy_ns),
                    batch_config=sample_batch_config(positions, SEQ_LEN, HIDDEN, DTYPE), max_batch=MAX_BATCH,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"])
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    ready.set()
    worker.run()


def run_student(parent_pid: int, ready, endpoints: dict[str, str], run_id: str, stage: Stage,
                fan_out: bool, start, stop, delivered) -> None:
    """One run: leads its own stage switch, then takes samples until ``stop``."""
    child_init(parent_pid)
    config = sample_batch_config(len(stage.positions), SEQ_LEN, HIDDEN, DTYPE)
    with StudentClient(0, SLOTS_PER_STUDENT, config, endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], run_id=run_id, fan_out=fan_out) as client:
        client.hello()
        client.set_model(stage.model_id, stage.model_cfg)
        ready.set()
        start.wait()
        while not stop.is_set():
            ref = client.request_sample(timeout_ms=200)
            if ref is not None:
                client.release_slot(ref.slot_id)
                delivered.value += 1  # this process alone writes it


@dataclass
class Cell:
    runs: int
    fan_out: bool
    per_run_s: float
    """Samples/s delivered to each run (mean)."""
    computed_per_delivered: float
    busy_ms_per_delivered: float


def measure(endpoints: dict[str, str], stage: Stage, runs: int, fan_out: bool, seconds: float,
            computed, busy_ns) -> Cell:
    start, stop = SPAWN.Event(), SPAWN.Event()
    counts = [SPAWN.Value("q", 0, lock=False) for _ in range(runs)]
    with Children() as kids:
        for i, delivered in enumerate(counts):
            kids.start(run_student, endpoints, f"n{runs}-{'fan' if fan_out else 'solo'}-{i}", stage, fan_out,
                       start, stop, delivered)
        start.set()
        time.sleep(WARMUP_S)
        before = ([c.value for c in counts], computed.value, busy_ns.value)
        began = time.perf_counter()
        time.sleep(seconds)
        elapsed = time.perf_counter() - began
        after = ([c.value for c in counts], computed.value, busy_ns.value)
        stop.set()
        for proc in kids.procs:  # let them leave with BYE, so the broker forgets them at once
            proc.join(10)
    delivered = sum(after[0]) - sum(before[0])
    made, busy = after[1] - before[1], (after[2] - before[2]) / 1e6
    cell = Cell(runs, fan_out, delivered / runs / elapsed, made / max(delivered, 1), busy / max(delivered, 1))
    print(f"  N={runs} fan-out {'on ' if fan_out else 'off'}: {cell.per_run_s:7.1f} samples/s per run, "
          f"{cell.computed_per_delivered:.2f} computed/delivered", file=sys.stderr, flush=True)
    return cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows (smoke test)")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"measuring window per cell (default {DEFAULT_SECONDS}, quick {QUICK_SECONDS})")
    parser.add_argument("--layer", type=int, default=LAYERS - 1, help="the stage's target layer")
    args = parser.parse_args(argv)
    seconds = args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.getLogger("distill").setLevel(logging.WARNING)
    stage = Stage(0, (args.layer,))
    computed, busy_ns = SPAWN.Value("q", 0), SPAWN.Value("q", 0, lock=False)
    sock_dir = tempfile.mkdtemp(prefix="distill-bench-fanout-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control", "control_pub")}
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    cells: dict[tuple[int, bool], Cell] = {}
    try:
        with Children() as shared:
            shared.start(run_broker, endpoints)
            shared.start(run_worker, endpoints, len(stage.positions), computed, busy_ns)
            for runs in RUN_COUNTS:
                for fan_out in (False, True):
                    cells[runs, fan_out] = measure(endpoints, stage, runs, fan_out, seconds, computed, busy_ns)
    except KeyboardInterrupt:
        print("\ninterrupted: children stopped", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    _print_table(cells, stage, seconds, load_before, time.perf_counter() - started)
    return 0


def _print_table(cells: dict[tuple[int, bool], Cell], stage: Stage, seconds: float, load_before: float,
                 total_s: float) -> None:
    print(f"distill fan-out benchmark: N runs training layer {stage.layers[0]} of a Llama (hidden {HIDDEN}, "
          f"{LAYERS} layers, seq_len {SEQ_LEN}, {DTYPE}, seed {SEED}) against 1 broker and 1 teacher worker "
          f"(max_batch {MAX_BATCH}); {os.cpu_count()} CPUs, 1 torch thread per process; {seconds:g} s per "
          f"cell; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"\n{'N':>2} | {'per run samples/s':>17} {'':>5} | {'teacher samples / delivered':>27} {'':>5} | "
          f"{'teacher-busy ms / delivered':>27} {'':>5} |")
    print(f"{'':>2} | {'off':>8} {'on':>8} {'on/off':>5} | {'off':>13} {'on':>13} {'on/off':>5} | "
          f"{'off':>13} {'on':>13} {'on/off':>5} |")
    for runs in RUN_COUNTS:
        off, on = cells[runs, False], cells[runs, True]
        print(f"{runs:>2} | {off.per_run_s:>8.1f} {on.per_run_s:>8.1f} {on.per_run_s / off.per_run_s:>5.2f} | "
              f"{off.computed_per_delivered:>13.2f} {on.computed_per_delivered:>13.2f} "
              f"{on.computed_per_delivered / off.computed_per_delivered:>5.2f} | "
              f"{off.busy_ms_per_delivered:>13.2f} {on.busy_ms_per_delivered:>13.2f} "
              f"{on.busy_ms_per_delivered / off.busy_ms_per_delivered:>5.2f} |")
    print(f"\ntotal {total_s:.0f} s")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
