"""mode=plan: the run's stages projected from timed pieces, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from distill.modes.plan import Timings, project
from tests.integration.test_app import shared_tiny_cache
from tests.unit.test_config import _compose

TINY = ["teacher.tiny.num_layers=4", "teacher.tiny.hidden_size=32", "teacher.tiny.num_heads=2",
        "teacher.tiny.vocab_size=300", "teacher.tiny.train_steps=5", "data.seq_len=32", "data.max_heldout_chunks=8"]


def test_a_deep_teacher_sets_the_pace_of_its_late_stages_and_more_workers_share_it() -> None:
    timings = Timings(teacher_layer_per_sample_s=0.01, student_step_s=0.1, student_layer_per_sample_s=0.0)
    cfg = _compose(["student.inputs=teacher", "student.e2e.steps=0", "student.micro_batch_size=8",
                    "local.num_workers=1"])
    rows = project(cfg, 30, timings)
    layers = rows[0]
    assert (layers.count, layers.steps) == (30, cfg.student.steps_per_stage)
    # stage l: max(0.1, (l+1) * 0.01 * 8): the student's 0.1 s for l = 0, the teacher's beyond
    expected = sum(max(0.1, (idx + 1) * 0.08) for idx in range(30)) / 30
    assert abs(layers.step_s - expected) < 1e-9 and layers.bound == "teacher in 29 of 30"
    cfg.local.num_workers = 4
    assert project(cfg, 30, timings)[0].step_s < expected / 2


def test_a_joint_schedule_costs_one_step_per_layer_and_one_teacher_pass_whatever_the_depth() -> None:
    timings = Timings(teacher_layer_per_sample_s=0.01, student_step_s=0.1, student_layer_per_sample_s=0.01)
    for depth in (30, 80):
        cfg = _compose(["student.schedule=joint", "student.e2e.steps=0", "student.micro_batch_size=8"])
        (layers, *_) = project(cfg, depth, timings)
        assert (layers.count, layers.bound) == (1, "student")
        assert abs(layers.step_s - depth * (0.1 + 0.01 * 8)) < 1e-9
        sequential = project(_compose(["student.e2e.steps=0", "student.micro_batch_size=8"]), depth, timings)[0]
        assert layers.wall_s < sequential.wall_s


def test_plan_prints_a_projection_and_starts_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "distill", "mode=plan", *TINY, f"teacher.cache_dir={shared_tiny_cache(tmp_path)}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Projected wall time of this run" in result.stdout and "| **total** |" in result.stdout
    assert "| layer stages (layers) | 4 | 400 |" in result.stdout and "end-to-end stage" in result.stdout
    assert not (tmp_path / "run" / "broker.out").exists()
