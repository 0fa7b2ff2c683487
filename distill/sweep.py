"""A Hydra callback that ends a multirun with one summary table across its jobs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Writes ``<sweep dir>/summary.md`` from each job's ``result.json``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [_row(path) for path in sorted(sweep_dir.glob("*/result.json"))]
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


def _row(path: Path) -> dict[str, str]:
    result = json.loads(path.read_text())
    ev = result.get("eval") or {}
    vals = list((result.get("final_val") or {}).values())
    ratios = [layer.get("params_ratio") for layer in (result.get("layers") or {}).values()
              if layer.get("params_ratio") is not None]
    return {"job": path.parent.name, "replacement": str(result["summary"].get("replacement", "-")).rsplit(".", 1)[-1],
            "teacher": _fmt(ev.get("teacher")), "student": _fmt(ev.get("student")),
            "val": _fmt(sum(vals) / len(vals) if vals else None),
            "params": _fmt(sum(ratios) / len(ratios) if ratios else None),
            "by_layer": " ".join(f"{layer}:{_fmt(loss)}" for layer, loss in sorted(
                (result.get("final_val") or {}).items(), key=lambda kv: int(kv[0]))) or "-",
            "speed": _fmt(_tokens_per_s(result, path.parent / "metrics.jsonl"))}


def _tokens_per_s(result: dict, metrics_path: Path) -> float | None:
    """Training tokens per second of the job: its stages' tokens (metrics.jsonl) over the
    time its ranks spent waiting for and training on them (result.json timings)."""
    timings = result.get("timings") or {}
    seconds = sum(timings.get(key, 0.0) for key in ("student_compute_s", "student_wait_s", "student_startup_wait_s"))
    if not seconds or not metrics_path.exists():
        return None
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    tokens = sum(int(r.get("tokens", 0)) for r in records if r.get("event") == "stage_end")
    return tokens / seconds if tokens else None
