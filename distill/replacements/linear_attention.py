"""LinearAttentionLayer: the teacher layer with softmax attention swapped for linear attention.

Softmax attention costs O(T) per token; linear attention ``phi(q) . sum_s phi(k_s) v_s``
costs O(1) per token once ``phi`` maps queries and keys to positive features. ``phi`` is
learnable (Hedgehog, Zhang et al. 2024: a per-head linear map followed by a softmax over
the feature dimension, of both ``+xW`` and ``-xW``; or ``elu(xW) + 1``) so that training can
pull it towards the teacher's softmax attention. Everything else (q/k/v/o projections,
rotary for the llama family, norms, MLP) is copied from the teacher layer, so only the
attention kernel starts from scratch.

Decoders use a causal kernel computed chunk by chunk: exact masked attention inside a
chunk plus a running (prefix-summed) state from earlier chunks, which keeps memory at
O(T * C + T / C * F * E) instead of the O(T * F * E) of a per-token cumsum. All kernel
math runs in float32; features are positive, so the normaliser never cancels.

Shape legend: B batch, T sequence length, D hidden size, H attention heads, K KV heads,
E head size, F features per head, N chunks, C chunk length.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from distill.replacements import copy_teacher_layer, linear_flops_per_token

if TYPE_CHECKING:
    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

FEATURE_MAPS = ("hedgehog", "elu")
DENOMINATOR_EPS = 1e-6

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


class FeatureMap(nn.Module):
    """Per-head learnable map from a head vector to positive features.

    ``hedgehog``: ``[softmax(xW + b), softmax(-(xW + b))]`` (2 * feature_dim features).
    ``elu``: ``elu(xW + b) + 1`` (feature_dim features). ``W`` starts as the identity (padded
    or cut when feature_dim != head size), so the first features follow the raw q/k.
    """

    def __init__(
        self, num_heads: int, head_dim: int, feature_dim: int, kind: str, **factory: object
    ) -> None:
        super().__init__()
        eye_EF = torch.eye(head_dim, feature_dim, **factory)
        self.weight_HEF = nn.Parameter(eye_EF.expand(num_heads, -1, -1).clone())
        self.bias_HF = nn.Parameter(torch.zeros(num_heads, feature_dim, **factory))
        self.kind = kind

    @property
    def num_features(self) -> int:
        """Features per head this map produces."""
        width = self.weight_HEF.shape[-1]
        return 2 * width if self.kind == "hedgehog" else width

    def forward(self, x_BHTE: torch.Tensor) -> torch.Tensor:
        """Map head vectors to float32 positive features."""
        proj_BHTF = torch.einsum("bhte,hef->bhtf", x_BHTE.float(), self.weight_HEF.float())
        proj_BHTF = proj_BHTF + self.bias_HF.float()[:, None, :]
        if self.kind == "elu":
            return F.elu(proj_BHTF) + 1
        return torch.cat([proj_BHTF.softmax(dim=-1), (-proj_BHTF).softmax(dim=-1)], dim=-1)

    def flops_per_token(self) -> int:
        """The per-head projection; the nonlinearity is elementwise and not counted."""
        num_heads, head_dim, feature_dim = self.weight_HEF.shape
        return 2 * num_heads * head_dim * feature_dim


def causal_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """``out_t = sum_{s<=t} (phi_q_t . phi_k_s) v_s / sum_{s<=t} (phi_q_t . phi_k_s)``.

    Chunked: masked quadratic attention inside each chunk of ``chunk_size`` positions, plus
    the exclusive prefix sum of the earlier chunks' states. Padding positions have zero
    features, so they add nothing to any state.
    """
    seq_len = phi_q_BHTF.shape[2]
    chunk = min(chunk_size, seq_len)
    pad = -seq_len % chunk
    q_BHNCF, k_BHNCF, v_BHNCE = (
        F.pad(x.float(), (0, 0, 0, pad)).unflatten(2, (-1, chunk))
        for x in (phi_q_BHTF, phi_k_BHTF, v_BHTE)
    )
    mask_CC = torch.ones(chunk, chunk, dtype=torch.bool, device=q_BHNCF.device).tril()
    scores_BHNCC = (q_BHNCF @ k_BHNCF.transpose(-1, -2)).masked_fill(~mask_CC, 0.0)
    state_BHNFE = _exclusive_cumsum(k_BHNCF.transpose(-1, -2) @ v_BHNCE)
    keysum_BHNF = _exclusive_cumsum(k_BHNCF.sum(dim=-2))
    num_BHNCE = scores_BHNCC @ v_BHNCE + q_BHNCF @ state_BHNFE
    den_BHNC = scores_BHNCC.sum(dim=-1) + (q_BHNCF @ keysum_BHNF.unsqueeze(-1)).squeeze(-1)
    out_BHNCE = num_BHNCE / (den_BHNC.unsqueeze(-1) + DENOMINATOR_EPS)
    return out_BHNCE.flatten(2, 3)[:, :, :seq_len]


def bidirectional_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor
) -> torch.Tensor:
    """``out_t = sum_s (phi_q_t . phi_k_s) v_s / sum_s (phi_q_t . phi_k_s)`` over all s."""
    q_BHTF, k_BHTF, v_BHTE = phi_q_BHTF.float(), phi_k_BHTF.float(), v_BHTE.float()
    state_BHFE = k_BHTF.transpose(-1, -2) @ v_BHTE
    den_BHT1 = q_BHTF @ k_BHTF.sum(dim=-2).unsqueeze(-1)
    return (q_BHTF @ state_BHFE) / (den_BHT1 + DENOMINATOR_EPS)


def _exclusive_cumsum(per_chunk: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, ...)``: for each chunk, the sum over the chunks strictly before it."""
    total = per_chunk.cumsum(dim=2)
    return torch.cat([torch.zeros_like(total[:, :, :1]), total[:, :, :-1]], dim=2)


