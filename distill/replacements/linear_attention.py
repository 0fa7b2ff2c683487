"""LinearAttentionLayer: the teacher layer with softmax attention swapped for linear attention.

:class:`AttentionSwapLayer` is the part it shares with the other kinds that swap the
teacher's attention (``sliding_window_linear``, ``gated_linear_attention``).

Softmax attention costs O(T) per token; linear attention ``phi(q) . sum_s phi(k_s) v_s``
costs O(1) per token once ``phi`` maps queries and keys to positive features. ``phi`` is
learnable (Hedgehog, Zhang et al. 2024: a per-head linear map followed by a softmax over
the feature dimension, of both ``+xW`` and ``-xW``; or ``elu(xW) + 1``) so that training can
pull it towards the teacher's softmax attention. Everything else (q/k/v/o projections,
rotary for the llama family, norms, MLP) is copied from the teacher layer, so only the
attention kernel starts from scratch.

The block and its kernels are those of the exported student's modeling code
(``distill.model.modeling.modeling_distill_{llama,bert}``: ``LinearAttentionBlock``,
``causal_linear_attention``, ``linear_attention_step``): decoders train the chunked form
(exact masked attention inside a chunk plus a running state from earlier chunks, O(T * C +
T / C * F * E) memory) and decode with the recurrent one, one state per layer in the
model's cache. All kernel math runs in float32; features are positive, so the normaliser
never cancels.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distill.model import family as families
from distill.model.modeling import modeling_distill_bert, modeling_distill_llama
from distill.model.native import student_config
from distill.replacements import copy_teacher_layer, linear_flops_per_token, teacher_rotary

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

FEATURE_MAPS = modeling_distill_llama.FEATURE_MAPS

# Children each rebuilt block knows how to use, per family and owner ("" is the layer).
# Anything else (Gemma's extra norms, relative position tables, ...) would be silently
# dropped, so such layers are refused instead.
_KNOWN_CHILDREN: dict[str, dict[str, set[str]]] = {
    "llama": {
        "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
        "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"},
    },
    "bert": {
        "": {"attention", "intermediate", "output"},
        "attention": {"self", "output"},
        "attention.self": {"query", "key", "value", "dropout"},
    },
}

_BLOCKS: dict[str, dict[str, type[nn.Module]]] = {
    "llama": modeling_distill_llama.LINEAR_BLOCKS,
    "bert": modeling_distill_bert.LINEAR_BLOCKS,
}
"""Family -> kind -> the exported student's block class."""


class AttentionSwapLayer(nn.Module):
    """A teacher layer rebuilt as the student's block of kind ``kind``: its attention swapped, all else copied.

    The shared part of the linear-attention kinds (linear, sliding-window + linear, gated
    linear): check the options and the teacher layer, copy it, build the block of the
    exported student's modeling code around the copy. Subclasses name the kind and their options.
    """

    kind = "linear_attention"

    def __init__(self, teacher: Teacher, layer_idx: int, feature_map: str | None, feature_dim: int | None,
                 chunk_size: int, options: dict[str, Any]) -> None:
        """``feature_map`` None: a kind without feature maps (``gated_delta_rule``)."""
        super().__init__()
        families.check_kind(teacher.adapter, self.kind)
        _check_options(self.kind, teacher.family, feature_map, feature_dim, chunk_size)
        layer = copy_teacher_layer(teacher, layer_idx)
        _check_structure(self.kind, teacher.family, layer)
        self.layer_idx = layer_idx
        features = {} if feature_map is None else {
            "feature_map": feature_map, "feature_dim": feature_dim or _head_dim(teacher.family, layer)}
        self.spec = {"kind": self.kind, **features, "chunk_size": chunk_size, **options}
        config = student_config(teacher, {layer_idx: self.spec}, for_export=False)
        block_cls = _BLOCKS[teacher.family][self.kind]
        if teacher.family == "bert":
            self.block = block_cls(config, layer_idx, layer=layer)
        else:
            self.block = block_cls(config, layer_idx, layer, copy.deepcopy(teacher_rotary(teacher)))

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Run the block (chunked, or one recurrent step per new token with a cache)."""
        return self.block(hidden_BTD, attention_mask, position_ids, cache)

    def layer_spec(self) -> dict[str, Any]:
        """This layer's entry in the exported student's ``config.distill_layers``."""
        return dict(self.spec)

    def flops_per_token(self, seq_len: int) -> int:
        """Linear maps (projections, MLP, a gate) plus the attention kernel."""
        return linear_flops_per_token(self.block) + self.block.attention.flops_per_token(seq_len)


class LinearAttentionLayer(AttentionSwapLayer):
    """Teacher layer ``layer_idx`` with linear attention (causal for decoders).

    Options:
        feature_map: "hedgehog" (softmax of +/- a learned projection) or "elu"
            (elu + 1 of a learned projection).
        feature_dim: width of the learned projection per head; the head size when null.
            Hedgehog doubles it (+ and - halves).
        chunk_size: positions per chunk of the causal kernel; trades the C x C in-chunk
            work against the number of per-chunk states kept for the backward.
    """

    kind = "linear_attention"

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        feature_map: str = "hedgehog",
        feature_dim: int | None = None,
        chunk_size: int = 64,
    ) -> None:
        super().__init__(teacher, layer_idx, feature_map, feature_dim, chunk_size, {})


def _check_options(kind: str, family: str, feature_map: str | None, feature_dim: int | None, chunk_size: int) -> None:
    """Reject options (or a teacher) this replacement cannot serve, naming the key."""
    if family not in _BLOCKS:
        raise ValueError(
            f"replacement={kind} supports teacher families {sorted(_BLOCKS)}, not "
            f"{family!r}; use replacement=lowrank or replacement=mlp for this teacher."
        )
    if feature_map is not None and feature_map not in FEATURE_MAPS:
        raise ValueError(f"replacement.feature_map={feature_map!r} must be one of {FEATURE_MAPS}.")
    if feature_dim is not None and feature_dim < 1:
        raise ValueError(
            f"replacement.feature_dim={feature_dim} must be >= 1, or null for the head size."
        )
    if chunk_size < 1:
        raise ValueError(f"replacement.chunk_size={chunk_size} must be >= 1; 64 is a good default.")


def _check_structure(kind: str, family: str, layer: nn.Module) -> None:
    """Refuse a teacher layer with parts the rebuilt block would silently leave out."""
    for owner, known in _KNOWN_CHILDREN[family].items():
        module = layer.get_submodule(owner)
        unknown = sorted({name for name, _ in module.named_children()} - known)
        if unknown:
            raise ValueError(
                f"replacement={kind} cannot rebuild {type(layer).__name__}: "
                f"{owner or 'the layer'} has parts it does not know ({unknown}). Use "
                "replacement=lowrank, replacement=pruned or replacement=copy for this teacher."
            )


def _head_dim(family: str, layer: nn.Module) -> int:
    """Head size of the teacher layer's attention."""
    if family == "bert":
        return layer.attention.self.attention_head_size
    return layer.self_attn.head_dim
