"""The joint schedule: every layer trained at once from one pass (``student.schedule=joint``).

A sequential run trains stage l on samples for which the workers ran the teacher's layers
0..l, so converting L layers one by one costs about (L+1)/2 teacher passes per training
token: 15.5 for a 30-layer model, 40 for an 80-layer one. The joint schedule needs one.
The workers send only what enters layer 0 (the embeddings); the student runs the chain
itself, layer by layer:

- layer l's input ``x_l`` is what came out of layer l-1 in the chain;
- its target is the teacher's own layer l applied to ``x_l`` (no gradient);
- the replacement's loss is local (``x_l`` carries no gradient), and is backpropagated at
  once, so only one layer's activations are alive at a time;
- what goes on to layer l+1 is the replacement's output (``student.inputs=student``, the
  closed loop: each layer learns on the inputs the assembled student will give it) or the
  teacher layer's (``teacher``: then every input and target is exactly the teacher's, as in
  a teacher-forced stage), per sample, with ``mix`` ramping the share of the former from 0
  to 1 over the stage. Layers that are not replaced pass the teacher layer's output on.

The teacher cost is one forward pass of the teacher's layers per training token whatever
the depth, and it runs beside the replacements on the student's device (the student rank
already holds the teacher for validation and closed-loop inputs).

Because every replacement's graph is freed by its own backward, the stage is not wrapped
in DDP (whose reducer expects one backward per forward): the ranks average the gradients
themselves once per optimizer step (:func:`distill.train.context.average_gradients`).

Shape legend: B batch, T tokens, D hidden size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from distill.model.teacher import Teacher
from distill.stages import Stage
from distill.train.closed_loop import InputSchedule
from distill.train.losses import layer_loss
from distill.train.validation import Validation

log = logging.getLogger(__name__)


@dataclass
class ChainStep:
    """One layer of the chain: its input (what the replacement is fed) and the teacher
    layer's output on that input (its target)."""

    layer: int
    input_BTD: torch.Tensor
    target_BTD: torch.Tensor


def run_chain(teacher: Teacher, trained: tuple[int, ...], embed_BTD: torch.Tensor,
              blocks: Mapping[str, nn.Module], pick_B: torch.Tensor | None,
              on_step: Callable[[ChainStep], torch.Tensor]) -> None:
    """Run layers 0..max(trained) from ``embed_BTD``; at each trained layer hand its input and
    target to ``on_step``, which returns the replacement's output. ``pick_B`` says per sample
    whether that output (True) or the teacher layer's (False) goes on; None: all teacher."""
    hidden_BTD = embed_BTD.float()
    pick_B11 = None if pick_B is None else pick_B.to(hidden_BTD.device)[:, None, None]
    for idx in range(max(trained) + 1):
        with torch.no_grad():
            out_BTD = teacher.run_layer(teacher.layers[idx], hidden_BTD.to(teacher.dtype), idx).float()
        if idx not in trained:
            hidden_BTD = out_BTD
            continue
        pred_BTD = on_step(ChainStep(idx, hidden_BTD, out_BTD)).detach().float()
        hidden_BTD = out_BTD if pick_B11 is None else torch.where(pick_B11, pred_BTD, out_BTD)


class JointTraining:
    """A joint stage's micro-batch: the chain, each replacement's loss and its backward.

    Which samples pass the replacement's output on follows an
    :class:`distill.train.closed_loop.InputSchedule`, as closed-loop inputs do.
    """

    def __init__(self, teacher: Teacher, stage: Stage, mode: str, loss: str, total_steps: int,
                 grad_accum_steps: int, start_step: int, seed: int) -> None:
        self.schedule = InputSchedule(mode, total_steps, grad_accum_steps, start_step, seed, stage.index)
        self.teacher = teacher
        self.layers = stage.layers
        self.loss = loss
        self.accum = grad_accum_steps

    def __call__(self, embed_BTD: torch.Tensor, blocks: Mapping[str, nn.Module]) -> dict[int, float]:
        """Train on one micro-batch (gradients accumulate, scaled by 1/accum); the per-layer losses."""
        fraction = self.schedule.next_fraction()
        pick_B = self.schedule.pick(embed_BTD.shape[0], fraction) if fraction > 0 else None
        losses: dict[int, float] = {}

        def on_step(step: ChainStep) -> torch.Tensor:
            pred_BTD = blocks[str(step.layer)](step.input_BTD)
            value = layer_loss(pred_BTD, step.target_BTD, self.loss)
            (value / self.accum).backward()
            losses[step.layer] = float(value.detach())
            return pred_BTD

        run_chain(self.teacher, self.layers, embed_BTD, blocks, pick_B, on_step)
        return losses


class JointValidation:
    """A joint stage's held-out validation, in one pass over the chunks instead of cached
    per-layer states (which would be 2 x layers x held-out tokens x hidden floats).

    Per layer, against the teacher's own output of that layer on the teacher's input:
    teacher-forced (the replacement fed the teacher's input) and on the student's own inputs
    (every replacement before it spliced in), the score a stage is judged by, as in
    :class:`distill.train.validation.LayerValidation`.
    """

    def __init__(self, teacher: Teacher, stage: Stage, heldout_NT: torch.Tensor, batch_size: int,
                 device: torch.device, loss: str) -> None:
        self.teacher = teacher
        self.layers = stage.layers
        self.loss = loss
        self.device = device
        self.chunks = list(heldout_NT.split(batch_size))

    @torch.no_grad()
    def __call__(self, blocks: Mapping[str, nn.Module]) -> Validation:
        forced = dict.fromkeys(self.layers, 0.0)
        own = dict.fromkeys(self.layers, 0.0)
        for chunk_BT in self.chunks:
            self._batch(chunk_BT, blocks, forced, own)
        count = max(1, len(self.chunks))
        forced = {layer: value / count for layer, value in forced.items()}
        own = {layer: value / count for layer, value in own.items()}
        return Validation(sum(own.values()) / len(own), {"val": forced, "val_student": own})

    def _batch(self, chunk_BT: torch.Tensor, blocks: Mapping[str, nn.Module], forced: dict[int, float],
               own: dict[int, float]) -> None:
        teacher = self.teacher
        teacher_BTD = student_BTD = teacher.embed(chunk_BT).float()
        for idx in range(max(self.layers) + 1):
            layer = teacher.layers[idx]
            target_BTD = teacher.run_layer(layer, teacher_BTD.to(teacher.dtype), idx).float()
            if idx in self.layers:
                block = blocks[str(idx)]
                forced[idx] += float(layer_loss(block(teacher_BTD), target_BTD, self.loss))
                student_BTD = block(student_BTD).float()
                own[idx] += float(layer_loss(student_BTD, target_BTD, self.loss))
            else:
                student_BTD = teacher.run_layer(layer, student_BTD.to(teacher.dtype), idx).float()
            teacher_BTD = target_BTD
