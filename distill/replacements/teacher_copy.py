"""TeacherCopy: the teacher layer itself, as a trainable replacement.

Not a compression: it is the pipeline's sanity check. Starting from the teacher's own
weights, its loss starts at ~0 and must stay there; if it does not, the targets, the
loss or the way layers are called is wrong, not the replacement.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from distill.replacements import TeacherHandle, copy_teacher_layer

if TYPE_CHECKING:
    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)


class TeacherCopy(nn.Module):
    """A deep copy of teacher layer ``layer_idx``, run exactly as the teacher runs it."""

    def __init__(self, teacher: Teacher, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer = copy_teacher_layer(teacher, layer_idx)
        self.teacher_handle = TeacherHandle(teacher)

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Run the copied layer through ``teacher.run_layer`` (rotary, causal mask)."""
        return self.teacher_handle.teacher.run_layer(self.layer, hidden_BTD)

    def flops_per_token(self, seq_len: int) -> int:
        """Same cost as the teacher layer, by construction."""
        return self.teacher_handle.teacher.layer_flops_per_token(seq_len)
