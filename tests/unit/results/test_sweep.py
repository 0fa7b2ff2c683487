"""The sweep summary's numbers come from what each job wrote (its result.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distill.results.sweep import SweepSummary


def _job(sweep: Path, name: str, compute_s: float, wait_s: float, tokens: int, **summary: object) -> None:
    job = sweep / name
    job.mkdir(parents=True)
    result = {"summary": {"replacement": "distill.replacements.mlp.MLPReplacement", "train_tokens": tokens, **summary},
              "eval": {"kind": "lm", "teacher": 29.3, "student": 31.0}, "final_val": {"0": 0.5, "1": 0.25},
              "layers": {"0": {"params_ratio": 0.5}, "1": {"params_ratio": 0.25}},
              "timings": {"student_compute_s": compute_s, "student_wait_s": wait_s, "student_startup_wait_s": 1.0}}
    (job / "result.json").write_text(json.dumps(result))


def test_speed_is_tokens_over_the_time_spent_training_and_waiting(tmp_path: Path) -> None:
    _job(tmp_path, "0", compute_s=8.0, wait_s=1.0, tokens=10_000)
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    row = (tmp_path / "summary.md").read_text().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "0" and cells[2] == "MLPReplacement"  # a result.json from before option names
    assert float(cells[-2]) == pytest.approx(10_000 / (8.0 + 1.0 + 1.0), rel=1e-3)
    assert cells[5] == "0.3750" and cells[7] == "0:0.5000 1:0.2500"


def test_the_summary_names_the_metric_the_options_and_a_job_that_reused_another_run_s_stages(
        tmp_path: Path) -> None:
    _job(tmp_path, "0", 8.0, 1.0, 10_000, replacement="mlp", command="python -m distill replacement=mlp")
    _job(tmp_path, "1", 8.0, 1.0, 0, replacement="lowrank", command="python -m distill replacement=lowrank",
         restored_layers=[0, 1], checkpoint_dir="outputs/checkpoints/lowrank-0123456789")
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    lines = (tmp_path / "summary.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| job"))
    assert "| teacher perplexity | student perplexity |" in header and "| notes |" in header
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in lines if line[:3] in ("| 0", "| 1")}
    assert rows["0"][1:3] == ["`replacement=mlp`", "mlp"] and rows["0"][-1] == ""
    assert rows["1"][2] == "lowrank" and "Distill" not in header
    assert "reused the finished stages of layers 0, 1" in rows["1"][-1] and "lowrank-0123456789" in rows["1"][-1]
