"""The sweep summary's numbers come from what each job wrote (its result.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distill.results.sweep import SweepSummary


def _job(sweep: Path, name: str, compute_s: float, wait_s: float, tokens: int) -> None:
    job = sweep / name
    job.mkdir(parents=True)
    result = {"summary": {"replacement": "distill.replacements.mlp.MLPReplacement", "train_tokens": tokens},
              "eval": {"teacher": 29.3, "student": 31.0}, "final_val": {"0": 0.5, "1": 0.25},
              "layers": {"0": {"params_ratio": 0.5}, "1": {"params_ratio": 0.25}},
              "timings": {"student_compute_s": compute_s, "student_wait_s": wait_s, "student_startup_wait_s": 1.0}}
    (job / "result.json").write_text(json.dumps(result))


def test_speed_is_tokens_over_the_time_spent_training_and_waiting(tmp_path: Path) -> None:
    _job(tmp_path, "0", compute_s=8.0, wait_s=1.0, tokens=10_000)
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    row = (tmp_path / "summary.md").read_text().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "0" and cells[1] == "MLPReplacement"
    assert float(cells[-1]) == pytest.approx(10_000 / (8.0 + 1.0 + 1.0), rel=1e-3)
    assert cells[4] == "0.375" and cells[6] == "0:0.5 1:0.25"