class LinearAttention(nn.Module):
    """Learnable feature maps for q and k plus the causal or bidirectional kernel."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_map: str,
        feature_dim: int,
        causal: bool,
        chunk_size: int,
        **factory: object,
    ) -> None:
        super().__init__()
        self.q_features = FeatureMap(num_heads, head_dim, feature_dim, feature_map, **factory)
        self.k_features = FeatureMap(num_heads, head_dim, feature_dim, feature_map, **factory)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.causal = causal
        self.chunk_size = chunk_size

    def forward(
        self, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor
    ) -> torch.Tensor:
        """Attend with the learned features; returns float32 ``out_BHTE``."""
        phi_q_BHTF, phi_k_BHTF = self.q_features(q_BHTE), self.k_features(k_BHTE)
        if self.causal:
            return causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, self.chunk_size)
        return bidirectional_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE)

    def flops_per_token(self, seq_len: int) -> int:
        """Feature maps plus kernel multiply-adds per token, over all heads.

        Per head: the state update and the readout are F * E each, the normaliser F each;
        the causal kernel adds the full C x C in-chunk scores and values (C * (F + E)).
        """
        features, head_dim = self.q_features.num_features, self.head_dim
        macs = 2 * features * head_dim + 2 * features
        if self.causal:
            macs += min(self.chunk_size, seq_len) * (features + head_dim)
        maps = self.q_features.flops_per_token() + self.k_features.flops_per_token()
        return maps + 2 * self.num_heads * macs


def _apply_rotary(
    x_BHTE: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor
) -> torch.Tensor:
    """Rotary position embedding as Llama/Qwen2/Mistral apply it (rotate-half layout)."""
    half = x_BHTE.shape[-1] // 2
    rotated_BHTE = torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], dim=-1)
    return x_BHTE * cos_BTE.unsqueeze(1) + rotated_BHTE * sin_BTE.unsqueeze(1)


def _split_heads(x_BTD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``(B, T, heads * E) -> (B, heads, T, E)``."""
    return x_BTD.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def _merge_heads(x_BHTE: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, T, E) -> (B, T, H * E)`` in the model's dtype."""
    return x_BHTE.transpose(1, 2).flatten(2).to(dtype)


