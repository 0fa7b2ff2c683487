"""Teacher-target throughput: the pipeline versus a bare capture loop, and what a stage costs.

A small Llama teacher (hidden 256, 4 layers, 4 heads, vocab 1024, seq_len 128,
random weights from a fixed seed, built identically in every process) produces
per-layer targets with ``distill.teacher.targets.TeacherTargets``: ONE truncated
``Teacher.capture`` per batch, then each sample's boundary hidden states copied
into its destination. This prints, in one run:

1. ``pipeline vs bare``: samples/s of stage-``l`` targets (default l=0, the
   cheapest stage, so the transport's share is largest) at worker batch sizes
   B = 4, 8, 16, delivered through the whole pipeline -- a ``Broker`` process,
   1 ``Worker`` process with ``TeacherTargets`` as ``batch_fn`` and
   ``max_batch=B``, and a student (this process) taking batches from
   ``DistillIterableDataset(batch_size=B, reuse_batches=True)``, i.e. copying
   every sample once into its batch tensors -- against the SAME ``TeacherTargets``
   called in a bare loop in this process on the same batches, writing into a
   preallocated tensor (no pipeline). The ratio pipeline/bare is the transport's
   cost; the target is >= 0.9 at the teacher's best batch size.
2. ``cost by target layer``: bare ``Teacher.capture`` time per sample for a stage
   training layer l alone, l = 0..L-1, relative to a full forward of all L layers
   (the base model, no lm_head); expected (l+1)/L since capture stops after layer l.
3. ``layers_per_stage``: with k = 1, 2, 4 layers per stage, bare loop time per
   trained layer (all stages of ``plan_stages``, summed, over L) relative to k=1,
   on a deeper teacher of the same width (16 layers, ``--stage-layers``): what k
   saves depends on depth. With truncation the model is (L/k+1)/(L+1): stage i of
   k layers runs (i+1)*k layers, so the savings come from fewer, not cheaper,
   passes, and approach 1/k as L grows (L=4: 0.60 and 0.40; L=16: 0.53 and 0.29;
   L=32: 0.52 and 0.27).

Fairness: every process runs torch with 1 thread (the worker and the bare loop
each use one of the 2 cores; the broker and the student share the other), the
bare loop is measured while no worker runs, and both sides do the same
``TeacherTargets`` work on the same request ids. Each cell warms up, then measures
for ``--seconds`` cut in sub-windows and reports the median sub-window rate.
Processes are started with ``spawn``.

Run it from the repository root::

    python bench/teacher.py            # full tables, about 2-3 minutes
    python bench/teacher.py --quick    # smoke run, well under a minute
    python bench/teacher.py --device cuda   # teachers on a GPU (the worker's pinned, side-stream copies)

Ctrl-C stops it cleanly: child processes are stopped, this run's /dev/shm/dst_*
segments unlinked, IPC sockets removed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.multiprocessing
from children import Children, child_init, run_broker  # bench/children.py

from distill.model.teacher import Teacher
from distill.pipeline import DistillIterableDataset, StudentClient, Worker
from distill.pipeline.mediums.shm import SHM_DIR, list_segments
from distill.stages import Stage, plan_stages, sample_batch_config
from distill.teacher.targets import TeacherTargets

SEED = 0
HIDDEN, LAYERS, HEADS, VOCAB, SEQ_LEN = 256, 4, 4, 1024, 128
TRAIN_CHUNKS = 1024
DTYPE = "float32"
BATCH_SIZES = (4, 8, 16)
SUB_WINDOWS = 6
DEFAULT_SECONDS, QUICK_SECONDS = 5.0, 1.0
STAGE_LAYERS = 16
"""Depth of table 3's teacher: what k saves depends on depth, (L/k+1)/(L+1) -> 1/k."""
MIN_STAGE_SECONDS = 0.6
FIRST_BATCH_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------- the teacher
def build_teacher(layers: int = LAYERS, device: str = "cpu") -> tuple[Teacher, torch.Tensor]:
    """The seeded random Llama teacher and its train chunks (identical in every process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                         max_position_embeddings=SEQ_LEN, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
        train_NT = torch.randint(0, VOCAB, (TRAIN_CHUNKS, SEQ_LEN), dtype=torch.int64)
    return Teacher(model, device), train_NT


@dataclass
class _Target:
    """What ``TeacherTargets`` reads of a ``SlotTarget``: a request id and tensors to fill."""

    request_id: int
    tensors: dict[str, torch.Tensor]


class BareLoop:
    """``TeacherTargets`` called directly, writing into one preallocated batch tensor."""

    def __init__(self, targets_fn: TeacherTargets, stage: Stage, batch_size: int) -> None:
        self.fn, self.stage, self.batch_size = targets_fn, stage, batch_size
        self.input_ids_BT = torch.empty((batch_size, SEQ_LEN), dtype=torch.int64)
        self.hidden_BPTD = torch.empty((batch_size, len(stage.positions), SEQ_LEN, HIDDEN))
        self.next_id = 0
        self._unfinished: Callable[[], None] | None = None

    def __call__(self) -> int:
        targets = [_Target(self.next_id + i, {"input_ids": self.input_ids_BT[i], "hidden": self.hidden_BPTD[i]})
                   for i in range(self.batch_size)]
        self.next_id += self.batch_size
        finish = self.fn(self.stage.model_id, self.stage.model_cfg, targets)
        if self._unfinished is not None:  # on CUDA, like the Worker: the previous batch's copies
            self._unfinished()            # complete after this batch's forward was launched
        self._unfinished = finish
        return self.batch_size


def capture_step(teacher: Teacher, train_NT: torch.Tensor, layers: list[int] | None,
                 batch_size: int) -> Callable[[], int]:
    """One batched ``Teacher.capture`` of ``layers`` (None: a full forward of the base model)."""
    state = {"row": 0}

    def step() -> int:
        row = state["row"]
        state["row"] = (row + batch_size) % (len(train_NT) - batch_size)
        input_ids_BT = train_NT[row:row + batch_size].to(teacher.device)
        if layers is None:
            with torch.no_grad():
                teacher.model.base_model(input_ids=input_ids_BT, use_cache=False)
        else:
            teacher.capture(input_ids_BT, layers)
        if teacher.device.type == "cuda":
            torch.cuda.synchronize(teacher.device)  # time the work, not its launch
        return batch_size

    return step


# --------------------------------------------------------------------------- measuring
def measure(step: Callable[[], int], seconds: float, label: str) -> float:
    """Median samples/s over sub-windows of ``seconds``, after a warm-up."""
    step()  # the first call may wait for a worker to start
    warm_until = time.perf_counter() + max(0.3, seconds / 5)
    while time.perf_counter() < warm_until:
        step()
    rates, window_s = [], seconds / SUB_WINDOWS
    start = window_start = time.perf_counter()
    window_samples = 0
    while (now := time.perf_counter()) - start < seconds:
        if now - window_start >= window_s:
            rates.append(window_samples / (now - window_start))
            window_start, window_samples = now, 0
        window_samples += step()
    if window_samples and not rates:
        rates.append(window_samples / (time.perf_counter() - window_start))
    rate = statistics.median(rates)
    print(f"  {label:<40} {rate:9.1f} samples/s", file=sys.stderr, flush=True)
    return rate


# --------------------------------------------------------------------------- child processes
def run_worker(parent_pid: int, ready, endpoints: dict[str, str], num_positions: int, max_batch: int,
               device: str) -> None:
    child_init(parent_pid)
    teacher, train_NT = build_teacher(device=device)
    worker = Worker(batch_fn=TeacherTargets(teacher, train_NT, SEED),
                    batch_config=sample_batch_config(num_positions, SEQ_LEN, HIDDEN, DTYPE),
                    max_batch=max_batch, backend_endpoint=endpoints["backend"],
                    control_pub_endpoint=endpoints["control_pub"])
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())  # leave with BYE
    ready.set()
    worker.run()


@contextlib.contextmanager
def pipeline_step(endpoints: dict[str, str], stage: Stage, batch_size: int,
                  device: str) -> Iterator[Callable[[], int]]:
    """A worker with ``max_batch=B`` and a student taking batches of B from the dataset."""
    config = sample_batch_config(len(stage.positions), SEQ_LEN, HIDDEN, DTYPE)
    slots = 4 * batch_size
    with Children() as kids:
        kids.start(run_worker, endpoints, len(stage.positions), batch_size, device)
        with StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], run_id=f"bench-{secrets.token_hex(4)}") as client:
            client.hello()
            client.set_model(stage.model_id, stage.model_cfg)
            dataset = DistillIterableDataset(0, client.generation_value, slots, config, endpoints["frontend"],
                                             batch_size=batch_size, timeout_s=FIRST_BATCH_TIMEOUT_S,
                                             reuse_batches=True, run_id=client.run_id)
            batches = iter(dataset)
            try:
                yield lambda: len(next(batches)["hidden"])
            finally:
                batches.close()  # its pool unlinks the student's segment


# --------------------------------------------------------------------------- the three tables
def table_pipeline(teacher: Teacher, train_NT: torch.Tensor, layer: int, batch_sizes: tuple[int, ...],
                   seconds: float) -> list[tuple[int, float, float]]:
    stage = Stage(0, (layer,))
    rows = []
    sock_dir = tempfile.mkdtemp(prefix="distill-bench-teacher-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control", "control_pub")}
    try:
        with Children() as shared:
            shared.start(run_broker, endpoints)
            for batch_size in batch_sizes:
                bare = measure(BareLoop(TeacherTargets(teacher, train_NT, SEED), stage, batch_size), seconds,
                               f"bare     stage l={layer} B={batch_size}")
                with pipeline_step(endpoints, stage, batch_size, str(teacher.device)) as step:
                    piped = measure(step, seconds, f"pipeline stage l={layer} B={batch_size}")
                rows.append((batch_size, bare, piped))
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    return rows


def table_layers(teacher: Teacher, train_NT: torch.Tensor, batch_size: int,
                 seconds: float) -> tuple[float, list[tuple[int, float, float]]]:
    full = measure(capture_step(teacher, train_NT, None, batch_size), seconds, f"full forward B={batch_size}")
    rows = []
    for layer in range(teacher.num_layers):
        capture = measure(capture_step(teacher, train_NT, [layer], batch_size), seconds,
                          f"capture l={layer} B={batch_size}")
        bare = measure(BareLoop(TeacherTargets(teacher, train_NT, SEED), Stage(0, (layer,)), batch_size), seconds,
                       f"bare loop l={layer} B={batch_size}")
        rows.append((layer, capture, bare))
    return full, rows


def table_stages(teacher: Teacher, train_NT: torch.Tensor, batch_size: int, seconds: float,
                 ks: tuple[int, ...]) -> list[tuple[int, int, float]]:
    """k -> (stages, seconds of teacher work per sample per trained layer)."""
    rows = []
    for k in ks:
        stages = plan_stages(teacher.num_layers, None, k)
        s_per_sample = 0.0
        for stage in stages:
            rate = measure(BareLoop(TeacherTargets(teacher, train_NT, SEED), stage, batch_size),
                           max(MIN_STAGE_SECONDS, 2 * seconds / len(stages)), f"bare loop k={k} {stage.model_id}")
            s_per_sample += 1 / rate
        rows.append((k, len(stages), s_per_sample / teacher.num_layers))
    return rows


# --------------------------------------------------------------------------- main
def _sweep_segments() -> None:
    """Unlink this run's leftover dst_* segments (never expected: pools unlink their own)."""
    pids = {os.getpid(), *Children.pids}
    for name in list_segments():
        if any(f"_{pid}_" in name for pid in pids):
            print(f"warning: removing leftover {SHM_DIR}/{name}", file=sys.stderr)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows (smoke test)")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"measuring window per cell (default {DEFAULT_SECONDS}, quick {QUICK_SECONDS})")
    parser.add_argument("--layer", type=int, default=0, help="the target layer of table 1 (default 0)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                        help="comma-separated worker batch sizes of table 1")
    parser.add_argument("--device", default="cpu",
                        help="where the teachers run: cpu, or cuda / cuda:N (the worker then copies "
                             "device-to-host on a side stream into pinned staging, finished after the next forward)")
    parser.add_argument("--stage-layers", type=int, default=STAGE_LAYERS,
                        help=f"layers of table 3's teacher (default {STAGE_LAYERS}; tables 1-2 use {LAYERS})")
    args = parser.parse_args(argv)
    seconds = args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleanup runs on SIGTERM too
    logging.getLogger("distill").setLevel(logging.WARNING)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    teacher, train_NT = build_teacher(device=args.device)
    try:
        piped = table_pipeline(teacher, train_NT, args.layer, batch_sizes, seconds)
        best_batch = max(piped, key=lambda r: r[1])[0]
        full, layers = table_layers(teacher, train_NT, best_batch, seconds / 2)
        deep, deep_NT = build_teacher(args.stage_layers, args.device)
        stages = table_stages(deep, deep_NT, best_batch, seconds, (1, 2, 4))
    except KeyboardInterrupt:
        print("\ninterrupted: children stopped, shared memory released", file=sys.stderr)
        return 130
    finally:
        _sweep_segments()

    L = teacher.num_layers
    print(f"distill teacher benchmark: Llama hidden {HIDDEN}, {L} layers, {HEADS} heads, vocab {VOCAB}, "
          f"seq_len {SEQ_LEN}, {DTYPE}, random weights (seed {SEED}); {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, teachers on {args.device}, 1 torch thread in every process, spawn; "
          f"{seconds:g} s per cell "
          f"(median of {SUB_WINDOWS} sub-windows); load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(f"\n1) stage l={args.layer} targets: pipeline (broker + 1 worker, TeacherTargets, max_batch=B; "
          f"student copies each batch) vs the same TeacherTargets in a bare loop")
    print(f"{'B':>4} {'bare samples/s':>15} {'pipeline samples/s':>19} {'pipeline/bare':>14}")
    for batch_size, bare, pipe in piped:
        mark = "  <- teacher's best B" if batch_size == best_batch else ""
        print(f"{batch_size:>4} {bare:>15.1f} {pipe:>19.1f} {pipe / bare:>14.2f}{mark}")
    ratio = next(p / b for bs, b, p in piped if bs == best_batch)
    print(f"target pipeline/bare >= 0.9 at the teacher's best B={best_batch}: "
          f"{ratio:.2f} {'met' if ratio >= 0.9 else 'MISSED'}")

    print(f"\n2) cost by target layer (bare, B={best_batch}): capture of layer l alone vs a full forward "
          f"of all {L} layers ({1e3 / full:.2f} ms/sample)")
    print(f"{'l':>3} {'capture ms/sample':>18} {'vs full':>8} {'(l+1)/L':>8} {'bare loop ms/sample':>20}")
    for layer, capture, bare in layers:
        print(f"{layer:>3} {1e3 / capture:>18.2f} {full / capture:>8.2f} {(layer + 1) / L:>8.2f} "
              f"{1e3 / bare:>20.2f}")

    L = args.stage_layers
    print(f"\n3) layers_per_stage=k ({L}-layer teacher, same width; bare loop, B={best_batch}, all stages of "
          f"plan_stages): teacher time per sample per trained layer")
    print(f"{'k':>3} {'stages':>7} {'ms/sample/layer':>16} {'vs k=1':>7} {'1/k':>6} {'(L/k+1)/(L+1)':>14}")
    base = stages[0][2]
    for k, count, per_layer in stages:
        print(f"{k:>3} {count:>7} {1e3 * per_layer:>16.2f} {per_layer / base:>7.2f} {1 / k:>6.2f} "
              f"{(L / k + 1) / (L + 1):>14.2f}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
