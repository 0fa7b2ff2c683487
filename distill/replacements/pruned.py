"""PrunedLayer: the teacher layer with a narrower MLP and/or fewer KV heads.

Built as a real HF layer of a smaller config (same class, ``intermediate_size`` and
``num_key_value_heads`` lowered), so it runs through ``teacher.run_layer`` like the
original and needs no forward of its own. Its weights are the teacher's most important
units: MLP units ranked by the product of the norms of their input and output weights,
KV heads merged group by group (mean-pooled, or the largest-norm head of each group).

Shape legend: D hidden size, I MLP units, K KV heads, G KV heads merged into one,
E head size.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig

from distill.model import family as families
from distill.replacements import (
    TeacherHandle,
    check_layer_idx,
    linear_flops_per_token,
    run_teacher_class_layer,
    teacher_layer_type,
    teacher_rotary,
)

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

KV_MERGES = ("mean", "norm")


@dataclass(frozen=True)
class _Layout:
    """Where a family's layer keeps what pruning touches (names relative to the layer)."""

    config_owner: str
    """Submodule holding the layer's config."""
    mlp_in: tuple[str, ...]
    """MLP input maps: one row per unit."""
    mlp_out: tuple[str, ...]
    """MLP output maps: one column per unit."""
    kv: tuple[str, ...] | None
    """Key and value projections; None where KV heads cannot be pruned."""


_LAYOUTS = {
    "llama": _Layout(
        config_owner="self_attn",
        mlp_in=("mlp.gate_proj", "mlp.up_proj"),
        mlp_out=("mlp.down_proj",),
        kv=("self_attn.k_proj", "self_attn.v_proj"),
    ),
    "bert": _Layout(
        config_owner="attention.self",
        mlp_in=("intermediate.dense",),
        mlp_out=("output.dense",),
        kv=None,
    ),
}


class PrunedLayer(nn.Module):
    """Teacher layer ``layer_idx`` rebuilt smaller and initialised from its best units.

    Options (at least one of the three sizes):
        mlp_keep_fraction: fraction of MLP units to keep, in (0, 1].
        intermediate_size: number of MLP units to keep (instead of the fraction).
        num_key_value_heads: KV heads to keep (llama family); must divide the teacher's.
        kv_merge: "mean" averages each group of merged KV heads, "norm" keeps the group's
            head with the largest key and value weight norms.
    """

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        mlp_keep_fraction: float | None = None,
        intermediate_size: int | None = None,
        num_key_value_heads: int | None = None,
        kv_merge: str = "mean",
    ) -> None:
        super().__init__()
        check_layer_idx(teacher, layer_idx)
        families.check_kind(teacher.adapter, "pruned", {"num_key_value_heads": num_key_value_heads})
        teacher_layer = teacher.layers[layer_idx]
        layout = _layout_for(teacher.family, teacher_layer)
        config = copy.deepcopy(teacher_layer.get_submodule(layout.config_owner).config)
        num_units = _num_units(config.intermediate_size, mlp_keep_fraction, intermediate_size)
        num_kv = _num_kv_heads(config, layout, num_key_value_heads, kv_merge)
        if num_units is None and num_kv is None:
            raise ValueError(
                "PrunedLayer has nothing to prune; set replacement.mlp_keep_fraction, "
                "replacement.intermediate_size or replacement.num_key_value_heads."
            )
        state = _pruned_state(teacher_layer, layout, config, num_units, num_kv, kv_merge)
        self.config_overrides: dict[str, int] = {}
        if num_units is not None:
            config.intermediate_size = self.config_overrides["intermediate_size"] = num_units
        if num_kv is not None:
            config.num_key_value_heads = self.config_overrides["num_key_value_heads"] = num_kv
        self.layer_idx = layer_idx
        self.layer = _build_layer(type(teacher_layer), config, layer_idx, state)
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
        """Run the smaller HF layer with the teacher's masks and positions (its own KV cache)."""
        return run_teacher_class_layer(self.family, self.layer, self.rotary_emb, self.layer_type,
                                       hidden_BTD, attention_mask, position_ids, cache)

    def layer_spec(self) -> dict[str, Any]:
        """The teacher's layer class, built from its config with the pruned sizes."""
        return {"kind": "pruned", "config_overrides": dict(self.config_overrides)}

    def flops_per_token(self, seq_len: int) -> int:
        """Teacher layer cost minus what the narrower linear maps save.

        Fewer KV heads shrink only the K/V projections: every query head still attends
        over all positions, so attention-score FLOPs stay the teacher's.
        """
        teacher_layer = self.teacher_handle.teacher.layers[self.layer_idx]
        saved = linear_flops_per_token(teacher_layer) - linear_flops_per_token(self.layer)
        return self.teacher_handle.teacher.layer_flops_per_token(seq_len) - saved


def _layout_for(family: str, layer: nn.Module) -> _Layout:
    """The family's layout, checked against the layer, or a ValueError saying what fits."""
    layout = _LAYOUTS.get(family)
    if layout is None:
        raise ValueError(
            f"replacement=pruned supports teacher families {sorted(_LAYOUTS)}, not {family!r}; "
            "use replacement=lowrank or replacement=mlp for this teacher."
        )
    names = (layout.config_owner, *layout.mlp_in, *layout.mlp_out, *(layout.kv or ()))
    missing = [name for name in names if not _has_submodule(layer, name)]
    if missing:
        raise ValueError(
            f"replacement=pruned cannot prune {type(layer).__name__}: it has no {missing} "
            "(e.g. a fused MLP). Use replacement=lowrank or replacement=mlp for this teacher."
        )
    return layout


