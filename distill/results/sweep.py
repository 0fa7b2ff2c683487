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

from distill.results.numbers import column_format
from distill.results.record import RESULT_FILE, read_result

log = logging.getLogger(__name__)


METRIC_NAMES = {"lm": "perplexity", "encoder": "cosine similarity"}
"""The held-out metric of each kind of teacher, as the report names it."""
COMMAND = "python -m distill"


class SweepSummary(Callback):
    """Writes ``<sweep dir>/summary.md`` from each job's ``result.json``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = {path.parent.name: read_result(path.parent) or {}
                   for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"))}
        if not results:
            return
        text = summary_table(results)
        out = sweep_dir / "summary.md"
        out.write_text("# Sweep summary\n\n" + text + "\n")
        print(text)
        log.info("sweep summary written to %s", out)


def summary_table(results: dict[str, dict]) -> str:
    """One row per job: the options it was given (as typed), the held-out metric by name, each figure
    column at one precision (distinct values print distinct), and a note for a job that reused
    another run's finished stages (its validation losses are in that run, not here)."""
    rows = {job: _row(result) for job, result in results.items()}
    kinds = sorted({str((r.get("eval") or {}).get("kind")) for r in results.values() if r.get("eval")})
    metric = " / ".join(METRIC_NAMES.get(kind, kind) for kind in kinds) or "metric"
    figures = ("teacher", "student", "val", "params", "speed")
    formats = {key: column_format([row[key] for row in rows.values()]) for key in figures}
    by_layer = column_format([loss for row in rows.values() for loss in row["by_layer"].values()])
    lines = [f"| job | options | replacement | teacher {metric} | student {metric} | mean val loss | params ratio | "
             "val loss by layer | train tokens/s | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for job, row in rows.items():
        cells = [job, row["options"], row["replacement"], *(formats[key](row[key]) for key in figures[:4]),
                 " ".join(f"{layer}:{by_layer(loss)}" for layer, loss in row["by_layer"].items()) or "-",
                 formats["speed"](row["speed"]), row["notes"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(result: dict) -> dict[str, Any]:
    summary = result.get("summary") or {}
    ev = result.get("eval") or {}
    final_val = result.get("final_val") or {}
    vals = list(final_val.values())
    ratios = [layer.get("params_ratio") for layer in (result.get("layers") or {}).values()
              if layer.get("params_ratio") is not None]
    command = str(summary.get("command", COMMAND))
    return {"options": "`" + (command.removeprefix(COMMAND).strip() or "defaults") + "`",
            "replacement": str(summary.get("replacement", "-")).rsplit(".", 1)[-1],
            "teacher": ev.get("teacher"), "student": ev.get("student"),
            "val": sum(vals) / len(vals) if vals else None,
            "params": sum(ratios) / len(ratios) if ratios else None,
            "by_layer": dict(sorted(final_val.items(), key=lambda kv: int(kv[0]))),
            "speed": _tokens_per_s(result), "notes": _notes(summary)}


def _notes(summary: dict) -> str:
    """Why a job's figures may be missing: the stages it reused from checkpoints instead of training."""
    restored = summary.get("restored_layers")
    if not restored:
        return ""
    return (f"reused the finished stages of layers {', '.join(map(str, restored))} from "
            f"`{summary.get('checkpoint_dir', '?')}` (another run trained them: their val losses and "
            "tokens/s are in its report)")


def _tokens_per_s(result: dict) -> float | None:
    """Training tokens per second of the job: its stages' tokens over the time its ranks
    spent waiting for and training on them (both from result.json)."""
    timings = result.get("timings") or {}
    seconds = sum(timings.get(key, 0.0) for key in ("student_compute_s", "student_wait_s", "student_startup_wait_s"))
    tokens = (result.get("summary") or {}).get("train_tokens", 0)
    return tokens / seconds if seconds and tokens else None
