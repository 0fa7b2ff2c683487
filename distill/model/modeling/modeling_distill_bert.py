"""modeling_distill_bert: an encoder student distilled from a BERT-family teacher.

This file is copied verbatim into every exported encoder student and named in its
``config.json``'s ``auto_map``: it imports torch and transformers only, so
``AutoModel.from_pretrained(dir, trust_remote_code=True)`` runs the student without the
tool that made it. The distillation tool trains its replacements with these same classes
and kernels. Parts marked "Copied from modeling_distill_llama" are kept identical to that
file by a test (transformers' single-model-file policy: copy, never import, across models).

The model is the teacher's encoder (embeddings, pooler and the layers that were not
replaced, each of the teacher's own transformers class) with some layers replaced, one
class per kind of ``config.distill_layers[i]["kind"]``:

    copy, pruned, lowrank   DistillBertTeacherLayer: the teacher's layer class, with a smaller
                            config (pruned) or factorised linear maps (lowrank)
    mlp                     DistillBertResidualMLP: ``x + W2 act(W1 norm(x))``, token-wise
    linear_attention        DistillBertLinearAttentionLayer: the teacher layer with softmax
                            attention swapped for (bidirectional) linear attention

Every replaced layer takes ``(hidden_states, attention_mask, position_ids, cache)`` like the
decoder's; ``attention_mask`` is the 2D padding mask (1 = token, 0 = padding) and padded
positions add nothing to any state or normaliser. Encoders keep no cache.

Shape legend: B batch, T positions, D hidden size, H attention heads, E head size,
F features per head, X = E + 1 (values plus the normaliser column), N chunks, C chunk length.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from .configuration_distill_bert import DistillBertConfig

DENOMINATOR_EPS = 1e-6
FEATURE_MAPS = ("hedgehog", "elu")


def new_token_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    # Copied from modeling_distill_llama.new_token_mask
    """The padding mask of the T new positions as float ``mask_BT``, or None when nothing is padded.

    ``attention_mask`` is the 2D mask over past + new positions (or over the new ones only).
    """
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(
            "replaced layers need the 2D padding mask (batch, positions) that tokenizers return, "
            f"not a {attention_mask.ndim}D mask; pass attention_mask=tokens.attention_mask."
        )
    mask_BT = attention_mask[:, -seq_len:]
    return None if bool(mask_BT.all()) else mask_BT.float()


# ---------------------------------------------------------------------- kernels


def causal_linear_attention(
    phi_q_BHTF: torch.Tensor,
    phi_k_BHTF: torch.Tensor,
    v_BHTE: torch.Tensor,
    chunk_size: int,
    state_BHFX: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Copied from modeling_distill_llama.causal_linear_attention
    """Chunked form: ``out_t = sum_{s<=t} (phi_q_t . phi_k_s) v_s / sum_{s<=t} phi_q_t . phi_k_s``.

    Masked quadratic attention inside each chunk of ``chunk_size`` positions, plus the state
    of everything before the chunk: ``state_BHFX`` (the positions before this call, or none)
    and the exclusive prefix sum of the earlier chunks. Values carry a column of ones, so the
    normaliser travels in the same matmuls. Returns float32 ``out_BHTE`` and the state after
    the last position. Padding positions must have zero ``phi_k``: they then add nothing.
    """
    seq_len = phi_q_BHTF.shape[2]
    v1_BHTX = F.pad(v_BHTE.float(), (0, 1), value=1.0)
    chunk = min(chunk_size, seq_len)
    pad = -seq_len % chunk
    q_BHNCF, k_BHNCF, v1_BHNCX = (
        F.pad(x.float(), (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (phi_q_BHTF, phi_k_BHTF, v1_BHTX)
    )
    mask_CC = torch.ones(chunk, chunk, dtype=torch.bool, device=q_BHNCF.device).tril()
    scores_BHNCC = (q_BHNCF @ k_BHNCF.transpose(-1, -2)).masked_fill(~mask_CC, 0.0)
    kv_BHNFX = k_BHNCF.transpose(-1, -2) @ v1_BHNCX
    total_BHNFX = kv_BHNFX.cumsum(dim=2)  # shifted, not subtracted: no rounding leak from the future
    prefix_BHNFX = torch.cat([torch.zeros_like(total_BHNFX[:, :, :1]), total_BHNFX[:, :, :-1]], dim=2)
    if state_BHFX is not None:
        prefix_BHNFX = prefix_BHNFX + state_BHFX.float().unsqueeze(2)
    numden_BHNCX = scores_BHNCC @ v1_BHNCX + q_BHNCF @ prefix_BHNFX
    out_BHNCE = numden_BHNCX[..., :-1] / (numden_BHNCX[..., -1:] + DENOMINATOR_EPS)
    final_BHFX = total_BHNFX[:, :, -1] if state_BHFX is None else total_BHNFX[:, :, -1] + state_BHFX.float()
    return out_BHNCE.flatten(2, 3)[:, :, :seq_len], final_BHFX


def bidirectional_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor
) -> torch.Tensor:
    # Copied from modeling_distill_llama.bidirectional_linear_attention
    """``out_t = sum_s (phi_q_t . phi_k_s) v_s / sum_s phi_q_t . phi_k_s`` over all s (no state kept)."""
    q_BHTF, k_BHTF = phi_q_BHTF.float(), phi_k_BHTF.float()
    state_BHFX = k_BHTF.transpose(-1, -2) @ F.pad(v_BHTE.float(), (0, 1), value=1.0)
    numden_BHTX = q_BHTF @ state_BHFX
    return numden_BHTX[..., :-1] / (numden_BHTX[..., -1:] + DENOMINATOR_EPS)


# ---------------------------------------------------------------------- linear attention


class FeatureMap(nn.Module):
    # Copied from modeling_distill_llama.FeatureMap
    """Per-head learnable map from a head vector to positive features.

    ``hedgehog``: ``[softmax(xW + b), softmax(-(xW + b))]`` (2 * feature_dim features).
    ``elu``: ``elu(xW + b) + 1`` (feature_dim features). ``W`` starts as the identity (padded
    or cut when feature_dim != head size), so the first features follow the raw q/k.
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int, kind: str, **factory: Any) -> None:
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