def _has_submodule(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def _num_units(teacher_units: int, keep_fraction: float | None, size: int | None) -> int | None:
    """MLP units to keep, or None to keep the MLP as it is."""
    if keep_fraction is not None and size is not None:
        raise ValueError(
            f"Can't provide both replacement.mlp_keep_fraction={keep_fraction} and "
            f"replacement.intermediate_size={size}. Choose one: set the other to null."
        )
    if keep_fraction is not None:
        if not 0 < keep_fraction <= 1:
            raise ValueError(
                f"replacement.mlp_keep_fraction={keep_fraction} must be in (0, 1]; e.g. 0.5 "
                "keeps half of the MLP units."
            )
        return max(1, round(keep_fraction * teacher_units))
    if size is not None and not 1 <= size <= teacher_units:
        raise ValueError(
            f"replacement.intermediate_size={size} must be in 1..{teacher_units} (the "
            "teacher's intermediate_size); pruning cannot add units."
        )
    return size


def _num_kv_heads(
    config: PretrainedConfig, layout: _Layout, num_kv: int | None, kv_merge: str
) -> int | None:
    """KV heads to keep, or None to keep the attention as it is."""
    if kv_merge not in KV_MERGES:
        raise ValueError(f"replacement.kv_merge={kv_merge!r} must be one of {KV_MERGES}.")
    if num_kv is None:
        return None
    if layout.kv is None:
        raise ValueError(
            "replacement.num_key_value_heads only applies to llama-family teachers (GQA); "
            "set it to null for this teacher."
        )
    teacher_kv = config.num_key_value_heads
    if num_kv < 1 or teacher_kv % num_kv:
        choices = [n for n in range(1, teacher_kv + 1) if teacher_kv % n == 0]
        raise ValueError(
            f"replacement.num_key_value_heads={num_kv} must divide the teacher's "
            f"{teacher_kv} KV heads (whole groups are merged); choose one of {choices}."
        )
    return num_kv


def _pruned_state(
    teacher_layer: nn.Module,
    layout: _Layout,
    config: PretrainedConfig,
    num_units: int | None,
    num_kv: int | None,
    kv_merge: str,
) -> dict[str, torch.Tensor]:
    """The teacher layer's state dict, cloned, with MLP units and KV heads pruned."""
    state = {k: v.detach().clone() for k, v in teacher_layer.state_dict().items()}
    if num_units is not None:
        _prune_mlp(state, layout, num_units)
    if num_kv is not None:
        _merge_kv_heads(state, layout, config, num_kv, kv_merge)
    return state


def _mlp_unit_scores_I(state: dict[str, torch.Tensor], layout: _Layout) -> torch.Tensor:
    """Importance of each MLP unit: product of its input-row and output-column norms."""
    scores_I = None
    for name in layout.mlp_in:
        norms_I = state[f"{name}.weight"].float().norm(dim=1)
        scores_I = norms_I if scores_I is None else scores_I * norms_I
    for name in layout.mlp_out:
        scores_I = scores_I * state[f"{name}.weight"].float().norm(dim=0)
    return scores_I


def _prune_mlp(state: dict[str, torch.Tensor], layout: _Layout, num_units: int) -> None:
    """Keep the ``num_units`` highest-scoring MLP units, in their original order."""
    keep = _mlp_unit_scores_I(state, layout).topk(num_units).indices.sort().values
    for name in layout.mlp_in:
        state[f"{name}.weight"] = state[f"{name}.weight"][keep]
        if f"{name}.bias" in state:
            state[f"{name}.bias"] = state[f"{name}.bias"][keep]
    for name in layout.mlp_out:
        state[f"{name}.weight"] = state[f"{name}.weight"][:, keep]


def _merge_kv_heads(
    state: dict[str, torch.Tensor],
    layout: _Layout,
    config: PretrainedConfig,
    num_kv: int,
    kv_merge: str,
) -> None:
    """Merge consecutive KV heads in groups, matching how GQA assigns query heads.

    Query head h reads KV head h // (heads / K); merging consecutive KV heads therefore
    keeps every query head reading the merged version of the head it read before.
    """
    teacher_kv = config.num_key_value_heads
    group = teacher_kv // num_kv
    keys = [f"{name}.{kind}" for name in layout.kv for kind in ("weight", "bias")]
    grouped = {k: state[k].unflatten(0, (num_kv, group, -1)) for k in keys if k in state}
    if kv_merge == "mean":
        merged = {k: t.mean(dim=1) for k, t in grouped.items()}
    else:
        norms_KG = None
        for name in layout.kv:
            head_norms_KG = grouped[f"{name}.weight"].float().flatten(2).norm(dim=2)
            norms_KG = head_norms_KG if norms_KG is None else norms_KG * head_norms_KG
        best_K = norms_KG.argmax(dim=1)
        merged = {k: t[torch.arange(num_kv), best_K] for k, t in grouped.items()}
    state.update({k: t.flatten(0, 1).contiguous() for k, t in merged.items()})


def _build_layer(
    layer_cls: type[nn.Module],
    config: PretrainedConfig,
    layer_idx: int,
    state: dict[str, torch.Tensor],
) -> nn.Module:
    """Instantiate the smaller HF layer without allocating weights, then adopt ``state``."""
    with torch.device("meta"):
        layer = layer_cls(config, layer_idx=layer_idx)
    layer.load_state_dict(state, strict=True, assign=True)
    leftover = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    assert not leftover, f"pruned layer kept uninitialised tensors: {leftover}"
    return layer.requires_grad_(True)
