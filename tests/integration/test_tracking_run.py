"""Experiment tracking through the CLI: a short ``mode=local`` run of two DDP ranks with
tracking=tensorboard leaves one writer's event file (the leader's) that TensorBoard reads back
with every number of its metrics.jsonl, the final evaluation included, and its config; ``tracking=wandb`` without wandb installed is
refused in one line naming the extra, before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.errors import ConfigError
from tests.integration.test_app import shared_tiny_cache
from tests.unit.train.test_tracking import assert_holds, read_metrics_file, tensorboard_figures

RUN_TIMEOUT_S = 240
CLI_TIMEOUT_S = 60
WITHOUT_WANDB = """
import runpy, sys
sys.modules["wandb"] = None  # as if wandb were not installed
sys.argv = ["distill", *sys.argv[1:]]
runpy.run_module("distill", run_name="__main__")
"""


def _tiny(tmp_path: Path) -> list[str]:
    return ["teacher.tiny.num_layers=2", "teacher.tiny.hidden_size=32", "teacher.tiny.num_heads=2",
            "teacher.tiny.vocab_size=300", "teacher.tiny.train_steps=30",
            f"teacher.cache_dir={shared_tiny_cache(tmp_path)}", "data.seq_len=32", "data.max_heldout_chunks=8",
            "student.micro_batch_size=4", "student.steps_per_stage=4", "student.val_every_steps=2",
            "student.log_every_steps=2", "student.e2e.steps=0", "pipeline.slot_count=8",
            "pipeline.heartbeat_interval_s=0.5", "local.num_workers=1", "local.num_students=2"]


def test_a_local_run_is_read_back_from_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "distill", "mode=local", "tracking=tensorboard", *_tiny(tmp_path),
                             "run_id=tracked", f"checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={run_dir}",
                             "profile.enabled=true", "profile.active=2"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = read_metrics_file(run_dir)
    assert {r["stage"] for r in records if r["event"] == "stage_end"} == {0, 1}
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 alone writes
    figures, hparams = tensorboard_figures(run_dir / "tensorboard")
    assert_holds(figures, records)
    evaluation = json.loads((run_dir / "result.json").read_text())
    assert figures[("eval/student", 0)] == pytest.approx(evaluation["eval"]["student"], rel=1e-6)
    assert figures[("eval/decode/speedup", 0)] == pytest.approx(evaluation["decode"]["speedup"], rel=1e-6)
    assert hparams["run_id"] == "tracked" and hparams["student.steps_per_stage"] == 4
    # profile.enabled: stage 0's steps on the student rank and the workers' batches, traced
    profiles = sorted(path.name for path in (run_dir / "profile").iterdir())
    assert "student_rank0_stage0.trace.json" in profiles and "student_rank0_stage0.ops.txt" in profiles
    assert any(name.startswith("worker_") and name.endswith(".trace.json") for name in profiles), profiles
    assert not any("stage1" in name for name in profiles)


def test_tracking_with_a_missing_library_is_one_line_before_any_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", WITHOUT_WANDB, "mode=local", "tracking=wandb",
                             f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=CLI_TIMEOUT_S)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["tracking=wandb needs wandb: pip install 'distill[wandb]' (or pip install wandb), "
                     "or tracking=none"], result.stderr
    assert result.returncode == ConfigError.exit_code
    assert not list(run_dir.glob("*.out"))  # no broker, no worker
