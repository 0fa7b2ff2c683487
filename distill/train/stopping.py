"""When a layer stage ends: its step count, a token budget, or validation patience.

A token budget shortens the stage before it starts (the learning-rate schedule is fitted
to the shorter stage); patience ends it when validation stops improving, which needs
periodic validation (``student.val_every_steps``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from distill.config import StudentConfig

STOP_STEPS = "steps"
STOP_BUDGET = "budget"
STOP_PATIENCE = "patience"


def budget_steps(student_cfg: Any, world_size: int, seq_len: int) -> int:
    """Steps a stage runs: ``steps_per_stage``, or fewer if ``max_tokens_per_stage`` says so."""
    steps = int(student_cfg.steps_per_stage)
    budget = student_cfg.max_tokens_per_stage
    if budget is None:
        return steps
    if budget < 1:
        raise ValueError(f"student.max_tokens_per_stage={budget} must be >= 1, or null for no budget")
    tokens_per_step = student_cfg.micro_batch_size * student_cfg.grad_accum_steps * world_size * seq_len
    return max(1, min(steps, math.ceil(budget / tokens_per_step)))


def with_budget(student_cfg: StudentConfig, world_size: int, seq_len: int) -> StudentConfig:
    """A copy of the student config whose ``steps_per_stage`` honours the token budget."""
    steps = budget_steps(student_cfg, world_size, seq_len)
    if steps == student_cfg.steps_per_stage:
        return student_cfg
    return dataclasses.replace(student_cfg, steps_per_stage=steps)


def stop_reason(student_cfg: Any, steps_planned: int) -> str:
    """Why a stage that ran all its planned steps ended: the step count or the budget."""
    return STOP_BUDGET if steps_planned < student_cfg.steps_per_stage else STOP_STEPS


class Patience:
    """Counts validations without an improvement larger than ``min_delta``."""

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        if patience < 0:
            raise ValueError(f"student.patience={patience} must be >= 0 (0 = never stop early)")
        self.patience = patience
        self.min_delta = min_delta
        self.best = math.inf
        self.bad = 0

    def update(self, loss: float) -> bool:
        """Record one validation loss; True when the stage should stop now."""
        if loss < self.best - self.min_delta:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        return self.patience > 0 and self.bad >= self.patience
