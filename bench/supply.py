"""Do the students starve? The default run with 1, 2 and 3 teacher workers, side by side.

Runs ``python -m distill`` (``mode=local``: a broker, N teacher workers, 1 student
rank, the default tiny Llama teacher and linear-attention replacements) once per
worker count, each from scratch (``resume=false``, its own checkpoint directory) and
reads back what the run itself records: per stage, from ``metrics.jsonl``
(``stage_end``), the share of training steps spent waiting for samples
(``wait_fraction``), the samples/s the teachers delivered and the samples/s the
student would have taken had it never waited (``needed_samples_per_s``); and whether
the run's log called the stage teacher-bound. The target: under 5% waiting with
enough workers; with too few, the log line saying by how much.

The teacher is pre-trained once and cached (``$DISTILL_CACHE`` or ``~/.cache/distill``);
the first call pays for that (about 70 s on 2 cores) before its first run.

Run it from the repository root::

    python bench/supply.py                 # workers 1, 2, 3, about 2-3 minutes
    python bench/supply.py --workers 2     # one run
    python bench/supply.py --steps 100     # shorter stages
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STARVED = 0.05
RUN_TIMEOUT_S = 900


@dataclass
class StageSupply:
    """One stage of one run, as the run recorded it."""

    workers: int
    stage: int
    wait_fraction: float
    delivered: float
    needed: float
    teacher_bound_logged: bool


def run_once(workers: int, steps: int, out: Path) -> tuple[list[StageSupply], float]:
    """One default run with ``workers`` teacher workers; its stages and wall time."""
    run_dir = out / f"workers{workers}"
    cmd = [sys.executable, "-m", "distill", "mode=local", f"local.num_workers={workers}", "resume=false",
           f"student.steps_per_stage={steps}", f"checkpoint_dir={out / f'ckpt{workers}'}",
           f"hydra.run.dir={run_dir}"]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    log = result.stdout + result.stderr
    stages = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") != "stage_end":
            continue
        stage = record["stage"]
        stages.append(StageSupply(workers, stage, record["wait_fraction"], record["delivered_samples_per_s"],
                                  record["needed_samples_per_s"], f"stage {stage} was teacher-bound" in log))
    return stages, wall


def print_table(rows: list[StageSupply], walls: dict[int, float]) -> None:
    print(f"\n{'workers':>7} {'stage':>5} {'waiting':>8} {'delivered/s':>12} {'needed/s':>9} "
          f"{'needed/delivered':>17}  log")
    for r in rows:
        verdict = "teacher-bound line" if r.teacher_bound_logged else "-"
        print(f"{r.workers:>7} {r.stage:>5} {r.wait_fraction:>8.1%} {r.delivered:>12.0f} {r.needed:>9.0f} "
              f"{r.needed / max(r.delivered, 1e-9):>17.2f}  {verdict}")
    print(f"\n{'workers':>7} {'wall s':>7} {'worst stage waiting':>20}  under {STARVED:.0%}?")
    for workers, wall in walls.items():
        worst = max(r.wait_fraction for r in rows if r.workers == workers)
        print(f"{workers:>7} {wall:>7.0f} {worst:>20.1%}  {'yes' if worst < STARVED else 'no'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,3", help="comma-separated teacher worker counts")
    parser.add_argument("--steps", type=int, default=200, help="training steps per stage (default: the run's 200)")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    load_before = os.getloadavg()[0]
    rows: list[StageSupply] = []
    walls: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="distill-supply-") as out:
        for workers in counts:
            print(f"  run with {workers} teacher worker(s) ...", file=sys.stderr, flush=True)
            stages, walls[workers] = run_once(workers, args.steps, Path(out))
            rows += stages
    print(f"distill supply benchmark: the default run (python -m distill, 1 student rank), "
          f"{args.steps} steps per stage; {os.cpu_count()} CPUs shared by the broker, the workers and the "
          f"student; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print_table(rows, walls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
