"""A stage's counters: the log line, the stage's supply record and the run's time split read
the same seconds."""

from __future__ import annotations

import pytest

from distill.train.counters import StageCounters
from distill.train.supply import data_supply


def test_the_supply_record_and_the_time_split_read_the_same_counters() -> None:
    counters = StageCounters(world_size=2, samples=30, wait_s=1.5, step_s=6.0, startup_wait_s=4.0)
    assert counters.wait_fraction() == pytest.approx(0.25)
    assert counters.supply() == data_supply(1.5, 6.0, 60, 4.0)
    assert counters.supply()["needed_samples_per_s"] == pytest.approx(60 / 4.5)
    timings = {"student_wait_s": 1.0}
    counters.add_to(timings)
    counters.add_to(timings)  # a second stage adds to the run's split
    assert timings == {"student_compute_s": 9.0, "student_wait_s": 4.0, "student_startup_wait_s": 8.0}


def test_a_stage_that_has_not_stepped_has_no_wait() -> None:
    counters = StageCounters(world_size=1)
    assert counters.wait_fraction() == 0.0 and counters.samples_per_s() == 0.0
    assert counters.supply()["wait_fraction"] == 0.0
