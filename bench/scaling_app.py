"""The application path of ``bench/scaling.py --app``: ``mode=local local.num_workers=N``.

The same question as the library cells (do N teachers deliver N times one?), asked of the
command a user runs: the CLI's supervisor, broker, ``mode=worker`` processes and a torchrun
student that trains, with the synthetic slow teacher ``teacher.sleep_per_batch_s`` (every
worker batch takes at least that long, like a GPU teacher whose forward costs the host no
CPU). The figures are the run's own: each layer stage's ``stage_end`` record in
``metrics.jsonl`` (``delivered_samples_per_s``, ``needed_samples_per_s``, ``wait_fraction``,
``workers_min``/``workers_max``).

- ``cells``: one job per N; a cell is the median over its layer stages.
- ``mid_run``: one job that starts with one worker; each time a stage has trained with every
  worker of the current phase, the next phase begins: a worker is added with the job's own
  ``add_worker.sh`` (1 -> 2) and then removed (SIGTERM, as Ctrl-C would: 2 -> 1), so the
  per-stage table shows what adding and removing a worker mid-run does (the cells show 4 and 8).

The teacher is a tiny Llama small enough (hidden 64, 64 tokens, 2-7 ms of CPU per batch of 8)
that the workers' real forwards cost little next to the sleep; the student trains it as usual.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 300


@dataclass
class AppCell:
    workers: int
    delivered: float
    needed: float
    wait: float
    stages: int


def overrides(args, layers: int, workers: int, cache_dir: Path) -> list[str]:
    """The job: the synthetic teacher, a small tiny Llama, teacher-forced layer stages only."""
    slots = [f"pipeline.slot_count={args.app_slots}"] if args.app_slots else []
    return ["mode=local", f"local.num_workers={workers}", "local.num_students=1",
            f"teacher.sleep_per_batch_s={args.delay_ms / 1000:g}", f"pipeline.worker_max_batch={args.max_batch}",
            "teacher.tiny.hidden_size=64", "teacher.tiny.num_heads=4", f"teacher.tiny.num_layers={layers}",
            "teacher.tiny.train_steps=20", f"teacher.cache_dir={cache_dir}", "data.seq_len=64",
            f"student.steps_per_stage={args.app_steps}", "student.micro_batch_size=8", "student.e2e.steps=0",
            "student.inputs=teacher",  # every stage's step costs the same (closed loop: more each stage)
            "evaluate=false", *slots]


def stage_ends(run: Path) -> list[dict]:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [r for line in metrics.read_text().splitlines() if (r := json.loads(line))["event"] == "stage_end"]


class Job:
    """One mode=local job in a directory of its own, and the workers added to it."""

    def __init__(self, work: Path, name: str, job_overrides: list[str]) -> None:
        self.run = work / name
        self.log = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.env = env
        own = [f"hydra.run.dir={self.run}", f"checkpoint_dir={work / 'checkpoints' / name}"]  # never resumed
        self.proc = subprocess.Popen([sys.executable, "-m", "distill", *job_overrides, *own],
                                     cwd=work, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.added: list[subprocess.Popen] = []

    def add_worker(self) -> None:
        script = self.run / "add_worker.sh"
        self.added.append(subprocess.Popen(["sh", str(script)], cwd=self.run.parent, stdout=self.log,
                                           stderr=subprocess.STDOUT, env=self.env))

    def remove_worker(self) -> None:
        proc = self.added.pop()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    def wait(self, on_stage_end=None) -> list[dict]:
        """Until the job ends; ``on_stage_end(record)`` for each new stage_end."""
        seen = 0
        while True:
            ends = stage_ends(self.run)
            for record in ends[seen:]:
                if on_stage_end is not None:
                    on_stage_end(record)
            seen = len(ends)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.run.name} failed (code {self.proc.returncode}); see {self.log.name}")
        return stage_ends(self.run)

    def stop(self) -> None:
        for proc in [*self.added, self.proc]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.added, self.proc]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.log.close()


def _median(ends: list[dict], key: str) -> float:
    return statistics.median(e[key] for e in ends)


def cells(args, work: Path, cache_dir: Path) -> list[AppCell]:
    """One job per N in ``--app-workers``."""
    results = []
    for n in args.app_workers:
        job = Job(work, f"workers{n}", overrides(args, args.app_layers, n, cache_dir))
        try:
            ends = job.wait()
        finally:
            job.stop()
        results.append(AppCell(n, _median(ends, "delivered_samples_per_s"), _median(ends, "needed_samples_per_s"),
                               _median(ends, "wait_fraction"), len(ends)))
        print(f"  app, {n} worker(s): {results[-1].delivered:8.1f} samples/s", file=sys.stderr, flush=True)
    return results


def mid_run(args, work: Path, cache_dir: Path, phases: tuple[int, ...] = (1, 2, 1)) -> list[dict]:
    """One job whose workers change between stages: ``phases`` live workers, in order."""
    job = Job(work, "midrun", overrides(args, args.app_mid_layers, phases[0], cache_dir))
    phase = [0]

    def next_phase(record: dict) -> None:
        i = phase[0]
        if i + 1 < len(phases) and record["workers_min"] == record["workers_max"] == phases[i]:
            phase[0] += 1
            while 1 + len(job.added) < phases[i + 1]:
                job.add_worker()
            while 1 + len(job.added) > phases[i + 1]:
                job.remove_worker()
        print(f"  app mid-run, stage {record['stage']}: {record['delivered_samples_per_s']:8.1f} samples/s "
              f"({record['workers_min']}-{record['workers_max']} workers)", file=sys.stderr, flush=True)

    try:
        return job.wait(next_phase)
    finally:
        job.stop()


def run(args) -> tuple[list[AppCell], list[dict]]:
    work = Path(tempfile.mkdtemp(prefix="distill-bench-scaling-app-"))
    cache_dir = Path(args.app_cache or work / "tiny-cache")
    print(f"app jobs in {work}", file=sys.stderr, flush=True)
    return cells(args, work, cache_dir), (mid_run(args, work, cache_dir) if args.app_mid_layers else [])


def print_tables(results: list[AppCell], midrun: list[dict], args) -> None:
    one = results[0].delivered
    slots = args.app_slots or "the default"
    print(f"\nthe application: python -m distill mode=local local.num_workers=N teacher.sleep_per_batch_s="
          f"{args.delay_ms / 1000:g} pipeline.worker_max_batch={args.max_batch} (tiny Llama hidden 64, 64 tokens, "
          f"{args.app_layers} layer stages of {args.app_steps} steps of 8 samples, {slots} slots); "
          "figures: stage_end in metrics.jsonl, median over the stages")
    print(f"\n{'workers':>7} | {'delivered/s':>11} | {'ideal':>7} | {'ratio':>5} | {'needed/s':>8} | "
          f"{'waiting':>7}")
    for cell in results:
        ideal = cell.workers * one
        print(f"{cell.workers:>7} | {cell.delivered:>11.1f} | {ideal:>7.1f} | {cell.delivered / ideal:>5.2f} | "
              f"{cell.needed:>8.1f} | {cell.wait:>7.0%}")
    if not midrun:
        return
    print("\na worker added (add_worker.sh) and removed (SIGTERM) between stages of one job, 1 -> 2 -> 1:")
    print(f"\n{'stage':>5} | {'workers':>7} | {'delivered/s':>11} | {'needed/s':>8} | {'waiting':>7}")
    for e in midrun:
        workers = str(e["workers_min"]) if e["workers_min"] == e["workers_max"] else \
            f"{e['workers_min']}-{e['workers_max']}"
        print(f"{e['stage']:>5} | {workers:>7} | {e['delivered_samples_per_s']:>11.1f} | "
              f"{e['needed_samples_per_s']:>8.1f} | {e['wait_fraction']:>7.0%}")
