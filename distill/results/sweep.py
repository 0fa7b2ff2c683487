"""A Hydra callback that ends a multirun with one summary table across its jobs.

Hydra instantiates callbacks in every process it starts, so this module imports only
what reads ``result.json`` (no torch, no models): the broker's start stays fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from distill.results.record import RESULT_FILE, read_result

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Writes ``<sweep dir>/summary.md`` from each job's ``result.json``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [_row(path.parent) for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"))]
        if not rows:
            return
        lines = ["| job | replacement | teacher metric | student metric | mean val loss | params ratio | "
                 "val loss by layer | train tokens/s |",
                 "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['job']} | {r['replacement']} | {r['teacher']} | {r['student']} | {r['val']} | "
                  f"{r['params']} | {r['by_layer']} | {r['speed']} |" for r in rows]
        out = sweep_dir / "summary.md"
        out.write_text("# Sweep summary\n\n" + "\n".join(lines) + "\n")
        print("\n".join(lines))
        log.info("sweep summary written to %s", out)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else "-"


def _row(job_dir: Path) -> dict[str, str]:
    result = read_result(job_dir) or {}
    ev = result.get("eval") or {}
    vals = list((result.get("final_val") or {}).values())
    ratios = [layer.get("params_ratio") for layer in (result.get("layers") or {}).values()
              if layer.get("params_ratio") is not None]
    return {"job": job_dir.name, "replacement": str(result["summary"].get("replacement", "-")).rsplit(".", 1)[-1],
            "teacher": _fmt(ev.get("teacher")), "student": _fmt(ev.get("student")),
            "val": _fmt(sum(vals) / len(vals) if vals else None),
            "params": _fmt(sum(ratios) / len(ratios) if ratios else None),
            "by_layer": " ".join(f"{layer}:{_fmt(loss)}" for layer, loss in sorted(
                (result.get("final_val") or {}).items(), key=lambda kv: int(kv[0]))) or "-",
            "speed": _fmt(_tokens_per_s(result))}


def _tokens_per_s(result: dict) -> float | None:
    """Training tokens per second of the job: its stages' tokens over the time its ranks
    spent waiting for and training on them (both from result.json)."""
    timings = result.get("timings") or {}
    seconds = sum(timings.get(key, 0.0) for key in ("student_compute_s", "student_wait_s", "student_startup_wait_s"))
    tokens = (result.get("summary") or {}).get("train_tokens", 0)
    return tokens / seconds if seconds and tokens else None