class LinearAttention(nn.Module):
    """Learnable feature maps for q and k plus the kernel (bidirectional, or causal and chunked)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_map: str,
        feature_dim: int,
        causal: bool,
        chunk_size: int,
        **factory: Any,
    ) -> None:
        super().__init__()
        self.q_features = FeatureMap(num_heads, head_dim, feature_dim, feature_map, **factory)
        self.k_features = FeatureMap(num_heads, head_dim, feature_dim, feature_map, **factory)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.causal = causal
        self.chunk_size = chunk_size

    def forward(
        self, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor, mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 ``out_BHTE``; ``mask_BT`` zeroes the keys' features of padded positions."""
        phi_q_BHTF, phi_k_BHTF = self.q_features(q_BHTE), self.k_features(k_BHTE)
        if mask_BT is not None:
            phi_k_BHTF = phi_k_BHTF * mask_BT[:, None, :, None]
        if self.causal:
            return causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, self.chunk_size)[0]
        return bidirectional_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE)

    def flops_per_token(self, seq_len: int) -> int:
        # Copied from modeling_distill_llama.LinearAttention.flops_per_token
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


def split_heads(x_BTD: torch.Tensor, head_dim: int) -> torch.Tensor:
    # Copied from modeling_distill_llama.split_heads
    """``(B, T, heads * E) -> (B, heads, T, E)``."""
    return x_BTD.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def merge_heads(x_BHTE: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Copied from modeling_distill_llama.merge_heads
    """``(B, H, T, E) -> (B, T, H * E)`` in the model's dtype."""
    return x_BHTE.transpose(1, 2).flatten(2).to(dtype)


class LinearAttentionBlock(nn.Module):
    """BertLayer structure with linear attention; the other modules are a teacher layer's.

    Post-norm as in BERT: ``LayerNorm(x + dense(attn))`` then
    ``LayerNorm(a + out(act(intermediate(a))))``, reusing ``BertSelfOutput``,
    ``BertIntermediate`` and ``BertOutput`` of ``layer`` (or of a fresh teacher-class layer).
    """

    def __init__(self, config: DistillBertConfig, layer_idx: int, layer: nn.Module | None = None) -> None:
        super().__init__()
        spec = config.distill_layers[str(layer_idx)]
        layer = layer if layer is not None else teacher_class(config, "layer")(config, layer_idx=layer_idx)
        self_attn = layer.attention.self
        self.query, self.key, self.value = self_attn.query, self_attn.key, self_attn.value
        self.attention_output = layer.attention.output
        self.intermediate = layer.intermediate
        self.output = layer.output
        self.head_dim = self_attn.attention_head_size
        weight = self_attn.query.weight
        self.attention = LinearAttention(
            self_attn.num_attention_heads,
            self.head_dim,
            feature_map=spec["feature_map"],
            feature_dim=int(spec["feature_dim"]),
            causal=bool(getattr(config, "is_decoder", False)),
            chunk_size=int(spec["chunk_size"]),
            device=weight.device,
            dtype=weight.dtype,
        )

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """Attention with residual LayerNorm, then the feed-forward with residual LayerNorm."""
        q_BHTE = split_heads(self.query(hidden_BTD), self.head_dim)
        k_BHTE = split_heads(self.key(hidden_BTD), self.head_dim)
        v_BHTE = split_heads(self.value(hidden_BTD), self.head_dim)
        mask_BT = new_token_mask(attention_mask, hidden_BTD.shape[1])
        attended_BTD = merge_heads(self.attention(q_BHTE, k_BHTE, v_BHTE, mask_BT), hidden_BTD.dtype)
        attn_BTD = self.attention_output(attended_BTD, hidden_BTD)
        return self.output(self.intermediate(attn_BTD), attn_BTD)


# ---------------------------------------------------------------------- replaced layers


class LowRankLinear(nn.Module):
    # Copied from modeling_distill_llama.LowRankLinear
    """``x -> up(down(x))``: an ``O x I`` map stored as ``O x R`` and ``R x I`` factors."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool, **factory: Any) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False, **factory)
        self.up = nn.Linear(rank, out_features, bias=bias, **factory)
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank

    def forward(self, x_BTI: torch.Tensor) -> torch.Tensor:
        """Apply the factorised map."""
        return self.up(self.down(x_BTI))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def factorise(layer: nn.Module, ranks: dict[str, int]) -> None:
    # Copied from modeling_distill_llama.factorise
    """Swap each named ``nn.Linear`` of ``layer`` for an (uninitialised) LowRankLinear of its rank."""
    for name, rank in ranks.items():
        linear = layer.get_submodule(name)
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        low_rank = LowRankLinear(linear.in_features, linear.out_features, int(rank), linear.bias is not None, **factory)
        layer.set_submodule(name, low_rank)


def layer_config(config: DistillBertConfig, overrides: dict[str, Any]) -> DistillBertConfig:
    # Copied from modeling_distill_llama.layer_config
    """``config`` with one layer's overrides (a pruned layer's sizes); itself when there are none."""
    if not overrides:
        return config
    out = copy.copy(config)
    for key, value in overrides.items():
        setattr(out, key, value)
    return out


def run_teacher_layer(
    layer: nn.Module, hidden_BTD: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Call a layer of the teacher's class with the mask the teacher's encoder would build.

    Bidirectional from the 2D padding mask, or causal for a BERT configured as a decoder.
    """
    config = layer.attention.self.config
    mask_fn = create_causal_mask if getattr(config, "is_decoder", False) else create_bidirectional_mask
    mask = mask_fn(config=config, inputs_embeds=hidden_BTD, attention_mask=attention_mask, cache=None)
    output = layer(hidden_BTD, attention_mask=mask)
    return output[0] if isinstance(output, tuple) else output


