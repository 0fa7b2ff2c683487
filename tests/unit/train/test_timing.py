"""How a run's time is accounted: data supply per stage, teacher counters, the split table."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distill.teacher.timing import TimedBatchFn, TimingWriter
from distill.teacher.transfer import DeviceToSlots
from distill.train.supply import Slots, WorkersSeen, data_supply, teacher_bound_advice
from distill.train.timing import (
    STUDENT_PHASES,
    format_time_split,
    read_teacher_times,
    time_split,
    timed,
)


def test_data_supply_says_how_short_the_teachers_were() -> None:
    # 10 s of steps, 4 s of them waiting, 600 samples: 60/s arrived, 100/s could be taken
    supply = data_supply(wait_s=4.0, step_s=10.0, samples=600, startup_wait_s=0.5)
    assert supply["wait_fraction"] == pytest.approx(0.4)
    assert supply["delivered_samples_per_s"] == pytest.approx(60.0)
    assert supply["needed_samples_per_s"] == pytest.approx(100.0)
    assert supply["startup_wait_s"] == 0.5
    fed = data_supply(wait_s=0.0, step_s=10.0, samples=600)
    assert fed["wait_fraction"] == 0 and fed["needed_samples_per_s"] == fed["delivered_samples_per_s"]


def test_the_teacher_bound_advice_names_its_figures_and_how_many_workers_would_help(tmp_path: Path) -> None:
    """1 worker delivering 128 of the 207 samples/s needed: 1 more, each on a device of its own;
    2 workers delivering 100 of 260 (50 each): 4 more (ceil(260 / 50) = 6 in all). The script
    that adds one to the running job is named only while it exists."""
    seen = WorkersSeen()
    for live in (None, 1, 1):  # None: the broker has not answered a heartbeat yet
        seen.note(live)
    supply = {**data_supply(wait_s=3.8, step_s=10.0, samples=1280), **seen.record()}
    assert (supply["workers_min"], supply["workers_max"]) == (1, 1)
    script = tmp_path / "add_worker.sh"
    advice = teacher_bound_advice(0, supply, script)
    assert advice.startswith("stage 0 was teacher-bound: students waited 38% of their steps for data; "
                             "they needed 206 samples/s, the teachers delivered 128 by 1 worker(s), 128 samples/s each")
    for figure in ("stage_end in metrics.jsonl", "wait_fraction", "needed_samples_per_s", "delivered_samples_per_s",
                   "workers_max"):
        assert figure in advice
    assert "about 1 more worker(s)" in advice and "add_worker.sh" not in advice
    script.touch()
    two = {**data_supply(wait_s=6.15, step_s=10.0, samples=1000), "workers_min": 1, "workers_max": 2}
    advice = teacher_bound_advice(3, two, script)
    assert "about 4 more worker(s)" in advice and f"sh {script} adds one to this running job" in advice
    assert "slot_count" not in advice  # no slots given: nothing said of them
    # 6 workers x batches of 8 need 48 slots: 32 on one rank are short, 2 ranks x 32 are not
    short = teacher_bound_advice(3, two, script, Slots(32, 1, 8))
    assert "with pipeline.slot_count >= 48 (now 32), or the new workers run partial batches" in short
    assert "slot_count" not in teacher_bound_advice(3, two, script, Slots(32, 2, 8))
    unknown = teacher_bound_advice(1, {**two, "workers_max": None}, script)
    assert "more teacher workers" in unknown and "samples/s each" not in unknown


@pytest.mark.timeout(30)
def test_teacher_counters_reach_the_run_dir(tmp_path: Path) -> None:
    copier = DeviceToSlots("cpu")
    states = [torch.randn(4, 64, 256)]

    def batch_fn(model_id: str, model_cfg: dict | None, targets: list) -> None:
        torch.randn(256, 256) @ torch.randn(256, 256)  # the "forward"
        copier.start(states, targets)()  # on CPU the copies are done on return

    timed = TimedBatchFn(batch_fn, copy_s=lambda: copier.copy_s)
    dests = list(torch.zeros(4, 1, 64, 256))
    for _ in range(3):
        assert timed("m", None, dests) is None
    writer = TimingWriter(timed.snapshot, tmp_path / "teacher_time.1.json", interval_s=0.05).start()
    writer.stop()
    (times,) = read_teacher_times(tmp_path)
    assert times["samples"] == 12 and times["batches"] == 3
    assert 0 < times["copy_s"] <= times["busy_s"]
    assert times["teacher_s"] == pytest.approx(times["busy_s"] - times["copy_s"])
    torch.testing.assert_close(dests[0][0], states[0][0])


def test_time_split_student_lane_adds_up_to_the_wall_time() -> None:
    teachers = [{"teacher_s": 30.0, "copy_s": 2.0}, {"teacher_s": 20.0, "copy_s": 4.0}]
    phases = {"student_start_s": 8.0, "stage_setup_s": 3.0, "validation_s": 2.0, "checkpoint_s": 1.0,
              "hybrid_choice_s": 0.0, "export_s": 1.5, "evaluate_s": 6.0, "decode_s": 0.0, "assist_s": 0.0}
    rows = dict(time_split(100.0, {"student_compute_s": 50.0, "student_wait_s": 10.0,
                                   "student_startup_wait_s": 4.0, **phases}, teachers, 5.0))
    assert rows["teacher forward (mean per worker)"] == 25.0
    assert rows["transport: slot writes (mean per worker)"] == 3.0
    assert rows["transport: broker CPU"] == 5.0
    assert sum(v for k, v in rows.items() if k.startswith("student")) == pytest.approx(100.0)
    table = format_time_split(list(rows.items()), 100.0, num_workers=2)
    assert "| student waiting for data | 10.0 | 10% |" in table
    assert rows["student waiting for each stage's first batch (teachers starting or switching layers)"] == 4.0
    assert [rows[name] for _, name in STUDENT_PHASES] == list(phases.values())
    assert rows["student other (launching the student processes, barriers, tearing the run down)"] == 14.5


def test_time_split_of_a_student_that_timed_no_phases_puts_the_rest_under_other() -> None:
    """A result.json written before the phases were timed still adds up."""
    rows = dict(time_split(10.0, {"student_compute_s": 6.0}, [], None))
    assert "transport: broker CPU" not in rows
    assert all(rows[name] == 0.0 for _, name in STUDENT_PHASES)
    assert rows["student other (launching the student processes, barriers, tearing the run down)"] == 4.0


def test_timed_adds_up_blocks_even_when_they_raise() -> None:
    timings: dict[str, float] = {}
    with timed(timings, "validation_s"):
        time.sleep(0.02)
    with pytest.raises(ValueError), timed(timings, "validation_s"):
        time.sleep(0.02)
        raise ValueError("a failed validation still took its time")
    assert 0.04 <= timings["validation_s"] < 1.0


def test_process_age_counts_from_the_start_of_the_process() -> None:
    """A child that sleeps 0.3 s before asking is at least that old, and not much older."""
    code = "import time; time.sleep(0.3); from distill.train.timing import process_age_s; print(process_age_s())"
    started = time.monotonic()
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.3 <= age <= time.monotonic() - started + 0.02  # /proc's start time is in ticks of 10 ms
