"""The whole run's progress: where it is across all stages, and how long it should still take.

Each stage has its own tqdm bar; a user planning a 30-layer run needs the sum. After every layer
stage (and after the end-to-end stage) the leader logs one line that starts with the stages and
steps this process trained and the elapsed time, then the whole run in a form to plan by:
``stage 3/31, 41% of the steps, ~1h12m left``. Stages and steps finished by an earlier run of the
same command count as done; the time left is the remaining layer steps at the pace measured so
far (their wall time per step, setup and validation included), plus the end-to-end stage's steps
at ``e2e_step_s`` when one is known: ``mode=plan``'s model of its step (:func:`e2e_step_estimate_s`,
from a timed teacher forward). Without it the estimate stops before the end-to-end stage and says so.
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
    """Steps of the layer stages this process trains."""
    num_stages: int
    """Layer stages this process trains."""
    e2e_steps: int = 0
    """Steps of the end-to-end stage (0: none, or finished already)."""
    stages_before: int = 0
    """Layer stages an earlier run of this command finished (counted as done, never timed)."""
    steps_before: int = 0
    """Their steps."""
    e2e_step_s: float | None = None
    """Seconds an end-to-end step should take (None: not known until that stage runs)."""
    started: float = field(default_factory=time.monotonic)
    stages_done: int = 0
    steps_done: int = 0
    e2e_done: bool = False

    def stage_done(self, steps: int) -> str:
        """Count a finished layer stage of ``steps`` steps; the line to log."""
        self.stages_done += 1
        self.steps_done += steps
        return self.line()

    def e2e_stage_done(self) -> str:
        """Count the finished end-to-end stage; the line to log."""
        self.e2e_done = True
        return self.line()

    def line(self, now: float | None = None) -> str:
        """``run: 3 of 30 layer stages (1,200 of 12,000 steps) in 5m12s; stage 3/31, 9% of the
        steps, ~52m left: ...`` and where the estimate comes from."""
        elapsed_s = (time.monotonic() if now is None else now) - self.started
        layer_left = self.layer_steps - self.steps_done
        per_step_s = elapsed_s / self.steps_done if self.steps_done else None
        head = (f"run: {self.stages_done} of {self.num_stages} layer stages ({self.steps_done:,} of "
                f"{self.layer_steps:,} steps) in {duration(elapsed_s)}")
        detail = ""
        if per_step_s is not None and layer_left > 0:
            detail += f"; about {duration(layer_left * per_step_s)} left for the layer stages at {per_step_s:.2f} s/step"
        if self.e2e_steps and not self.e2e_done:
            if self.e2e_step_s is not None:
                detail += (f", then the end-to-end stage ({self.e2e_steps:,} steps, ~{duration(self._e2e_left_s())} "
                           f"at {self.e2e_step_s:.2f} s/step planned)")
            else:
                detail += f", then the end-to-end stage ({self.e2e_steps:,} steps; timed on its own bar)"
        return f"{head}; {self.summary(per_step_s)}{detail}"

    def summary(self, per_step_s: float | None) -> str:
        """``stage 3/31, 41% of the steps, ~1h12m left``: the whole run, earlier runs' stages included."""
        total_stages = self.stages_before + self.num_stages + (1 if self.e2e_steps else 0)
        stage = self.stages_before + self.stages_done + (1 if self.e2e_done else 0)
        total_steps = self.steps_before + self.layer_steps + self.e2e_steps
        done_steps = self.steps_before + self.steps_done + (self.e2e_steps if self.e2e_done else 0)
        text = f"stage {stage}/{total_stages}, {100 * done_steps // max(1, total_steps)}% of the steps"
        if per_step_s is None and self.steps_done < self.layer_steps:
            return text  # nothing measured yet
        layer_left_s = (self.layer_steps - self.steps_done) * (per_step_s or 0.0)
        if self.e2e_steps and not self.e2e_done and self.e2e_step_s is None:
            return f"{text}, ~{duration(layer_left_s)} left before the end-to-end stage" if layer_left_s > 0 else text
        left_s = layer_left_s + self._e2e_left_s()
        return f"{text}, ~{duration(left_s)} left" if left_s > 0 else text

    def _e2e_left_s(self) -> float:
        if not self.e2e_steps or self.e2e_done or self.e2e_step_s is None:
            return 0.0
        return self.e2e_steps * self.e2e_step_s


def e2e_step_estimate_s(teacher_forward_s: float, num_workers: int) -> float:
    """``mode=plan``'s model of one end-to-end step, from ``teacher_forward_s``, one forward of the
    whole teacher over the step's samples: the workers' forward (shared among ``num_workers``)
    plus the student's forward and backward of the whole model (about three forwards). A lower
    bound: the top-k targets, LM head and loss over the vocabulary come on top."""
    return teacher_forward_s / max(1, num_workers) + 3 * teacher_forward_s


def duration(seconds: float) -> str:
    """``45s``, ``5m12s``, ``3h05m``: a wall time a person reads at a glance."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