class DistillBertTeacherLayer(nn.Module):
    """Kinds copy, pruned and lowrank: a layer of the teacher's class, run as the teacher runs it."""

    def __init__(self, config: DistillBertConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.distill_layers[str(layer_idx)]
        own_config = layer_config(config, spec.get("config_overrides") or {})
        self.layer = teacher_class(config, "layer")(own_config, layer_idx=layer_idx)
        factorise(self.layer, spec.get("ranks") or {})

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        return run_teacher_layer(self.layer, hidden_BTD, attention_mask)


class DistillBertResidualMLP(nn.Module):
    """Kind mlp: ``x + W2 act(W1 norm(x))``, token by token."""

    def __init__(self, config: DistillBertConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.distill_layers[str(layer_idx)]
        hidden, units, eps = config.hidden_size, int(spec["hidden_units"]), float(spec["norm_eps"])
        self.norm = nn.RMSNorm(hidden, eps=eps) if spec["norm"] == "rms" else nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, units)
        self.act = ACT2FN[spec["activation"]]
        self.down = nn.Linear(units, hidden)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        return hidden_BTD + self.down(self.act(self.up(self.norm(hidden_BTD))))


class DistillBertLinearAttentionLayer(nn.Module):
    """Kind linear_attention: a :class:`LinearAttentionBlock`."""

    def __init__(self, config: DistillBertConfig, layer_idx: int) -> None:
        super().__init__()
        self.block = LinearAttentionBlock(config, layer_idx)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        return self.block(hidden_BTD, attention_mask, position_ids, cache)


REPLACED_LAYERS: dict[str, type[nn.Module]] = {
    "copy": DistillBertTeacherLayer,
    "pruned": DistillBertTeacherLayer,
    "lowrank": DistillBertTeacherLayer,
    "mlp": DistillBertResidualMLP,
    "linear_attention": DistillBertLinearAttentionLayer,
}
"""``config.distill_layers[i]["kind"]`` -> the class of layer i."""


def teacher_class(config: DistillBertConfig, role: str) -> type[nn.Module]:
    # Copied from modeling_distill_llama.teacher_class
    """The teacher's class for ``role`` ("layer", "norm", "rotary"), from transformers.models only."""
    path = config.teacher_classes[role]
    module_name, _, class_name = path.rpartition(".")
    if not module_name.startswith("transformers.models."):
        raise ValueError(f"teacher_classes[{role!r}]={path!r} is not a transformers class")
    return getattr(importlib.import_module(module_name), class_name)


# ---------------------------------------------------------------------- the model


class DistillBertPreTrainedModel(PreTrainedModel):
    config_class = DistillBertConfig
    config: DistillBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DistillBertTeacherLayer", "DistillBertResidualMLP", "DistillBertLinearAttentionLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        """The defaults, plus the feature maps' identity start and BERT's position-id buffers."""
        super()._init_weights(module)
        if isinstance(module, FeatureMap):
            num_heads, head_dim, feature_dim = module.weight_HEF.shape
            eye_HEF = torch.eye(head_dim, feature_dim).expand(num_heads, -1, -1)
            init.copy_(module.weight_HEF, eye_HEF.to(module.weight_HEF.dtype))
            init.zeros_(module.bias_HF)
        elif hasattr(module, "position_ids") and hasattr(module, "token_type_ids"):  # the embeddings
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)


