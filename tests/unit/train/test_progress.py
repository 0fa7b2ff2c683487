"""The whole run's progress line: stages and steps done, elapsed, time left at the measured pace."""

from __future__ import annotations

from distill.train.progress import RunProgress, duration


def test_the_line_projects_the_remaining_layer_stages_at_the_pace_so_far() -> None:
    progress = RunProgress(layer_steps=3000, num_stages=30, e2e_steps=400, started=0.0)
    progress.stages_done, progress.steps_done = 3, 300
    line = progress.line(now=150.0)  # 0.5 s a step so far, 2,700 steps to go
    assert line.startswith("run: 3 of 30 layer stages (300 of 3,000 steps) in 2m30s")
    assert "about 22m30s left for the layer stages at 0.50 s/step" in line
    assert "then the end-to-end stage (400 steps" in line


def test_nothing_is_projected_before_a_step_or_after_the_last() -> None:
    assert "left" not in RunProgress(layer_steps=100, num_stages=1, started=0.0).line(now=5.0)
    done = RunProgress(layer_steps=100, num_stages=1, started=0.0)
    assert "left" not in done.stage_done(100)


def test_durations_read_at_a_glance() -> None:
    assert [duration(s) for s in (0.4, 45, 312, 11100)] == ["0s", "45s", "5m12s", "3h05m"]
