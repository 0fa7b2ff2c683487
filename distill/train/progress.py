"""The whole run's progress: where it is across all stages, and how long it should still take.

Each stage has its own tqdm bar; a user planning a 30-layer run needs the sum. After every layer
stage the leader logs one line: stages and steps done of those planned, the elapsed time, and
the time left for the remaining layer stages at the pace measured so far (their wall time per
step, setup and validation included). The end-to-end stage costs a different amount per step
(a full student and teacher forward) and is only estimated once it runs (its own bar's ETA).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class RunProgress:
    """Planned layer steps of this run (stages not yet finished) and the end-to-end stage's."""

    layer_steps: int
    """Steps of the layer stages this run trains."""
    num_stages: int
    """Layer stages this run trains."""
    e2e_steps: int = 0
    started: float = field(default_factory=time.monotonic)
    stages_done: int = 0
    steps_done: int = 0

    def stage_done(self, steps: int) -> str:
        """Count a finished layer stage of ``steps`` steps; the line to log."""
        self.stages_done += 1
        self.steps_done += steps
        return self.line()

    def line(self, now: float | None = None) -> str:
        """``run: 3 of 30 layer stages (1,200 of 12,000 steps) in 5m12s; about 48m left ...``."""
        elapsed_s = (time.monotonic() if now is None else now) - self.started
        left = self.layer_steps - self.steps_done
        text = (f"run: {self.stages_done} of {self.num_stages} layer stages ({self.steps_done:,} of "
                f"{self.layer_steps:,} steps) in {duration(elapsed_s)}")
        if self.steps_done and left > 0:
            per_step_s = elapsed_s / self.steps_done
            text += f"; about {duration(left * per_step_s)} left for the layer stages at {per_step_s:.2f} s/step"
        if self.e2e_steps:
            text += f", then the end-to-end stage ({self.e2e_steps:,} steps; timed on its own bar)"
        return text


def duration(seconds: float) -> str:
    """``45s``, ``5m12s``, ``3h05m``: a wall time a person reads at a glance."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
