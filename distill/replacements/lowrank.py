"""LowRankLayer: the teacher layer with its linear maps factorised by truncated SVD.

Each ``nn.Linear`` (attention projections and MLP) inside a deep copy of the teacher layer
becomes a :class:`LowRankLinear` ``up @ down`` initialised from the weight's truncated SVD,
the best rank-r approximation of it, so training starts from the closest low-rank layer.
The layer's own forward is kept, so rotary, masks and norms behave exactly as before.

Shape legend: B batch, T sequence length, D hidden size, I input features, O output
features, R rank.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distill.model import family as families
from distill.model.modeling.modeling_distill_llama import LowRankLinear as _LowRankLinear
from distill.replacements import (
    TeacherHandle,
    copy_teacher_layer,
    linear_flops_per_token,
    run_teacher_class_layer,
    teacher_layer_type,
    teacher_rotary,
)

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

DEFAULT_RANK_FRACTION = 0.25


class LowRankLinear(_LowRankLinear):
    """``x -> up(down(x))``: an ``O x I`` map stored as ``O x R`` and ``R x I`` factors.

    The exported student's class (both factors plain ``nn.Linear`` modules, so generic
    accounting sees them like any other linear map), plus its initialisation from a dense map.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int) -> LowRankLinear:
        """Factorise ``linear`` at ``rank`` from its SVD, splitting sqrt(S) over both sides.

        Splitting the singular values evenly keeps both factors on the same scale, which
        keeps their gradients balanced at the start of training.
        """
        weight_OI = linear.weight.detach().float()
        u_OR, s_R, vh_RI = torch.linalg.svd(weight_OI, full_matrices=False)
        sqrt_s_R = s_R[:rank].sqrt()
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        low_rank = cls(linear.in_features, linear.out_features, rank, linear.bias is not None, **factory)
        with torch.no_grad():
            low_rank.down.weight.copy_(sqrt_s_R[:, None] * vh_RI[:rank])
            low_rank.up.weight.copy_(u_OR[:, :rank] * sqrt_s_R[None, :])
            if linear.bias is not None:
                low_rank.up.bias.copy_(linear.bias)
        return low_rank


class LowRankLayer(nn.Module):
    """Teacher layer ``layer_idx`` with its linear maps replaced by rank-r factorisations.

    Options (give ``rank`` or ``rank_fraction``, not both):
        rank: the same rank for every factorised map; at most ``min(I, O)`` of each.
        rank_fraction: rank per map as a fraction of its ``min(I, O)``, in (0, 1];
            0.25 when neither is given.
        modules: glob patterns of linear-map names inside the layer to factorise (e.g.
            ``["mlp.*"]`` or ``["self_attn.*_proj"]``); all of them when null.
    """

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        rank: int | None = None,
        rank_fraction: float | None = None,
        modules: list[str] | None = None,
    ) -> None:
        super().__init__()
        families.check_kind(teacher.adapter, "lowrank")
        rank_fraction = _check_rank_options(rank, rank_fraction)
        self.layer_idx = layer_idx
        self.layer = copy_teacher_layer(teacher, layer_idx)
        targets = _select_linears(self.layer, modules)
        ranks = {name: _rank_for(name, lin, rank, rank_fraction) for name, lin in targets.items()}
        for name, linear in targets.items():
            self.layer.set_submodule(name, LowRankLinear.from_linear(linear, ranks[name]))
        self.layer.requires_grad_(True)
        self.ranks = ranks
        rotary = teacher_rotary(teacher)
        self.rotary_emb = copy.deepcopy(rotary) if rotary is not None else None
        self.layer_type = teacher_layer_type(teacher, layer_idx)
        self.family = teacher.family
        self.teacher_handle = TeacherHandle(teacher)
        log.debug("layer %d low-rank maps: %s", layer_idx, ranks)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Run the factorised layer with the teacher's masks and positions (its own KV cache)."""
        return run_teacher_class_layer(self.family, self.layer, self.rotary_emb, self.layer_type,
                                       hidden_BTD, attention_mask, position_ids, cache)

    def layer_spec(self) -> dict[str, Any]:
        """The teacher's layer class with the named linear maps factorised at these ranks."""
        return {"kind": "lowrank", "ranks": dict(self.ranks)}

    def flops_per_token(self, seq_len: int) -> int:
        """Teacher layer cost minus what the factorisation saves on its linear maps.

        Attention scores and values cost the same as before (heads and head size are
        unchanged), so only the difference on linear maps is applied to the teacher's own
        count; that keeps the ratio consistent with the teacher's accounting.
        """
        teacher_layer = self.teacher_handle.teacher.layers[self.layer_idx]
        saved = linear_flops_per_token(teacher_layer) - linear_flops_per_token(self.layer)
        return self.teacher_handle.teacher.layer_flops_per_token(seq_len) - saved


def _check_rank_options(rank: int | None, rank_fraction: float | None) -> float | None:
    """Validate the choose-one rank options; return the fraction to use (None: ``rank``)."""
    if rank is not None and rank_fraction is not None:
        raise ValueError(
            f"Can't provide both replacement.rank={rank} and "
            f"replacement.rank_fraction={rank_fraction}. Choose one: set the other to null."
        )
    if rank is not None:
        if rank < 1:
            raise ValueError(f"replacement.rank={rank} must be >= 1.")
        return None
    if rank_fraction is None:
        return DEFAULT_RANK_FRACTION
    if not 0 < rank_fraction <= 1:
        raise ValueError(
            f"replacement.rank_fraction={rank_fraction} must be in (0, 1]; e.g. 0.25 keeps a "
            "quarter of each map's singular values."
        )
    return rank_fraction


def _select_linears(layer: nn.Module, patterns: list[str] | None) -> dict[str, nn.Linear]:
    """Linear maps of ``layer`` to factorise, by qualified name."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    if patterns is None:
        return linears
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
            raise ValueError(
                f"replacement.modules pattern {pattern!r} matches no linear map of the "
                f"teacher layer; the maps are {sorted(linears)}."
            )
    return {n: m for n, m in linears.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}


def _rank_for(name: str, linear: nn.Linear, rank: int | None, fraction: float | None) -> int:
    """Rank for one map; a fixed ``rank`` must fit every map it is applied to."""
    full_rank = min(linear.in_features, linear.out_features)
    if rank is not None and rank > full_rank:
        raise ValueError(
            f"replacement.rank={rank} exceeds min(in, out)={full_rank} of {name} "
            f"({linear.out_features}x{linear.in_features}); lower replacement.rank to "
            f"<= {full_rank}, restrict replacement.modules, or use replacement.rank_fraction."
        )
    if rank is None:
        assert fraction is not None
        rank = max(1, round(fraction * full_rank))
    if (
        rank * (linear.in_features + linear.out_features)
        >= linear.in_features * linear.out_features
    ):
        log.warning(
            "rank %d on %s (%dx%d) stores more parameters than the dense map; lower "
            "replacement.rank or replacement.rank_fraction to save anything.",
            rank,
            name,
            linear.out_features,
            linear.in_features,
        )
    return rank
