"""What a stage's steps have cost so far, counted in one place.

The trainer's loop adds to :class:`StageCounters` at each micro-batch and step; the log line
of a step, the stage's ``stage_end`` record and the run's time split are all read from it,
so they cannot disagree on what a second of waiting was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distill.train.supply import data_supply


@dataclass
class StageCounters:
    """One rank's counters of one stage.

    ``step_s`` is the time of the training steps, waiting for data included; ``wait_s`` the
    part spent waiting for a batch; ``startup_wait_s`` the wait for the stage's first batch
    (the teachers switching to the stage), kept apart from both so that it does not read as
    starvation. ``samples`` are this rank's; rates multiply by ``world_size``.
    """

    world_size: int
    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    startup_wait_s: float = 0.0

    def elapsed_s(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def samples_per_s(self) -> float:
        """All ranks' samples per second of the stage's wall time so far."""
        return self.samples * self.world_size / self.elapsed_s()

    def wait_fraction(self) -> float:
        """The share of the steps' time spent waiting for data."""
        return self.wait_s / max(self.step_s, 1e-9)

    def supply(self) -> dict[str, float]:
        """The stage's supply figures (:func:`distill.train.supply.data_supply`)."""
        return data_supply(self.wait_s, self.step_s, self.samples * self.world_size, self.startup_wait_s)

    def add_to(self, timings: dict[str, float]) -> None:
        """Add the stage's student time to the run's time split (``distill.train.timing``)."""
        for key, value in (("student_compute_s", self.step_s - self.wait_s), ("student_wait_s", self.wait_s),
                           ("student_startup_wait_s", self.startup_wait_s)):
            timings[key] = timings.get(key, 0.0) + value
