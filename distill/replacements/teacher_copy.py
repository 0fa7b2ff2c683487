"""TeacherCopy: the teacher layer itself, as a trainable replacement.

Not a compression: it is the pipeline's sanity check. Starting from the teacher's own
weights, its loss starts at ~0 and must stay there; if it does not, the targets, the
loss or the way layers are called is wrong, not the replacement.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distill.replacements import (
    TeacherHandle,
    copy_teacher_layer,
    run_teacher_class_layer,
    teacher_layer_type,
    teacher_rotary,
)

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)


class TeacherCopy(nn.Module):
    """A deep copy of teacher layer ``layer_idx``, run exactly as the teacher runs it (its own
    rotary embedding and mask; keys and values go to the cache's KV layer)."""

    def __init__(self, teacher: Teacher, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer = copy_teacher_layer(teacher, layer_idx)
        rotary = teacher_rotary(teacher)
        self.rotary_emb = copy.deepcopy(rotary) if rotary is not None else None
        self.layer_type = teacher_layer_type(teacher, layer_idx)
        self.family = teacher.family
        self.teacher_handle = TeacherHandle(teacher)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Run the copied layer with the teacher's masks and positions."""
        return run_teacher_class_layer(self.family, self.layer, self.rotary_emb, self.layer_type,
                                       hidden_BTD, attention_mask, position_ids, cache)

    def layer_spec(self) -> dict[str, Any]:
        """The teacher's layer class as it is."""
        return {"kind": "copy"}

    def flops_per_token(self, seq_len: int) -> int:
        """Same cost as the teacher layer, by construction."""
        return self.teacher_handle.teacher.layer_flops_per_token(seq_len)
