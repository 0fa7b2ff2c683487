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
- ``sliding_window_linear.SlidingWindowLinearLayer``: exact softmax attention over the last
  ``window`` positions plus linear attention over older ones, one normaliser (LoLCATs).
- ``gated_linear_attention.GatedLinearAttentionLayer``: linear attention whose state decays by
  a per-head gate computed from the layer input.
- ``gated_delta_rule.GatedDeltaRuleLayer``: the gated delta rule, a key -> value state each
  position corrects (decoders).
- ``pruned.PrunedLayer``: the teacher layer with a narrower MLP and/or fewer KV heads.
- ``lowrank.LowRankLayer``: the teacher layer with truncated-SVD factorised linear maps.

The interface (:class:`Replacement`), what a replacement kind must provide so that it
trains here and ships in the exported student:

``forward(hidden_BTD, attention_mask=None, position_ids=None, cache=None) -> hidden_BTD``
    ``attention_mask`` is the 2D padding mask over past + new positions (1 = token,
    0 = padding; right padding for encoders, left padding for batched generation), as the
    user gives it to the model; padded positions must contribute nothing to any state or
    normaliser (zero them before they enter it). ``position_ids`` (B, T) are the new
    positions' (the model's, so left padding keeps positions from 0); None means
    ``past .. past + T - 1``. ``cache`` is the model's transformers ``Cache`` or None.
    Training calls ``replacement(hidden_BTD)``: unpadded chunks at positions 0..T-1, no cache.
``layer_spec() -> dict``
    The layer's entry in the student's ``config.distill_layers``: ``{"kind": ..., options}``
    with every size the modeling code needs to rebuild the layer from the config alone
    (its state dict keys are the replacement's own).
``flops_per_token(seq_len) -> int``.

The forward math lives in the exported student's modeling code
(``distill.model.modeling.modeling_distill_{llama,bert}``), which a replacement builds on, so
the trained module is the shipped one. A sequence-mixing kind has two forms over one set of
weights: a chunked form (training and prefill, from an optional initial state) and a
recurrent form (decoding, one step per token), held equal by a test. Its decode state lives
in the cache, never in the module: each layer has one cache layer, chosen by the kind in
``config.layer_types`` and built by ``DynamicCache(config=model.config)``:

- the teacher's own attention (copy, pruned, lowrank): transformers' ``DynamicLayer`` /
  ``DynamicSlidingWindowLayer`` (Mistral's window), filled by the layer's attention;
- no KV cache (mlp, linear attention): transformers' own ``LinearAttentionLayer`` (type
  ``linear_attention``), plus the count of positions it has absorbed (rotary positions need
  it). Read the state with ``modeling_distill_llama.recurrent_state(cache, l)`` (None before
  the first call), keep it with ``store_state(cache, l, state, T)``; a state-less kind stores
  ``None`` so the count still moves. Linear attention's state is ``sum_s phi(k_s) [v_s, 1]^T``
  per head (last column: the normaliser), fixed in size.

Sliding-window + linear attention: cache type ``hybrid_sliding`` (transformers'
``LinearAttentionAndSlidingWindowAttentionLayer``: a KV ring from
``DynamicSlidingWindowLayer.update``, sized by ``config.sliding_window``, plus the linear
state); each call reads the ring's last ``window - 1`` positions before ``update``, and the
linear state takes every key as it leaves the window (the chunked kernel's initial-state
argument carries it). Gated linear attention: type ``linear_attention`` with a state
``sum_s (prod_{r>s} g_r) phi(k_s) [v_s, 1]^T`` whose decay ``g_t`` is computed from the layer
input; the chunked form carries the decay inside and across chunks, the recurrent one
multiplies the state by ``g_t`` before each update.

This module owns what replacements share: the protocol, taking a private copy of a teacher
layer, running a layer of the teacher's class with masks and cache, and the parameter/FLOP
accounting behind :func:`describe`. It imports none of the replacement modules, so they can
import it without a cycle.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from distill.model.modeling import modeling_distill_bert, modeling_distill_llama

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

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
    "run_teacher_class_layer",
    "teacher_layer_type",
    "teacher_rotary",
]


@runtime_checkable
class Replacement(Protocol):
    """What the student relies on; the replacement classes satisfy it structurally."""

    layer_idx: int

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Map the layer input to the layer output, same shape and dtype."""
        ...

    def layer_spec(self) -> dict[str, Any]:
        """This layer's entry in the exported student's ``config.distill_layers``."""
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


def teacher_rotary(teacher: Teacher) -> nn.Module | None:
    """The teacher model's rotary embedding module (decoders keep one per model), or None (BERT)."""
    if teacher.family == "bert" or not teacher.adapter.rotary:
        return None
    rotary = getattr(teacher.model.base_model, "rotary_emb", None)
    if rotary is None:
        raise ValueError(
            f"found no rotary_emb on the {teacher.family!r} teacher {type(teacher.model).__name__}; only "
            "Llama/Qwen2/Mistral-style decoders and BERT encoders are supported."
        )
    return rotary


def teacher_layer_type(teacher: Teacher, layer_idx: int) -> str:
    """The attention type of teacher layer ``layer_idx`` ("full_attention", "sliding_attention")."""
    if teacher.family == "bert":
        return "full_attention"
    return get_layer_types_and_kwargs(teacher.model.config)[0][layer_idx]


def run_teacher_class_layer(
    family: str,
    layer: nn.Module,
    rotary_emb: nn.Module | None,
    layer_type: str,
    hidden_BTD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
) -> torch.Tensor:
    """Run a layer of the teacher's class (a copy, pruned or factorised) as the exported student does."""
    if family == "bert":
        return modeling_distill_bert.run_teacher_layer(layer, hidden_BTD, attention_mask)
    return modeling_distill_llama.run_teacher_layer(
        layer, rotary_emb, layer_type, hidden_BTD, attention_mask, position_ids, cache
    )


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
