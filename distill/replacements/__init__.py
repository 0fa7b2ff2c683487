"""Replacements: cheaper modules trained to stand in for one teacher layer.

Every replacement is an ``nn.Module`` built as ``Cls(teacher, layer_idx, **options)`` so
that Hydra can instantiate a config with ``_partial_: true`` and the student finishes the
call with ``instantiate(cfg.replacement)(teacher=teacher, layer_idx=l)``. Each one maps
``hidden_BTD -> hidden_BTD`` (same shape, same dtype) and reports ``flops_per_token``.

The options, one module each:

- ``teacher_copy.TeacherCopy``: the teacher layer itself (sanity check, reaches ~0 loss).
- ``mlp.ResidualMLP``: a token-wise residual MLP, no token mixing at all.
- ``linear_attention.LinearAttentionLayer``: the teacher layer with softmax attention
  swapped for linear attention with a learnable (Hedgehog) feature map.
- ``pruned.PrunedLayer``: the teacher layer with a narrower MLP and/or fewer KV heads.
- ``lowrank.LowRankLayer``: the teacher layer with truncated-SVD factorised linear maps.

This module owns what they share: the protocol, taking a private copy of a teacher
layer, and the parameter/FLOP accounting behind :func:`describe`. It imports none of the
replacement modules, so they can import it without a cycle.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

__all__ = [
    "Replacement",
    "TeacherHandle",
    "check_layer_idx",
    "copy_teacher_layer",
    "count_params",
    "describe",
    "linear_flops_per_token",
]


@runtime_checkable
class Replacement(Protocol):
    """What the student relies on; the replacement classes satisfy it structurally."""

    layer_idx: int

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Map the layer input to the layer output, same shape and dtype."""
        ...

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token at ``seq_len`` (2 per multiply-add)."""
        ...


def check_layer_idx(teacher: Teacher, layer_idx: int) -> None:
    """Reject an index the teacher has no layer for, before anything is copied."""
    if not 0 <= layer_idx < teacher.num_layers:
        raise ValueError(
            f"layer_idx={layer_idx} is out of range for a teacher with {teacher.num_layers} "
            f"layers; pass an index in 0..{teacher.num_layers - 1}."
        )


def copy_teacher_layer(teacher: Teacher, layer_idx: int) -> nn.Module:
    """Return a trainable deep copy of teacher layer ``layer_idx``.

    A copy, never the layer itself: training a replacement must leave the frozen teacher
    untouched because the teacher keeps producing targets for every other layer.
    """
    check_layer_idx(teacher, layer_idx)
    layer = copy.deepcopy(teacher.layers[layer_idx])
    layer.requires_grad_(True)
    return layer


class TeacherHandle:
    """The frozen teacher, held by a replacement outside its module tree.

    Not an ``nn.Module`` attribute: the teacher's weights must never join a replacement's
    ``parameters()``, optimizer or ``state_dict``. Deep copies of a replacement (snapshots,
    EMA) share the handle instead of duplicating the whole teacher model.
    """

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher

    def __deepcopy__(self, memo: dict) -> TeacherHandle:
        return self


def count_params(module: nn.Module) -> int:
    """Number of scalar parameters in ``module``."""
    return sum(p.numel() for p in module.parameters())


def linear_flops_per_token(module: nn.Module) -> int:
    """FLOPs per token of every ``nn.Linear`` inside ``module`` (2 per multiply-add).

    Biases, norms and activations are left out, as in the usual 2 * params estimate.
    """
    return sum(
        2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear)
    )


def describe(module: nn.Module, teacher: Teacher, seq_len: int) -> dict[str, Any]:
    """Size and cost of a replacement next to the teacher layer it replaces.

    Ratios below 1 mean the replacement is smaller/cheaper; the student logs this so a
    run's savings are on record next to its loss.
    """
    layer_idx = module.layer_idx
    params = count_params(module)
    teacher_params = count_params(teacher.layers[layer_idx])
    flops = int(module.flops_per_token(seq_len))
    teacher_flops = int(teacher.layer_flops_per_token(seq_len))
    return {
        "params": params,
        "teacher_params": teacher_params,
        "params_ratio": params / teacher_params,
        "flops_per_token": flops,
        "teacher_flops_per_token": teacher_flops,
        "flops_ratio": flops / teacher_flops,
    }
