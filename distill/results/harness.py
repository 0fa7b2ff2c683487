"""The teacher-and-student table of a ``mode=eval`` run: ``eval.md`` and ``eval.json`` in its run directory.

Input is the ``results`` dict lm-evaluation-harness returns for each model
(``{task: {"<metric>,<filter>": value, "<metric>_stderr,<filter>": stderr, "alias": name}}``);
one row per task and metric, the two models side by side, the student's difference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TABLE_FILE = "eval.md"
RESULT_FILE = "eval.json"


def harness_rows(teacher: dict[str, dict], student: dict[str, dict]) -> list[dict[str, Any]]:
    """(task, metric, teacher, student, stderrs) for every metric both models report."""
    rows = []
    for task in sorted(set(teacher) & set(student)):
        for key, value in sorted(teacher[task].items()):
            metric, comma, filter_name = key.partition(",")
            if not comma or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue  # "alias", "sample_len", stderrs: not metrics
            if not isinstance(student[task].get(key), int | float):
                continue
            stderr_key = f"{metric}_stderr,{filter_name}"
            rows.append({"task": teacher[task].get("alias", task).strip(" -"), "metric": metric,
                         "filter": filter_name, "teacher": float(value), "student": float(student[task][key]),
                         "teacher_stderr": _number(teacher[task].get(stderr_key)),
                         "student_stderr": _number(student[task].get(stderr_key))})
    return rows


def harness_table(rows: list[dict[str, Any]], teacher_name: str, student_name: str) -> str:
    """Markdown: task | metric | teacher | student | student - teacher."""
    lines = [f"Teacher: `{teacher_name}`; student: `{student_name}` (lm-evaluation-harness).", "",
             "| task | metric | teacher | student | student - teacher |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['task']} | {row['metric']} | {_cell(row['teacher'], row['teacher_stderr'])} | "
                     f"{_cell(row['student'], row['student_stderr'])} | {row['student'] - row['teacher']:+.4f} |")
    if not rows:
        lines.append("| (no metric reported by both models) | | | | |")
    return "\n".join(lines)


def write_harness_results(out_dir: Path | str, rows: list[dict[str, Any]], teacher_name: str,
                          student_name: str) -> Path:
    """Write eval.md and eval.json to ``out_dir``; returns the table's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps({"teacher": teacher_name, "student": student_name, "rows": rows},
                                              indent=2))
    path = out / TABLE_FILE
    path.write_text("# lm-evaluation-harness: teacher vs student\n\n" + harness_table(rows, teacher_name,
                                                                                    student_name) + "\n")
    return path


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not math.isnan(float(value)) else None


def _cell(value: float, stderr: float | None) -> str:
    return f"{value:.4f}" if stderr is None else f"{value:.4f} ± {stderr:.4f}"
