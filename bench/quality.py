"""Distillation quality: how much of the teacher's perplexity each tool gets back.

On the tiny Llama teacher (pre-trained briefly on the offline corpus, cached; the
default `teacher=tiny_llama`), for each replacement type this runs the real
application (`python -m distill mode=local`: broker, teacher workers, a student rank)
twice and prints held-out perplexity of:

    teacher                       the teacher itself
    teacher-forced                every layer replaced, each trained on the teacher's inputs
    + closed-loop                 each layer trained on the already-trained replacements' outputs
    + end-to-end                  then the assembled student trained on top-k KL (student.e2e)

and the share of the teacher-forced gap the end-to-end stage recovers,
(ppl_teacher_forced - ppl_e2e) / (ppl_teacher_forced - ppl_teacher). The closed-loop and
end-to-end numbers come from one run (its result.json holds the student before and after
the end-to-end stage).

    python bench/quality.py                                   # linear_attention and mlp, ~20 min on 2 busy cores
    python bench/quality.py --replacements mlp --steps 100 --e2e-steps 100
    python bench/quality.py --work-dir DIR     # keeps the runs; a rerun with DIR reuses finished ones
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench.quality")

ROOT = Path(__file__).resolve().parent.parent
ATTEMPTS = 4
"""A failed run is retried (it resumes from its checkpoints): on a loaded machine a start-up
can time out."""


def run_app(name: str, overrides: list[str], work: Path, timeout_s: float) -> dict:
    """One `mode=local` run in its own directories; returns its result.json."""
    run_dir, ckpt = work / name / "run", work / name / "ckpt"
    if (run_dir / "result.json").exists():  # a --work-dir of an earlier bench: reuse its finished runs
        log.info("%s: reusing %s", name, run_dir)
        return json.loads((run_dir / "result.json").read_text())
    cmd = [sys.executable, "-m", "distill", "mode=local", f"run_id=q{os.getpid()}{name}", *overrides,
           f"checkpoint_dir={ckpt}", f"hydra.run.dir={run_dir}", "log_level=WARNING"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):  # a loaded machine can make a start-up time out
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode == 0:
            break
        log.warning("run %s failed (attempt %d of %d): %s", name, attempt, ATTEMPTS, done.stderr[-300:])
    else:
        raise RuntimeError(f"run {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    log.info("%s: %.0f s", name, time.monotonic() - started)
    return json.loads((run_dir / "result.json").read_text())


def measure(replacement: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """Teacher, teacher-forced, closed-loop and closed-loop + end-to-end perplexities."""
    common = [f"replacement={replacement}", f"student.steps_per_stage={args.steps}",
              f"local.num_workers={args.workers}", *args.override]
    forced = run_app(f"{replacement}-forced", common, work, args.timeout_s)
    closed = run_app(f"{replacement}-closed-e2e", [
        *common, f"student.inputs={args.inputs}", f"student.e2e.steps={args.e2e_steps}",
        f"student.e2e.trainable={args.trainable}", f"student.e2e.lr={args.e2e_lr}",
        f"student.e2e.temperature={args.temperature}", f"student.e2e.top_k={args.top_k}"], work, args.timeout_s)
    return {"teacher": forced["eval"]["teacher"], "forced": forced["eval"]["student"],
            "closed": closed["summary"]["student_after_layer_stages"], "e2e": closed["eval"]["student"]}


def recovered(row: dict[str, float], key: str) -> float:
    """Share of the teacher-forced perplexity gap that ``key`` closes."""
    gap = row["forced"] - row["teacher"]
    return (row["forced"] - row[key]) / gap if gap > 0 else float("nan")


def print_table(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\nheld-out perplexity, tiny Llama teacher, {args.steps} steps/layer, inputs={args.inputs}, "
          f"e2e: {args.e2e_steps} steps, trainable={args.trainable}, top-{args.top_k}, tau={args.temperature}\n")
    print("| replacement | teacher | teacher-forced | + closed-loop | + end-to-end | gap recovered "
          "(closed-loop) | gap recovered (end-to-end) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['teacher']:.2f} | {row['forced']:.2f} | {row['closed']:.2f} | {row['e2e']:.2f} "
              f"| {recovered(row, 'closed'):.0%} | {recovered(row, 'e2e'):.0%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replacements", nargs="+", default=["linear_attention", "mlp"])
    parser.add_argument("--steps", type=int, default=200, help="student.steps_per_stage")
    parser.add_argument("--inputs", default="student", choices=["student", "mix"])
    parser.add_argument("--e2e-steps", type=int, default=400)
    parser.add_argument("--trainable", default="replacements", choices=["replacements", "lora", "all"])
    parser.add_argument("--e2e-lr", type=float, default=3e-3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--work-dir", default=None, help="keep runs here (default: a temporary directory)")
    parser.add_argument("override", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="distill-quality-") as tmp:
        work = Path(args.work_dir or tmp)
        rows = {name: measure(name, args, work) for name in args.replacements}
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
