"""Held-out validation of a stage, and the best weights it has seen.

A layer stage is validated two ways on the fixed held-out chunks, both against the
teacher's own output of each layer:

- *teacher-forced*: the replacement fed the teacher's input of its layer (what a
  teacher-forced stage trains on);
- *student inputs*: the replacement fed what the student itself makes of the
  embeddings: the trained replacements of the earlier stages (teacher layers where no
  layer is replaced), then this stage's own replacements. That is the input the layer
  sees once every replacement is spliced in, so this is the score that says how the
  assembled student will do, and the one a stage is judged by (:attr:`Validation.score`):
  patience and the best weights follow it.

The student-built input of the stage's first layer depends only on earlier, frozen
stages, so it is computed once when the stage is set up; each validation runs only
the stage's own layers (and teacher layers between them).

:class:`BestWeights` keeps a copy of the trainable weights at the best validation so
far, so that a stage that stops early, or whose last validation is worse than an
earlier one, ends with its best weights rather than its last. The leader validates and
decides; every rank keeps and restores its own copy (a sharded, FSDP2, student: its shard).

Shape legend: B batch, T tokens, D hidden size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distill.model.teacher import Teacher
from distill.stages import Stage
from distill.train.closed_loop import run_student_layers
from distill.train.losses import layer_loss

log = logging.getLogger(__name__)


@dataclass
class Validation:
    """One validation of a stage; ``score`` is lower-is-better, None on ranks that do not validate."""

    score: float | None = None
    record: dict[str, Any] = field(default_factory=dict)
    """What the stage's events keep of it (per-layer losses, or the end-to-end metric)."""


@dataclass
class _Batch:
    teacher_inputs: dict[int, torch.Tensor]
    targets: dict[int, torch.Tensor]
    student_start: torch.Tensor
    """The student-built input of the stage's first layer."""


class LayerValidation:
    """The held-out inputs and targets of one layer stage, and the two per-layer losses on them."""

    def __init__(self, teacher: Teacher, stage: Stage, heldout_NT: torch.Tensor,
                 frozen: Mapping[int, nn.Module], batch_size: int, device: torch.device, loss: str) -> None:
        self.teacher = teacher
        self.layers = stage.layers
        self.loss = loss
        self.device = device
        self.batches = [self._batch(chunk_BT, frozen) for chunk_BT in heldout_NT.split(batch_size)]

    def _batch(self, chunk_BT: torch.Tensor, frozen: Mapping[int, nn.Module]) -> _Batch:
        captured = self.teacher.capture(chunk_BT, list(self.layers))
        first = self.layers[0]
        start_BTD = run_student_layers(self.teacher, self.teacher.embed(chunk_BT), (first,), frozen)[first]
        return _Batch({layer: x.float() for layer, (x, _) in captured.items()},
                      {layer: y.float() for layer, (_, y) in captured.items()}, start_BTD.float())

    @torch.no_grad()
    def __call__(self, blocks: Mapping[str, nn.Module]) -> Validation:
        """Mean per-layer losses, teacher-forced and on the student's inputs; scored by the latter."""
        forced = dict.fromkeys(self.layers, 0.0)
        own = dict.fromkeys(self.layers, 0.0)
        for batch in self.batches:
            for layer in self.layers:
                pred_BTD = blocks[str(layer)](batch.teacher_inputs[layer].to(self.device))
                forced[layer] += float(layer_loss(pred_BTD, batch.targets[layer].to(self.device), self.loss))
            for layer, pred_BTD in self._student_outputs(batch, blocks).items():
                own[layer] += float(layer_loss(pred_BTD, batch.targets[layer].to(self.device), self.loss))
        count = max(1, len(self.batches))
        forced = {layer: value / count for layer, value in forced.items()}
        own = {layer: value / count for layer, value in own.items()}
        return Validation(sum(own.values()) / len(own), {"val": forced, "val_student": own})

    def _student_outputs(self, batch: _Batch, blocks: Mapping[str, nn.Module]) -> dict[int, torch.Tensor]:
        """{layer: its replacement's output on the student's own input} for the stage's layers."""
        hidden_BTD = batch.student_start.to(self.device)
        out: dict[int, torch.Tensor] = {}
        for idx in range(self.layers[0], self.layers[-1] + 1):
            if idx in self.layers:
                hidden_BTD = out[idx] = blocks[str(idx)](hidden_BTD).float()
            else:
                layer = self.teacher.layers[idx]
                hidden_BTD = self.teacher.run_layer(layer, hidden_BTD.to(self.teacher.dtype)).float()
        return out


class BestWeights:
    """The trainable weights of a module at its best (lowest-score) validation so far."""

    def __init__(self) -> None:
        self.score = math.inf
        self.step: int | None = None
        self.record: dict[str, Any] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def improves(self, validation: Validation) -> bool:
        """Whether ``validation`` is the best yet (only the leader's has a score)."""
        return validation.score is not None and validation.score < self.score

    def keep(self, module: nn.Module, validation: Validation, step: int) -> None:
        """Copy ``module``'s trainable weights as the best, at ``step`` (on every rank)."""
        self.score = validation.score if validation.score is not None else self.score
        self.step, self.record = step, validation.record
        self.tensors = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}

    def update(self, module: nn.Module, validation: Validation, step: int) -> None:
        """Keep a copy of ``module``'s trainable weights if ``validation`` is the best yet."""
        if self.improves(validation):
            self.keep(module, validation, step)

    def restore(self, module: nn.Module) -> None:
        """Put the kept weights back into ``module``."""
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, value in self.tensors.items():
                params[name].copy_(value)

    def meta(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the tensors (JSON)."""
        return {"score": self.score, "step": self.step, "record": self.record}

    def load(self, meta: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`meta` and the tensors recorded (after a resume); nothing when no
        tensors were saved (a sharded student's best weights are not checkpointed)."""
        if not meta or meta.get("step") is None or not tensors:
            return
        self.score, self.step, self.record = float(meta["score"]), int(meta["step"]), dict(meta["record"])
        self.tensors = tensors


def by_str(values: dict[int, float]) -> dict[str, float]:
    """JSON keys for per-layer values."""
    return {str(k): v for k, v in values.items()}


def json_record(record: dict) -> dict:
    """A validation record with JSON keys (per-layer dicts keyed by str)."""
    return {key: by_str(value) if isinstance(value, dict) else value for key, value in record.items()}
