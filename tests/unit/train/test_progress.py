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


def test_the_whole_run_in_the_issue_s_form_with_the_planned_end_to_end_stage() -> None:
    progress = RunProgress(layer_steps=3000, num_stages=30, e2e_steps=400, e2e_step_s=2.0, started=0.0)
    progress.stages_done, progress.steps_done = 3, 300
    line = progress.line(now=150.0)  # 2,700 layer steps at 0.5 s + 400 end-to-end steps at 2 s
    assert "; stage 3/31, 8% of the steps, ~35m50s left;" in line
    assert "then the end-to-end stage (400 steps, ~13m20s at 2.00 s/step planned)" in line


def test_without_an_end_to_end_estimate_the_time_left_stops_before_that_stage() -> None:
    progress = RunProgress(layer_steps=3000, num_stages=30, e2e_steps=400, started=0.0)
    progress.stages_done, progress.steps_done = 3, 300
    assert "stage 3/31, 8% of the steps, ~22m30s left before the end-to-end stage" in progress.line(now=150.0)


def test_stages_an_earlier_run_finished_count_as_done_but_not_in_the_pace() -> None:
    progress = RunProgress(layer_steps=200, num_stages=2, e2e_steps=100, e2e_step_s=1.0,
                           stages_before=8, steps_before=800, started=0.0)
    line = progress.stage_done(100)  # at 0.1 s a step here: 100 layer steps + 100 end-to-end steps left
    assert "stage 9/11, 81% of the steps" in progress.line(now=10.0)
    assert line.startswith("run: 1 of 2 layer stages (100 of 200 steps)")
    progress.stage_done(100)
    done = progress.e2e_stage_done()
    assert "stage 11/11, 100% of the steps" in done and "left" not in done


def test_a_run_left_with_only_its_end_to_end_stage_projects_that_stage() -> None:
    progress = RunProgress(layer_steps=0, num_stages=0, e2e_steps=100, e2e_step_s=3.0, stages_before=4,
                           steps_before=400, started=0.0)
    assert "stage 4/5, 80% of the steps, ~5m00s left" in progress.line(now=1.0)
