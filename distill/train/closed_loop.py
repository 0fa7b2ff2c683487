"""Closed-loop inputs: train layer l on what the student's own layers 0..l-1 produce.

Teacher-forced stages feed each replacement the teacher's input of its layer, so once
all replacements are spliced in, each sees inputs shifted by the errors of the ones
before it, errors it never trained on. With ``student.inputs=student`` the worker also
sends the embeddings (the input of layer 0); the student runs its already-trained
replacements (frozen, loaded from the earlier stages' weights; teacher layers where no
layer is replaced) from there to build layer l's input, and trains it against the
teacher's own output of layer l, so it learns to undo the drift. ``mix`` picks, per
sample, the student input with a probability rising linearly from 0 to 1 over the
stage (a curriculum from teacher to student inputs).

Shape legend: B batch, P boundary positions of a stage, T tokens, D hidden size.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from distill.config import Inputs
from distill.model.teacher import Teacher
from distill.stages import Stage
from distill.train.context import StudentContext

log = logging.getLogger(__name__)


def student_fraction(mode: str, step: int, total_steps: int) -> float:
    """Share of samples fed student inputs at ``step``: 0, 1, or a 0 -> 1 ramp for ``mix``."""
    if mode == Inputs.teacher:
        return 0.0
    if mode == Inputs.student:
        return 1.0
    if mode == Inputs.mix:
        return min(1.0, step / max(1, total_steps - 1))
    raise ValueError(f"student.inputs={mode!r}: choose one of {[m.value for m in Inputs]}")


@torch.no_grad()
def run_student_layers(teacher: Teacher, embed_BTD: torch.Tensor, wanted: tuple[int, ...],
                       layers: Mapping[int, nn.Module]) -> dict[int, torch.Tensor]:
    """{l: input of layer l} for each l in ``wanted``, running ``layers`` (else the teacher's) from
    the embeddings. Teacher layers run in the teacher's dtype; replacements in float32."""
    hidden_BTD = embed_BTD.float()
    out: dict[int, torch.Tensor] = {}
    last = max(wanted)
    for idx in range(last + 1):
        if idx in wanted:
            out[idx] = hidden_BTD
        if idx == last:
            break
        if idx in layers:
            hidden_BTD = layers[idx](hidden_BTD).float()
        else:
            hidden_BTD = teacher.run_layer(teacher.layers[idx], hidden_BTD.to(teacher.dtype)).float()
    return out


class InputSchedule:
    """Which samples of each micro-batch are fed student-built inputs, on the schedule of
    ``mode`` (``student.inputs``). Counts its calls (one per micro-batch) to know the step, so
    it needs no hook in the training loop; ``start_step`` keeps the schedule right after a resume."""

    def __init__(self, mode: str, total_steps: int, grad_accum_steps: int, start_step: int, seed: int,
                 stage_index: int) -> None:
        student_fraction(mode, 0, total_steps)  # rejects an unknown mode now
        self.mode = mode
        self.total_steps = total_steps
        self.accum = grad_accum_steps
        self.micro_batches = start_step * grad_accum_steps
        self.generator = torch.Generator().manual_seed(seed * 1009 + stage_index)

    def next_fraction(self) -> float:
        """The share of student inputs for the next micro-batch."""
        fraction = student_fraction(self.mode, self.micro_batches // self.accum, self.total_steps)
        self.micro_batches += 1
        return fraction

    def pick(self, batch_size: int, fraction: float) -> torch.Tensor:
        """Per sample, whether it gets the student's input (drawn only for a share between 0 and 1)."""
        if fraction <= 0.0 or fraction >= 1.0:
            return torch.full((batch_size,), fraction >= 1.0)
        return torch.rand(batch_size, generator=self.generator) < fraction


class ClosedLoopInputs:
    """Replaces a stage's teacher inputs by student-built ones, on an :class:`InputSchedule`."""

    def __init__(self, teacher: Teacher, stage: Stage, frozen: dict[int, nn.Module], mode: str,
                 total_steps: int, grad_accum_steps: int, start_step: int, seed: int) -> None:
        self.schedule = InputSchedule(mode, total_steps, grad_accum_steps, start_step, seed, stage.index)
        self.teacher = teacher
        self.stage = stage
        self.frozen = frozen

    def __call__(self, hidden_BPTD: torch.Tensor, teacher_inputs: dict[int, torch.Tensor],
                 current: Mapping[str, nn.Module]) -> dict[int, torch.Tensor]:
        """Inputs for this micro-batch; ``current`` holds the stage's own replacements (by str layer)."""
        fraction = self.schedule.next_fraction()
        if fraction == 0.0:
            return teacher_inputs
        layers = {**self.frozen, **{int(k): v for k, v in current.items()}}
        student = run_student_layers(self.teacher, hidden_BPTD[:, 0], self.stage.layers, layers)
        if fraction >= 1.0:
            return student
        pick_B11 = self.schedule.pick(hidden_BPTD.shape[0], fraction).to(hidden_BPTD.device)[:, None, None]
        return {layer: torch.where(pick_B11, student[layer], teacher_inputs[layer]) for layer in teacher_inputs}


def build_closed_loop(ctx: StudentContext, stage: Stage, frozen: dict[int, nn.Module], total_steps: int,
                      start_step: int) -> ClosedLoopInputs | None:
    """The stage's input builder from the earlier stages' trained replacements ``frozen``, or
    None when the stage trains on the teacher's inputs."""
    scfg = ctx.cfg.student
    if not stage.closed_loop:
        return None
    log.info("stage %d: %s inputs, built from trained replacements of layers %s", stage.index,
             scfg.inputs, sorted(frozen))
    return ClosedLoopInputs(ctx.teacher, stage, frozen, scfg.inputs, total_steps, scfg.grad_accum_steps,
                            start_step, scfg.seed)
