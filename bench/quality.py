"""Distillation quality against cost: every replacement kind and an automatic hybrid, over seeds.

For each kind (``replacement=`` linear_attention, sliding_window_linear,
gated_linear_attention, gated_delta_rule (decoders), mlp, pruned, lowrank, copy, and the automatic hybrids
``student.hybrid.keep_softmax=1``: ``hybrid`` with linear attention, ``hybrid_sliding`` with
sliding_window_linear) and each seed (``student.seed``: the
replacements' init and the order of the training samples), this runs the real application
(``python -m distill mode=local``: broker, teacher workers, a student rank) with the default
settings, on the tiny Llama (``--teacher llama``: held-out perplexity) or the pre-trained tiny
BERT (``--teacher bert``: held-out cosine of the final hidden states, beside the identity
baseline, the teacher with the converted layers skipped), and prints one row per kind:

- the student: median over the seeds, and their spread (min-max);
- the student after the layer stages, and the share of the gap they leave to the teacher that
  the end-to-end stage recovers, ``(after layers - final) / (after layers - teacher)``;
- the cost of the student's layer stack against the teacher's (embeddings and head left out;
  a layer the hybrid keeps counts as the teacher's own): parameters, and forward FLOPs per
  token at 128 and 8192 tokens of context (``distill.replacements.describe``).

Decode ms/token is not in the table yet: it comes with the student's recurrent decoding
(issue 20, ``bench/inference.py``).

A run's directory under ``--work-dir`` is kept and reused, so the bench can be split into
short holds of the CPU lock, each running a few of the missing runs (``--max-runs``), and the
last call prints the table of all of them::

    flock /tmp/distill-cpu.lock python bench/quality.py --work-dir W --max-runs 3   # repeat
    python bench/quality.py --work-dir W --max-runs 0                               # the table
    python bench/quality.py --teacher bert --work-dir WB --kinds linear_attention hybrid
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from distill.config import CONF_DIR
from distill.model.teacher import Teacher
from distill.replacements import describe

log = logging.getLogger("bench.quality")

ROOT = Path(__file__).resolve().parent.parent
HYBRIDS = {"hybrid": "linear_attention", "hybrid_sliding": "sliding_window_linear"}
"""The automatic-hybrid rows (``student.hybrid.keep_softmax=1``) and the replacement they convert with."""
KINDS = ("linear_attention", "sliding_window_linear", "gated_linear_attention", "gated_delta_rule", "mlp", "pruned",
         "lowrank", "copy", *HYBRIDS)
CAUSAL_ONLY = ("gated_delta_rule",)
"""Kinds an encoder teacher refuses: left out of ``--teacher bert`` runs."""
TEACHERS = {"llama": [], "bert": ["teacher=tiny_bert"]}
CONTEXTS = (128, 8192)
ATTEMPTS = 3
"""A failed run is retried (it resumes from its checkpoints): on a loaded machine a start-up
can time out."""


@dataclass
class Run:
    """One finished run's figures."""

    teacher: float
    student: float
    after_layers: float | None
    identity: float | None
    converted: list[int]
    teacher_dir: str
    wall_s: float
    decode_speedup: float | None = None
    """Teacher / student decode ms/token at 8192 tokens of context (batch 1), timed side by
    side by the run itself (``result.json``'s ``decode``); None for encoders."""


def kind_overrides(kind: str) -> tuple[str, list[str]]:
    """(replacement option, extra overrides) of a table row."""
    if kind in HYBRIDS:
        return HYBRIDS[kind], ["student.hybrid.keep_softmax=1"]
    return kind, []