class _DecoderBlock(nn.Module):
    """Llama-family pre-norm layer with linear attention; modules copied from the teacher."""

    def __init__(self, teacher: Teacher, layer: nn.Module, **options: object) -> None:
        super().__init__()
        attn = layer.self_attn
        self.input_layernorm = layer.input_layernorm
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj = attn.o_proj
        # Per-head RMSNorm on q and k before rotary (Qwen3); absent in Llama/Qwen2/Mistral.
        self.q_norm = getattr(attn, "q_norm", nn.Identity())
        self.k_norm = getattr(attn, "k_norm", nn.Identity())
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.rotary_emb = copy.deepcopy(_rotary_embedding(teacher))
        self.head_dim = attn.head_dim
        self.num_kv_groups = attn.num_key_value_groups
        num_heads = attn.q_proj.out_features // attn.head_dim
        factory = {"device": teacher.device, "dtype": teacher.dtype}
        self.attention = LinearAttention(
            num_heads, attn.head_dim, causal=teacher.causal, **options, **factory
        )

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Pre-norm attention residual, then pre-norm MLP residual, as in the teacher."""
        normed_BTD = self.input_layernorm(hidden_BTD)
        q_BHTE = self.q_norm(_split_heads(self.q_proj(normed_BTD), self.head_dim))
        k_BKTE = self.k_norm(_split_heads(self.k_proj(normed_BTD), self.head_dim))
        v_BKTE = _split_heads(self.v_proj(normed_BTD), self.head_dim)
        positions_BT = torch.arange(hidden_BTD.shape[1], device=hidden_BTD.device)[None]
        cos_BTE, sin_BTE = self.rotary_emb(hidden_BTD, positions_BT)
        q_BHTE = _apply_rotary(q_BHTE, cos_BTE, sin_BTE)
        k_BHTE = _apply_rotary(k_BKTE, cos_BTE, sin_BTE).repeat_interleave(self.num_kv_groups, 1)
        v_BHTE = v_BKTE.repeat_interleave(self.num_kv_groups, 1)
        attended_BTD = _merge_heads(self.attention(q_BHTE, k_BHTE, v_BHTE), hidden_BTD.dtype)
        hidden_BTD = hidden_BTD + self.o_proj(attended_BTD)
        return hidden_BTD + self.mlp(self.post_attention_layernorm(hidden_BTD))


class _EncoderBlock(nn.Module):
    """BertLayer structure with linear attention; modules copied from the teacher.

    Post-norm as in BERT: ``LayerNorm(x + dense(attn))`` then
    ``LayerNorm(a + out(act(intermediate(a))))``, reusing the teacher's ``BertSelfOutput``,
    ``BertIntermediate`` and ``BertOutput`` modules as they are.
    """

    def __init__(self, teacher: Teacher, layer: nn.Module, **options: object) -> None:
        super().__init__()
        self_attn = layer.attention.self
        self.query, self.key, self.value = self_attn.query, self_attn.key, self_attn.value
        self.attention_output = layer.attention.output
        self.intermediate = layer.intermediate
        self.output = layer.output
        self.head_dim = self_attn.attention_head_size
        factory = {"device": teacher.device, "dtype": teacher.dtype}
        self.attention = LinearAttention(
            self_attn.num_attention_heads,
            self.head_dim,
            causal=teacher.causal,
            **options,
            **factory,
        )

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Attention with residual LayerNorm, then the feed-forward with residual LayerNorm."""
        q_BHTE = _split_heads(self.query(hidden_BTD), self.head_dim)
        k_BHTE = _split_heads(self.key(hidden_BTD), self.head_dim)
        v_BHTE = _split_heads(self.value(hidden_BTD), self.head_dim)
        attended_BTD = _merge_heads(self.attention(q_BHTE, k_BHTE, v_BHTE), hidden_BTD.dtype)
        attn_BTD = self.attention_output(attended_BTD, hidden_BTD)
        return self.output(self.intermediate(attn_BTD), attn_BTD)


