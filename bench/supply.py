"""Do the students starve? Runs with 1, 2 and 3 teacher workers, side by side.

Runs ``python -m distill`` (``mode=local``: a broker, N teacher workers, 1 student
rank, linear-attention replacements) once per scenario and worker count, each from
scratch (``resume=false``, its own checkpoint directory). Scenarios:

- ``default``: the default run (4-layer tiny Llama, every layer, 200 steps).
- ``deep``: the teacher is 8 layers deep and only its last layer is trained (100
  steps; the teacher briefly pre-trained, cached like the default one): every
  sample costs a full 8-layer forward while the student trains one layer, so the
  teachers must be several times faster than the student, and one worker is not.

Each run's own records are read back: per stage, from ``metrics.jsonl``
(``stage_end``), the share of training steps spent waiting for samples
(``wait_fraction``), the samples/s the teachers delivered and the samples/s the
student would have taken had it never waited (``needed_samples_per_s``); and whether
the run's log called the stage teacher-bound. The target: under 5% waiting with
enough workers; with too few, the log line saying by how much.

The teacher is pre-trained once and cached (``$DISTILL_CACHE`` or ``~/.cache/distill``);
the first call pays for that (about 70 s on 2 cores) before its first run.

Run it from the repository root::

    python bench/supply.py                         # both scenarios, workers 1, 2, 3: about 4 minutes
    python bench/supply.py --scenarios default --workers 2
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
SCENARIOS = {
    "default": [],
    "deep": ["teacher.tiny.num_layers=8", "teacher.tiny.train_steps=20", "student.layers=[7]",
             "student.steps_per_stage=100"],
}


@dataclass
class StageSupply:
    """One stage of one run, as the run recorded it."""

    scenario: str
    workers: int
    stage: int
    wait_fraction: float
    delivered: float
    needed: float
    teacher_bound_logged: bool


def run_once(scenario: str, workers: int, out: Path) -> tuple[list[StageSupply], float]:
    """One run of ``scenario`` with ``workers`` teacher workers; its stages and wall time."""
    run_dir = out / f"{scenario}-workers{workers}"
    cmd = [sys.executable, "-m", "distill", "mode=local", f"local.num_workers={workers}", "resume=false",
           *SCENARIOS[scenario], f"checkpoint_dir={out / f'ckpt-{scenario}-{workers}'}", f"hydra.run.dir={run_dir}"]
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
        stages.append(StageSupply(scenario, workers, stage, record["wait_fraction"], record["delivered_samples_per_s"],
                                  record["needed_samples_per_s"], f"stage {stage} was teacher-bound" in log))
    return stages, wall


def print_table(rows: list[StageSupply], walls: dict[tuple[str, int], float]) -> None:
    print(f"\n{'scenario':<8} {'workers':>7} {'stage':>5} {'waiting':>8} {'delivered/s':>12} {'needed/s':>9} "
          f"{'needed/delivered':>17}  log")
    for r in rows:
        verdict = "teacher-bound line" if r.teacher_bound_logged else "-"
        print(f"{r.scenario:<8} {r.workers:>7} {r.stage:>5} {r.wait_fraction:>8.1%} {r.delivered:>12.0f} "
              f"{r.needed:>9.0f} {r.needed / max(r.delivered, 1e-9):>17.2f}  {verdict}")
    print(f"\n{'scenario':<8} {'workers':>7} {'wall s':>7} {'worst stage waiting':>20}  under {STARVED:.0%}?")
    for (scenario, workers), wall in walls.items():
        worst = max(r.wait_fraction for r in rows if (r.scenario, r.workers) == (scenario, workers))
        print(f"{scenario:<8} {workers:>7} {wall:>7.0f} {worst:>20.1%}  {'yes' if worst < STARVED else 'no'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,3", help="comma-separated teacher worker counts")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {list(SCENARIOS)}")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    scenarios = [name.strip() for name in args.scenarios.split(",")]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {list(SCENARIOS)}")
    load_before = os.getloadavg()[0]
    rows: list[StageSupply] = []
    walls: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="distill-supply-") as out:
        for scenario in scenarios:
            for workers in counts:
                print(f"  {scenario}: run with {workers} teacher worker(s) ...", file=sys.stderr, flush=True)
                stages, walls[scenario, workers] = run_once(scenario, workers, Path(out))
                rows += stages
    print(f"distill supply benchmark: python -m distill (mode=local, 1 student rank) per scenario and worker "
          f"count; {os.cpu_count()} CPUs shared by the broker, the workers and the student; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print_table(rows, walls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