class DistillBertEncoder(nn.Module):
    """The layer stack, named as in BertEncoder so that weights keep the teacher's names."""

    def __init__(self, config: DistillBertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([_build_layer(config, idx) for idx in range(config.num_hidden_layers)])


class DistillBertModel(DistillBertPreTrainedModel):
    """The encoder: teacher embeddings, layers (teacher's or replaced), the teacher's pooler."""

    def __init__(self, config: DistillBertConfig) -> None:
        super().__init__(config)
        self.embeddings = teacher_class(config, "embeddings")(config)
        self.encoder = DistillBertEncoder(config)
        self.pooler = teacher_class(config, "pooler")(config) if "pooler" in config.teacher_classes else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions | tuple:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        hidden_BTD = self.embeddings(
            input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids, inputs_embeds=inputs_embeds
        )
        mask_fn = create_causal_mask if getattr(self.config, "is_decoder", False) else create_bidirectional_mask
        teacher_mask = mask_fn(config=self.config, inputs_embeds=hidden_BTD, attention_mask=attention_mask, cache=None)
        all_hidden = []
        for idx, layer in enumerate(self.encoder.layer):
            if output_hidden_states:
                all_hidden.append(hidden_BTD)
            if str(idx) in self.config.distill_layers:
                hidden_BTD = layer(hidden_BTD, attention_mask, position_ids)
            else:
                hidden_BTD = layer(hidden_BTD, attention_mask=teacher_mask)
                hidden_BTD = hidden_BTD[0] if isinstance(hidden_BTD, tuple) else hidden_BTD
        if output_hidden_states:
            all_hidden.append(hidden_BTD)
        out = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden_BTD,
            pooler_output=self.pooler(hidden_BTD) if self.pooler is not None else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
        )
        return out if return_dict is not False else out.to_tuple()


def _build_layer(config: DistillBertConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``: the class of its kind where replaced, else the teacher's own."""
    spec = config.distill_layers.get(str(layer_idx))
    if spec is None:
        return teacher_class(config, "layer")(config, layer_idx=layer_idx)
    return REPLACED_LAYERS[spec["kind"]](config, layer_idx)


DistillBertConfig.register_for_auto_class()
DistillBertModel.register_for_auto_class("AutoModel")

__all__ = ["DistillBertModel", "DistillBertPreTrainedModel"]