_BLOCKS: dict[str, type[nn.Module]] = {"llama": _DecoderBlock, "bert": _EncoderBlock}


class LinearAttentionLayer(nn.Module):
    """Teacher layer ``layer_idx`` with linear attention (causal for decoders).

    Options:
        feature_map: "hedgehog" (softmax of +/- a learned projection) or "elu"
            (elu + 1 of a learned projection).
        feature_dim: width of the learned projection per head; the head size when null.
            Hedgehog doubles it (+ and - halves).
        chunk_size: positions per chunk of the causal kernel; trades the C x C in-chunk
            work against the number of per-chunk states kept for the backward.
    """

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        feature_map: str = "hedgehog",
        feature_dim: int | None = None,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        _check_options(teacher.family, feature_map, feature_dim, chunk_size)
        layer = copy_teacher_layer(teacher, layer_idx)
        _check_structure(teacher.family, layer)
        head_dim = _head_dim(teacher.family, layer)
        self.layer_idx = layer_idx
        self.block = _BLOCKS[teacher.family](
            teacher,
            layer,
            feature_map=feature_map,
            feature_dim=feature_dim or head_dim,
            chunk_size=chunk_size,
        )

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Run the block; same shape and dtype out."""
        return self.block(hidden_BTD)

    def flops_per_token(self, seq_len: int) -> int:
        """Linear maps (projections, MLP) plus the linear-attention kernel."""
        return linear_flops_per_token(self.block) + self.block.attention.flops_per_token(seq_len)


def _check_options(family: str, feature_map: str, feature_dim: int | None, chunk_size: int) -> None:
    """Reject options (or a teacher) this replacement cannot serve, naming the key."""
    if family not in _BLOCKS:
        raise ValueError(
            f"replacement=linear_attention supports teacher families {sorted(_BLOCKS)}, not "
            f"{family!r}; use replacement=lowrank or replacement=mlp for this teacher."
        )
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"replacement.feature_map={feature_map!r} must be one of {FEATURE_MAPS}.")
    if feature_dim is not None and feature_dim < 1:
        raise ValueError(
            f"replacement.feature_dim={feature_dim} must be >= 1, or null for the head size."
        )
    if chunk_size < 1:
        raise ValueError(f"replacement.chunk_size={chunk_size} must be >= 1; 64 is a good default.")


def _check_structure(family: str, layer: nn.Module) -> None:
    """Refuse a teacher layer with parts the rebuilt block would silently leave out."""
    for owner, known in _KNOWN_CHILDREN[family].items():
        module = layer.get_submodule(owner)
        unknown = sorted({name for name, _ in module.named_children()} - known)
        if unknown:
            raise ValueError(
                f"replacement=linear_attention cannot rebuild {type(layer).__name__}: "
                f"{owner or 'the layer'} has parts it does not know ({unknown}). Use "
                "replacement=lowrank, replacement=pruned or replacement=copy for this teacher."
            )


def _head_dim(family: str, layer: nn.Module) -> int:
    """Head size of the teacher layer's attention."""
    if family == "bert":
        return layer.attention.self.attention_head_size
    return layer.self_attn.head_dim


def _rotary_embedding(teacher: Teacher) -> nn.Module:
    """The teacher model's rotary embedding module (llama family keeps one per model)."""
    rotary = getattr(teacher.model.base_model, "rotary_emb", None)
    if rotary is None:
        raise ValueError(
            f"replacement=linear_attention found no rotary_emb on the {teacher.family!r} teacher "
            f"{type(teacher.model).__name__}; only Llama/Qwen2/Mistral-style decoders and BERT "
            "encoders are supported."
        )
    return rotary