def run_app(name: str, overrides: list[str], work: Path, timeout_s: float) -> None:
    """One ``mode=local`` run in its own directories (its result.json is what counts)."""
    run_dir, ckpt = work / name / "run", work / name / "ckpt"
    cmd = [sys.executable, "-m", "distill", "mode=local", f"run_id=q{os.getpid()}{name}", *overrides,
           f"checkpoint_dir={ckpt}", f"hydra.run.dir={run_dir}", "log_level=WARNING"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode == 0:
            break
        log.warning("run %s failed (attempt %d of %d): %s", name, attempt, ATTEMPTS, done.stderr[-300:])
    else:
        raise RuntimeError(f"run {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    (work / name / "wall_s").write_text(f"{time.monotonic() - started:.1f}")
    log.info("%s: %.0f s", name, time.monotonic() - started)


def read_run(work: Path, name: str) -> Run | None:
    """The figures of a finished run, or None if it has not run."""
    path = work / name / "run" / "result.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    evaluation, summary = result["eval"], result["summary"]
    wall = work / name / "wall_s"
    return Run(evaluation["teacher"], evaluation["student"], summary.get("student_after_layer_stages"),
               evaluation.get("identity"), list(summary["layers"]), summary.get("teacher_source", summary["teacher"]),
               float(wall.read_text()) if wall.exists() else float("nan"),
               (result.get("decode") or {}).get("speedup"))


def stack_cost(kind: str, teacher: Teacher, converted: list[int], seq_len: int) -> tuple[float, float]:
    """(params ratio, FLOPs-per-token ratio at ``seq_len``) of the student's layer stack: each
    converted layer's replacement, freshly built (its cost does not depend on its weights), and
    the teacher's own layer elsewhere."""
    option, _ = kind_overrides(kind)
    build = instantiate(OmegaConf.load(CONF_DIR / "replacement" / f"{option}.yaml"))
    params = flops = teacher_params = teacher_flops = 0
    for layer in range(teacher.num_layers):
        row = describe(build(teacher=teacher, layer_idx=layer).float(), teacher, seq_len)
        teacher_params += row["teacher_params"]
        teacher_flops += row["teacher_flops_per_token"]
        converted_here = layer in converted
        params += row["params"] if converted_here else row["teacher_params"]
        flops += row["flops_per_token"] if converted_here else row["teacher_flops_per_token"]
    return params / teacher_params, flops / teacher_flops


def _spread(values: list[float], fmt: str = ".4g") -> str:
    """median [min-max] of the seeds (just the value for one seed); cosines near 1 need
    ``fmt=".5f"`` to differ."""
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def recovered(run: Run, lm: bool) -> float | None:
    """Share of the layer stages' gap to the teacher that the end-to-end stage closes."""
    if run.after_layers is None:
        return None
    gap = (run.after_layers - run.teacher) if lm else (run.teacher - run.after_layers)
    gain = (run.after_layers - run.student) if lm else (run.student - run.after_layers)
    return gain / gap if gap > 0 else None


def table(rows: dict[str, list[Run]], lm: bool) -> str:
    """The markdown table, one row per kind."""
    metric = "perplexity" if lm else "cosine"
    first = next(runs[0] for runs in rows.values() if runs)
    teacher = Teacher.from_pretrained(first.teacher_dir)
    head = ["kind", "seeds", f"student {metric}", "gap to teacher", "after layer stages",
            "end-to-end: gap recovered", *([] if lm else ["identity baseline"]), "layers converted",
            "params ratio", *(f"FLOPs ratio @{c}" for c in CONTEXTS), *(["decode speedup @8192"] if lm else [])]
    lines = ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|",
             f"| teacher | | {first.teacher:.4g} | | | |" + ("" if lm else " |") + " all kept | 1 | 1 | 1 |"
             + (" 1 |" if lm else "")]
    for kind, runs in rows.items():
        if not runs:
            continue
        students = [r.student for r in runs]
        gaps = [(r.student / r.teacher - 1) * 100 for r in runs]
        shares = [s for r in runs if (s := recovered(r, lm)) is not None]
        after = [r.after_layers for r in runs if r.after_layers is not None]
        converted = sorted({tuple(r.converted) for r in runs})
        costs = [tuple(statistics.median(x) for x in zip(*(stack_cost(kind, teacher, r.converted, c) for r in runs),
                                                         strict=True)) for c in CONTEXTS]
        fmt = ".4g" if lm else ".5f"
        cells = [kind, str(len(runs)), _spread(students, fmt), f"{statistics.median(gaps):+.{1 if lm else 3}f}%",
                 _spread(after, fmt) if after else "–",
                 f"{statistics.median(shares):.0%}" if shares else "–",
                 *([] if lm else [_spread([r.identity for r in runs if r.identity is not None])]),
                 " / ".join(",".join(map(str, c)) for c in converted),
                 f"{costs[0][0]:.3f}", *(f"{flops:.3f}" for _, flops in costs)]
        if lm:
            speedups = [r.decode_speedup for r in runs if r.decode_speedup is not None]
            cells.append(f"{statistics.median(speedups):.2f}x" if speedups else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", choices=sorted(TEACHERS), default="llama")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--work-dir", required=True, help="the runs are kept (and reused) here")
    parser.add_argument("--max-runs", type=int, default=None,
                        help="run at most this many missing runs, then print the table of the finished ones")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("override", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)  # the cost accounting builds modules only; leave the cores to the runs
    work = Path(args.work_dir)
    budget = args.max_runs
    rows: dict[str, list[Run]] = {}
    kinds = [kind for kind in args.kinds if args.teacher == "llama" or kind not in CAUSAL_ONLY]
    for kind in kinds:
        option, extra = kind_overrides(kind)
        for seed in args.seeds:
            name = f"{args.teacher}-{kind}-seed{seed}"
            if read_run(work, name) is None and (budget is None or budget > 0):
                run_app(name, [*TEACHERS[args.teacher], f"replacement={option}", *extra, f"student.seed={seed}",
                               *args.override], work, args.timeout_s)
                budget = None if budget is None else budget - 1
            if (run := read_run(work, name)) is not None:
                rows.setdefault(kind, []).append(run)
    if not rows:
        print("no finished run yet")
        return 0
    wall = [r.wall_s for runs in rows.values() for r in runs]
    print(f"\n{args.teacher} teacher, default settings{' + ' + ' '.join(args.override) if args.override else ''}; "
          f"seeds {args.seeds}; median [min-max]; run wall time {min(wall):.0f}-{max(wall):.0f} s\n")
    print(table(rows, args.teacher == "llama"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
