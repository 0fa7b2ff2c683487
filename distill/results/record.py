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
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"


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
