"""``result.json``: the numbers of a run's report, for scripts and sweeps. The one owner.

Written once by the leader at the end of the student's run (:func:`write_result`), given
the run's time split by ``mode=local`` when it has outlived every child
(:func:`add_time_split`), and read by the sweep summary (:func:`read_result`). Layout::

    {"summary": {...what was distilled...}, "eval": EvalResult.to_dict() | null,
     "layers": {"<l>": replacements.describe(...)}, "timings": {...student phases...},
     "final_val": {"<l>": last validation loss}, "time_split": {"wall_s": .., "<part>": ..}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"


@dataclass
class RunRecord:
    """Everything a finished run says about itself, gathered once by the leader.

    ``report.md``, ``result.json`` and the exported student's model card are each rendered
    from one record (``finish.render_run``): they used to be given three dicts built side by
    side from the same figures, so a figure added to one could be missing from, or differ in,
    the others. ``summary`` is what was distilled (the options typed, layers, steps, tokens);
    ``eval`` is ``EvalResult.to_dict()``; ``decode`` the decoding and assisted-decoding figures.
    """

    summary: dict[str, Any]
    layers: dict[int, dict[str, Any]]
    """``replacements.describe`` row of each replaced layer."""
    layer_cfgs: dict[int, dict[str, Any]]
    """The replacement's config of each replaced layer (its ``_target_`` and options)."""
    num_layers: int
    causal: bool
    """A causal LM (the card shows ``generate`` and text-generation)."""
    data: dict[str, Any]
    eval: dict[str, Any] | None = None
    decode: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    final_val: dict[str, float] = field(default_factory=dict)
    hybrid: dict[str, Any] | None = None

    def result_json(self) -> dict[str, Any]:
        """The record as ``result.json`` lays it out (module docstring)."""
        return {"summary": self.summary, "eval": self.eval, "decode": self.decode,
                "layers": {str(k): v for k, v in self.layers.items()}, "timings": self.timings,
                "final_val": self.final_val, **({"hybrid": self.hybrid} if self.hybrid is not None else {})}

    def card_facts(self) -> dict[str, Any]:
        """The record as ``card.write_model_card`` reads it."""
        return {"teacher": self.summary.get("teacher_source"), "causal": self.causal, "layers": self.layer_cfgs,
                "num_layers": self.num_layers, "describe": self.layers, "data": self.data,
                "train_tokens": self.summary.get("train_tokens"), "eval": self.eval, "decode": self.decode}


def result_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / RESULT_FILE


def write_result(run_dir: Path | str, result: dict[str, Any]) -> Path:
    """Write ``result`` as the run's result.json (atomically: a reader never sees half)."""
    path = result_path(run_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, path)
    return path


def read_result(run_dir: Path | str) -> dict[str, Any] | None:
    """The run's result.json, or None when the run wrote none (it failed or is not finished)."""
    path = result_path(run_dir)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def add_time_split(run_dir: Path | str, wall_s: float, rows: list[tuple[str, float]]) -> None:
    """Record where the run's wall time went (``time_split``), if the run wrote a result."""
    result = read_result(run_dir)
    if result is None:
        return
    result["time_split"] = {"wall_s": wall_s, **dict(rows)}
    write_result(run_dir, result)
