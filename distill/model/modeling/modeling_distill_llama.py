"""modeling_distill_llama: a decoder student distilled from a Llama, Qwen2, Mistral or Qwen3 teacher.

This file is copied verbatim into every exported decoder student and named in its
``config.json``'s ``auto_map``: it imports torch and transformers only, so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` runs the student
without the tool that made it. The distillation tool trains its replacements with these
same classes and kernels, so what was trained is what runs here.

The model is the teacher's decoder (its embeddings, final norm, rotary embedding, LM head and
the layers that were not replaced, each of the teacher's own transformers class) with some
layers replaced, one class per kind of ``config.distill_layers[i]["kind"]``:

    copy, pruned, lowrank   DistillLlamaTeacherLayer: the teacher's layer class, with a smaller
                            config (pruned) or factorised linear maps (lowrank); KV cache
    mlp                     DistillLlamaResidualMLP: ``x + W2 act(W1 norm(x))``, token-wise
    linear_attention        DistillLlamaLinearAttentionLayer: the teacher layer with softmax
                            attention swapped for linear attention ``phi(q) . S``
    sliding_window_linear   the same, with exact softmax attention over the last ``window``
                            positions and linear attention over older ones (one normaliser)
    gated_linear_attention  the same, with linear attention whose state decays by a gate
                            computed from the layer input
    gated_delta_rule        the same, with the gated delta rule: a key -> value state that each
                            position corrects by a fraction of what it held under that key

Every replaced layer takes ``(hidden_states, attention_mask, position_ids, cache)``, where
``attention_mask`` is the 2D padding mask over past + new positions (1 = token, 0 = padding),
as the user gives it to the model; padded positions add nothing to any state or normaliser.

Decode state lives in the model's ``Cache`` (transformers' ``DynamicCache(config=...)``, built
from ``config.layer_types``), one cache layer per model layer: the teacher's ``DynamicLayer`` /
``DynamicSlidingWindowLayer`` KV cache where the teacher's attention runs, and
transformers' own ``LinearAttentionLayer`` (type ``linear_attention``) where it does not, with
the count of positions it has absorbed (``SEEN_TOKENS``), which rotary positions need. Linear
attention keeps ``S = sum_s phi(k_s) [v_s, 1]^T`` per head there (the last column is the
normaliser), gated linear attention the same sum with each term decayed by the gates since;
token-wise layers keep only the count. Sliding-window + linear attention uses transformers'
``LinearAttentionAndSlidingWindowAttentionLayer`` (type ``hybrid_sliding``): a KV ring of
``config.sliding_window - 1`` positions (transformers sizes it from that key) plus the linear
state of every position older than the window.

Assisted (speculative) decoding crops the cache back past rejected draft tokens. While a cache
records its past (``cache.activate_past_recording``, which ``generate`` calls), each recurrent
layer's kernel runs its last ``recurrent_states_to_keep`` new positions one at a time (projections
and MLP stay batched) and keeps the state
before each, and ``crop`` puts the state of the last accepted position back
(``RecurrentCacheLayer``, ``HybridSlidingCacheLayer``: transformers' cache layers with that crop).
Replaced layers are ``GradientCheckpointingLayer``s, so ``activation_checkpointing_enable()``
and ``Trainer(gradient_checkpointing=True)`` checkpoint them as they do the teacher's.

Each sequence-mixing kind has two forms on one set of weights: chunked (training and prefill:
exact masked attention inside a chunk plus the running state of earlier chunks) and
recurrent (decoding: one state update and one read-out per token); tests hold them equal.

Shape legend: B batch, T new positions, S past + new positions, D hidden size, H attention
heads, K KV heads, E head size, F features per head, X = E + 1 (values plus the normaliser
column), N chunks, C chunk length, V vocabulary, I input features, O output features, R rank,
W places in a window, P positions of a KV ring, L keys older than a window.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicSlidingWindowLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
    StaticCache,
    StaticLayer,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

from .configuration_distill_llama import HYBRID_LAYER_TYPE, RECURRENT_LAYER_TYPE, DistillLlamaConfig

if "cache" not in BaseModelOutputWithPast.__dataclass_fields__:  # its `past_key_values` before transformers 5.24
    raise ImportError("this distilled student's modeling code needs transformers>=5.24 (its `cache` API): "
                      "pip install -U 'transformers>=5.24,<6'")

logger = logging.get_logger(__name__)

DENOMINATOR_EPS = 1e-6
FEATURE_MAPS = ("hedgehog", "elu")
SEEN_TOKENS = "cumulative_length_linear"
"""The 0-dim tensor of a ``LinearAttentionLayer`` counting the positions it has absorbed: rotary
positions and, for a student without KV layers, ``past_length`` come from it. transformers adds
to it only for the conv states it is given (these layers keep none), so :func:`store_state` adds
to it. A tensor updated in place, not a Python int, so a compiled decode step neither breaks its
graph nor recompiles for every new position."""


# ---------------------------------------------------------------------- cache


def past_length(cache: Cache | None, layer_idx: int) -> int | torch.Tensor:
    """Positions layer ``layer_idx`` has already seen: 0 without a cache, a recurrent layer's
    counter (:data:`SEEN_TOKENS`, a tensor), a KV layer's length."""
    if cache is None or layer_idx >= len(cache.layers):
        return 0
    layer = cache.layers[layer_idx]
    seen = getattr(layer, SEEN_TOKENS, None)
    if isinstance(seen, torch.Tensor):  # ours first: a hybrid layer's KV part counts only its ring
        return seen
    if isinstance(layer, CacheLayerMixin):
        return layer.get_seq_length()
    return 0


def positions_seen(layer: Any) -> int:
    """A recurrent cache layer's count of positions, as a Python int (outside compiled code)."""
    return int(getattr(layer, SEEN_TOKENS))


def recurrent_state(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The state layer ``layer_idx`` left in the cache, or None before its first call (a state
    reset or rolled back to no position is zeros, which every kind reads as no state)."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    if not layer.is_recurrent_states_initialized[0]:
        return None
    return layer.recurrent_states[0]


def store_state(cache: Cache | None, layer_idx: int, state: torch.Tensor | None, num_new_tokens: int) -> None:
    """Keep ``state`` (None: a token-wise layer, nothing to keep) after ``num_new_tokens`` more positions.

    A cache recording its past (assisted decoding) first keeps the state being replaced, so
    that ``crop`` can put it back.
    """
    if cache is None:
        return
    if getattr(cache.layers[layer_idx], "record_past", False):
        remember_state(cache.layers[layer_idx])
    if state is not None:
        cache.update_recurrent_state(state, layer_idx)
    getattr(cache.layers[layer_idx], SEEN_TOKENS).add_(num_new_tokens)


ROLLBACK_MARKS = "rollback_marks"
"""Attribute of a recurrent cache layer recording its past: ``{positions seen: the state then}``,
one entry per call since the last ``crop`` (None where the layer had no state yet)."""


def steps_to_record(cache: Cache | None, layer_idx: int, seq_len: int) -> int:
    """How many of ``seq_len`` new positions a recurrent layer runs one at a time, keeping the
    state before each: the last ``recurrent_states_to_keep`` of them while the cache records
    its past (a rejected draft is cropped back to any of them), else none."""
    if cache is None or seq_len < 2 or not getattr(cache.layers[layer_idx], "record_past", False):
        return 0
    return min(seq_len, getattr(cache.layers[layer_idx], "recurrent_states_to_keep", None) or 0)


def remember_state(layer: Any) -> None:
    """Keep the state ``layer`` holds now under the count of positions it has seen (the oldest
    mark goes once there are more than ``recurrent_states_to_keep`` + 1)."""
    seen = positions_seen(layer)
    state = layer.recurrent_states[0] if seen and layer.is_recurrent_states_initialized[0] else None
    marks = layer.__dict__.setdefault(ROLLBACK_MARKS, {})
    marks[seen] = None if state is None else state.clone()
    while len(marks) > (getattr(layer, "recurrent_states_to_keep", None) or 0) + 1:
        del marks[next(iter(marks))]


def roll_back(layer: Any, tokens_to_remove: int) -> None:
    """Forget the last ``-tokens_to_remove`` positions of a recurrent layer, from its marks.

    A token-wise layer (no state) only counts positions, so any count goes back; a stateful
    one goes back to a mark or refuses: a state restored from anywhere else would be wrong.
    """
    if not getattr(layer, "record_past", False):
        raise RuntimeError("`crop` was called, but this recurrent layer does not record its past: "
                           "call `cache.activate_past_recording(recurrent_states_to_keep=...)` first")
    if tokens_to_remove > 0:
        raise RuntimeError("recurrent layers are cropped by a negative count: the positions to remove")
    marks = layer.__dict__.pop(ROLLBACK_MARKS, {})
    if not tokens_to_remove:
        return
    seen = positions_seen(layer) + tokens_to_remove
    if seen < 0:
        raise RuntimeError(f"cannot remove {-tokens_to_remove} positions from a layer that has seen {seen - tokens_to_remove}")
    if layer.is_recurrent_states_initialized[0] and seen:
        if seen not in marks:
            raise RuntimeError(
                f"cannot roll this recurrent layer back {-tokens_to_remove} positions: it kept its state after "
                f"positions {sorted(marks)} only; record more with "
                "cache.activate_past_recording(recurrent_states_to_keep=...)"
            )
        if marks[seen] is not None:
            layer.recurrent_states[0].copy_(marks[seen])
    elif layer.is_recurrent_states_initialized[0]:  # back to no position: no state
        layer.recurrent_states[0].zero_()
    getattr(layer, SEEN_TOKENS).sub_(-tokens_to_remove)


class RecurrentCacheLayer(LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` (cache type ``linear_attention``) that can be cropped.

    transformers' own crop restores a conv state and a per-call history that these layers do
    not keep; this one goes back to a state :func:`remember_state` kept. A model adopts the
    layers of its cache (:func:`adopt_cache`): ``DynamicCache(config=...)`` builds them by type name.
    """

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """The state, copied in place (its marks, not a history of every call, are what crop needs)."""
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx].copy_(recurrent_states)
        return self.recurrent_states[state_idx]

    def crop(self, tokens_to_remove: int) -> None:
        roll_back(self, tokens_to_remove)


class HybridSlidingCacheLayer(LinearAttentionAndSlidingWindowAttentionLayer):
    """transformers' ``hybrid_sliding`` layer (a KV ring plus a linear state) that can be cropped:
    the ring as transformers crops it, the state as :class:`RecurrentCacheLayer` does."""

    update_recurrent_state = RecurrentCacheLayer.update_recurrent_state

    def crop(self, tokens_to_remove: int) -> None:
        roll_back(self, tokens_to_remove)
        DynamicSlidingWindowLayer.crop(self, tokens_to_remove)


CROPPABLE_LAYERS: dict[type, type] = {
    LinearAttentionLayer: RecurrentCacheLayer,
    LinearAttentionAndSlidingWindowAttentionLayer: HybridSlidingCacheLayer,
}


def adopt_cache(cache: Cache) -> None:
    """Give the recurrent layers of ``cache`` our crop (assisted decoding rolls a rejected draft back).

    ``DynamicCache(config=model.config)`` (generate's, or the user's) builds transformers' classes
    from ``config.layer_types``; ours only add methods, so each layer that records its past takes
    our class in place, whatever it holds already (a layer that does not record is never cropped).
    """
    for layer in cache.layers:
        croppable = CROPPABLE_LAYERS.get(type(layer))
        if croppable is not None and layer.record_past:  # only then: a compiled forward never reaches this
            layer.__class__ = croppable


def window_ring(cache: Cache | None, layer_idx: int, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The last ``length`` keys and values layer ``layer_idx``'s KV ring holds (fewer early on), or Nones."""
    if cache is None or length < 1:
        return None, None
    layer = cache.layers[layer_idx]
    if not getattr(layer, "is_initialized", False) or layer.keys is None or not layer.keys.shape[-2]:
        return None, None
    return layer.keys[:, :, -length:], layer.values[:, :, -length:]


def default_positions(
    position_ids: torch.Tensor | None, cache: Cache | None, layer_idx: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """``position_ids`` as given, else ``past .. past + T - 1`` (an unpadded continuation) after
    the positions layer ``layer_idx`` has seen (a tensor sum: no Python int leaves the device)."""
    if position_ids is not None:
        return position_ids
    return (torch.arange(seq_len, device=device) + past_length(cache, layer_idx)).unsqueeze(0)


def positions_from_mask(
    attention_mask: torch.Tensor | None, cache: Cache | None, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Default position ids: each real token's index among the real tokens, as ``generate``
    derives them, so that a left-padded batch given without ``position_ids`` gets each
    sequence's own positions. A softmax layer with rotary embeddings does not care where a
    sequence starts; a linear-attention feature map of rotated queries and keys does, so
    without this a padded row differed from the same row alone. ``attention_mask`` over the
    past and new positions, or over the new ones only (then after the cache's own count)."""
    if attention_mask is None or attention_mask.ndim != 2:
        return default_positions(None, cache, 0, seq_len, device)
    counted_BL = attention_mask.to(device=device, dtype=torch.long).cumsum(-1) - 1
    positions_BT = counted_BL[:, -seq_len:].clamp(min=0)
    if attention_mask.shape[1] == seq_len:
        positions_BT = positions_BT + past_length(cache, 0)
    return positions_BT


def new_token_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """The padding mask of the T new positions as float ``mask_BT``, or None without a mask.

    ``attention_mask`` is the 2D mask over past + new positions (or over the new ones only).
    """
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(
            "replaced layers need the 2D padding mask (batch, positions) that tokenizers return, "
            f"not a {attention_mask.ndim}D mask; pass attention_mask=tokens.attention_mask."
        )
    return attention_mask[:, -seq_len:].float()  # all ones weighs like no mask; checking would sync and break graphs


def key_mask(attention_mask: torch.Tensor | None, num_keys: int) -> torch.Tensor | None:
    """:func:`new_token_mask` over the last ``num_keys`` positions (a KV ring's and the new ones).

    A mask over fewer positions (only the new ones) marks the earlier ones real.
    """
    if attention_mask is not None and attention_mask.ndim == 2 and attention_mask.shape[1] < num_keys:
        attention_mask = F.pad(attention_mask, (num_keys - attention_mask.shape[1], 0), value=1)
    return new_token_mask(attention_mask, num_keys)


# ---------------------------------------------------------------------- kernels


def normalise(numden_BHTX: torch.Tensor) -> torch.Tensor:
    """``num / den`` for values that carry their normaliser as the last column."""
    return numden_BHTX[..., :-1] / (numden_BHTX[..., -1:] + DENOMINATOR_EPS)


def with_ones(v_BHTE: torch.Tensor) -> torch.Tensor:
    """float32 values with a column of ones, so the normaliser travels in the same matmuls."""
    return F.pad(v_BHTE.float(), (0, 1), value=1.0)


def causal_linear_numden(
    phi_q_BHTF: torch.Tensor,
    phi_k_BHTF: torch.Tensor,
    v1_BHTX: torch.Tensor,
    chunk_size: int,
    state_BHFX: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked ``sum_{s<=t} (phi_q_t . phi_k_s) v1_s``, unnormalised, and the state after the last position.

    Masked quadratic attention inside each chunk of ``chunk_size`` positions, plus the state
    of everything before the chunk: ``state_BHFX`` (the positions before this call, or none)
    and the exclusive prefix sum of the earlier chunks. Padding positions must have zero
    ``phi_k``: they then add nothing.
    """
    seq_len = phi_q_BHTF.shape[2]
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
    final_BHFX = total_BHNFX[:, :, -1] if state_BHFX is None else total_BHNFX[:, :, -1] + state_BHFX.float()
    return numden_BHNCX.flatten(2, 3)[:, :, :seq_len], final_BHFX


def causal_linear_attention(
    phi_q_BHTF: torch.Tensor,
    phi_k_BHTF: torch.Tensor,
    v_BHTE: torch.Tensor,
    chunk_size: int,
    state_BHFX: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form: ``out_t = sum_{s<=t} (phi_q_t . phi_k_s) v_s / sum_{s<=t} phi_q_t . phi_k_s``.

    :func:`causal_linear_numden` with values carrying a column of ones (the normaliser).
    Returns float32 ``out_BHTE`` and the state after the last position (``state_BHFX``: the
    positions before this call, or none). Padding positions must have zero ``phi_k``.
    """
    numden_BHTX, final_BHFX = causal_linear_numden(phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), chunk_size, state_BHFX)
    return normalise(numden_BHTX), final_BHFX


def linear_attention_step(
    phi_q_BH1F: torch.Tensor, phi_k_BH1F: torch.Tensor, v_BH1E: torch.Tensor, state_BHFX: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form for one position: ``S += phi(k) [v, 1]^T``, then ``out = phi(q) S``."""
    v1_BH1X = F.pad(v_BH1E.float(), (0, 1), value=1.0)
    update_BHFX = phi_k_BH1F.float().transpose(-1, -2) @ v1_BH1X
    state_BHFX = update_BHFX if state_BHFX is None else state_BHFX.float() + update_BHFX
    numden_BH1X = phi_q_BH1F.float() @ state_BHFX
    return numden_BH1X[..., :-1] / (numden_BH1X[..., -1:] + DENOMINATOR_EPS), state_BHFX


def recurrent_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor, state_BHFX: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form over T positions, one step at a time (the reference for the chunked form)."""
    outs = []
    for t in range(phi_q_BHTF.shape[2]):
        out_BH1E, state_BHFX = linear_attention_step(
            phi_q_BHTF[:, :, t : t + 1], phi_k_BHTF[:, :, t : t + 1], v_BHTE[:, :, t : t + 1], state_BHFX
        )
        outs.append(out_BH1E)
    return torch.cat(outs, dim=2), state_BHFX


def bidirectional_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor
) -> torch.Tensor:
    """``out_t = sum_s (phi_q_t . phi_k_s) v_s / sum_s phi_q_t . phi_k_s`` over all s (no state kept)."""
    q_BHTF, k_BHTF = phi_q_BHTF.float(), phi_k_BHTF.float()
    state_BHFX = k_BHTF.transpose(-1, -2) @ F.pad(v_BHTE.float(), (0, 1), value=1.0)
    numden_BHTX = q_BHTF @ state_BHFX
    return numden_BHTX[..., :-1] / (numden_BHTX[..., -1:] + DENOMINATOR_EPS)


def key_windows(x_BHSY: torch.Tensor, num_queries: int, before: int, after: int) -> torch.Tensor:
    """Each query's window of keys, ``(B, H, T, Y, before + 1 + after)`` (a view).

    Query t is key ``S - T + t`` (the ``S - T <= before`` keys before the first query are a
    past, e.g. a KV ring) and its window is keys ``S - T + t - before .. S - T + t + after``;
    places outside the keys hold zeros.
    """
    past = x_BHSY.shape[2] - num_queries
    return F.pad(x_BHSY, (0, 0, before - past, after)).unfold(2, before + 1 + after, 1)


def window_keep(mask_BS: torch.Tensor | None, num_keys: int, num_queries: int, before: int, after: int,
                device: torch.device) -> torch.Tensor:
    """bool ``(B or 1, 1, T, window)``: which places of each query's window hold a real key."""
    valid_BS = torch.ones(1, num_keys, device=device) if mask_BS is None else mask_BS.float()
    return key_windows(valid_BS[:, None, :, None], num_queries, before, after)[:, :, :, 0] > 0


def window_softmax_numden(
    q_BHTE: torch.Tensor,
    k_BHSE: torch.Tensor,
    v1_BHSX: torch.Tensor,
    keep_BHTW: torch.Tensor,
    before: int,
    after: int,
    scale: float,
) -> torch.Tensor:
    """``sum_{s in window(t)} exp(scale q_t . k_s - m_t) v1_s``: softmax attention over each window, unnormalised.

    ``m_t`` is the largest score in t's window, so the largest weight is exactly 1 (stable, and
    on the scale of the linear-attention weights it is added to); the last column is the
    window's softmax normaliser. Places ``keep_BHTW`` marks False (padding, outside the
    sequence) weigh 0; a window with no real key gives zeros, never NaN.
    """
    seq_len = q_BHTE.shape[2]
    keys_BHTEW = key_windows(k_BHSE.float(), seq_len, before, after)
    scores_BHTW = torch.einsum("bhte,bhtew->bhtw", q_BHTE.float(), keys_BHTEW) * scale
    scores_BHTW = scores_BHTW.masked_fill(~keep_BHTW, torch.finfo(torch.float32).min)
    weights_BHTW = torch.exp(scores_BHTW - scores_BHTW.amax(dim=-1, keepdim=True)) * keep_BHTW
    return torch.einsum("bhtw,bhtxw->bhtx", weights_BHTW, key_windows(v1_BHSX, seq_len, before, after))


def delayed_keys(x_BHLY: torch.Tensor, num_queries: int, past: int, delay: int) -> torch.Tensor:
    """``x`` moved ``delay`` places later, for the T queries: row t holds key ``past + t - delay``
    (zeros before key 0), so a causal kernel over the queries sees only keys at least ``delay``
    positions older than each query (``delay >= past``; ``x`` may stop at key ``past + T - delay``)."""
    return F.pad(x_BHLY, (0, 0, delay - past, 0))[:, :, :num_queries]


def gated_linear_numden(
    phi_q_BHTF: torch.Tensor,
    phi_k_BHTF: torch.Tensor,
    v1_BHTX: torch.Tensor,
    log_g_BHT: torch.Tensor,
    chunk_size: int,
    state_BHFX: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked ``sum_{s<=t} (prod_{s<r<=t} g_r) (phi_q_t . phi_k_s) v1_s``, unnormalised, and the state after.

    The state is ``S_t = g_t S_{t-1} + phi_k_t v1_t^T`` (``state_BHFX`` before the first
    position, or zeros). Inside a chunk the decays ``exp(L_t - L_s)`` (``L`` the chunk's own
    cumulative sum of ``log g``) are at most 1, so nothing overflows. The state entering chunk
    n sums every earlier chunk's keys decayed by the chunks between (an N x N matrix of decays,
    each at most 1): no loop over chunks, so traced graphs (torch.export, ONNX) hold for any
    length, not only the example's. Padding positions must have zero ``phi_k`` and ``log g``:
    they then add nothing and decay nothing.
    """
    seq_len = phi_q_BHTF.shape[2]
    chunk = min(chunk_size, seq_len)
    pad = -seq_len % chunk
    q_BHNCF, k_BHNCF, v1_BHNCX = (
        F.pad(x.float(), (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (phi_q_BHTF, phi_k_BHTF, v1_BHTX)
    )
    cum_BHNC = F.pad(log_g_BHT.float(), (0, pad)).unflatten(2, (-1, chunk)).cumsum(dim=-1)
    causal_CC = torch.ones(chunk, chunk, dtype=torch.bool, device=q_BHNCF.device).tril()
    decay_BHNCC = (cum_BHNC[..., :, None] - cum_BHNC[..., None, :]).masked_fill(~causal_CC, -torch.inf).exp()
    inside_BHNCX = ((q_BHNCF @ k_BHNCF.transpose(-1, -2)) * decay_BHNCC) @ v1_BHNCX
    to_end_BHNC = (cum_BHNC[..., -1:] - cum_BHNC).exp()
    kv_BHNFX = (k_BHNCF * to_end_BHNC[..., None]).transpose(-1, -2) @ v1_BHNCX
    through_BHN = cum_BHNC[..., -1].cumsum(dim=-1)  # log decay from the start through chunk n
    entering_BHN = through_BHN - cum_BHNC[..., -1]  # ... up to chunk n, excluded (no slice: any length traces)
    num_chunks = through_BHN.shape[-1]
    earlier_NN = torch.ones(num_chunks, num_chunks, dtype=torch.bool, device=q_BHNCF.device).tril(-1)
    decay_BHNN = (entering_BHN[..., :, None] - through_BHN[..., None, :]).masked_fill(~earlier_NN, -torch.inf).exp()
    prefix_BHNFX = torch.einsum("bhnm,bhmfx->bhnfx", decay_BHNN, kv_BHNFX)
    final_BHFX = torch.einsum("bhm,bhmfx->bhfx", (through_BHN[..., -1, None] - through_BHN).exp(), kv_BHNFX)
    if state_BHFX is not None:
        prefix_BHNFX = prefix_BHNFX + entering_BHN.exp()[..., None, None] * state_BHFX.float().unsqueeze(2)
        final_BHFX = final_BHFX + through_BHN[..., -1].exp()[..., None, None] * state_BHFX.float()
    before_BHNCX = (q_BHNCF * cum_BHNC.exp()[..., None]) @ prefix_BHNFX
    return (inside_BHNCX + before_BHNCX).flatten(2, 3)[:, :, :seq_len], final_BHFX


def gated_linear_attention_step(
    phi_q_BH1F: torch.Tensor, phi_k_BH1F: torch.Tensor, v_BH1E: torch.Tensor, log_g_BH1: torch.Tensor,
    state_BHFX: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form for one position: ``S = g S + phi(k) [v, 1]^T``, then ``out = phi(q) S`` normalised."""
    update_BHFX = phi_k_BH1F.float().transpose(-1, -2) @ with_ones(v_BH1E)
    if state_BHFX is not None:
        update_BHFX = update_BHFX + state_BHFX.float() * log_g_BH1.float().exp()[..., None]
    return normalise(phi_q_BH1F.float() @ update_BHFX), update_BHFX


def recurrent_gated_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor, log_g_BHT: torch.Tensor,
    state_BHFX: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form over T positions, one step at a time (the reference for the chunked form)."""
    outs = []
    for t in range(phi_q_BHTF.shape[2]):
        step = slice(t, t + 1)
        out_BH1E, state_BHFX = gated_linear_attention_step(
            phi_q_BHTF[:, :, step], phi_k_BHTF[:, :, step], v_BHTE[:, :, step], log_g_BHT[:, :, step], state_BHFX
        )
        outs.append(out_BH1E)
    return torch.cat(outs, dim=2), state_BHFX


def bidirectional_gated_numden(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v1_BHTX: torch.Tensor, log_g_BHT: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Every key, decayed by the gates between it and the query (those it crosses, the query's included).

    Keys up to the query: :func:`gated_linear_numden`. Keys after it: the same kernel on the
    reversed sequence, each key moved one place on (so only strictly later keys count) and
    decayed by the gate of the place it moves to, which is the one it crosses there.
    """
    forward_BHTX, _ = gated_linear_numden(phi_q_BHTF, phi_k_BHTF, v1_BHTX, log_g_BHT, chunk_size)
    seq_len = phi_q_BHTF.shape[2]
    log_g_rev_BHT = log_g_BHT.float().flip(2)
    k_rev_BHTF = delayed_keys(phi_k_BHTF.float().flip(2), seq_len, 0, 1) * log_g_rev_BHT.exp()[..., None]
    v1_rev_BHTX = delayed_keys(v1_BHTX.flip(2), seq_len, 0, 1)
    backward_BHTX, _ = gated_linear_numden(phi_q_BHTF.flip(2), k_rev_BHTF, v1_rev_BHTX, log_g_rev_BHT, chunk_size)
    return forward_BHTX + backward_BHTX.flip(2)


def unit_keys(x_BHTE: torch.Tensor) -> torch.Tensor:
    """float32 heads scaled to length 1: the delta rule's keys and queries (its state then never grows)."""
    return F.normalize(x_BHTE.float(), dim=-1, eps=DENOMINATOR_EPS)


def gated_delta_step(
    q_BH1E: torch.Tensor, k_BH1E: torch.Tensor, v_BH1E: torch.Tensor, beta_BH1: torch.Tensor,
    log_a_BH1: torch.Tensor, state_BHEE: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form for one position: ``S = a (S - b k (k^T S)) + b k v^T``, then ``out = S^T q``.

    ``S`` maps keys (rows) to values (columns); ``a`` decays it and ``b`` is how far the value
    stored under ``k`` moves to ``v`` (``b = 1``: replaced). Queries and keys of length 1.
    """
    q_BH1E, k_BH1E = unit_keys(q_BH1E), unit_keys(k_BH1E)
    beta_BH11, decay_BH11 = beta_BH1.float()[..., None], log_a_BH1.float().exp()[..., None]
    if state_BHEE is None:
        state_BHEE = k_BH1E.new_zeros(*k_BH1E.shape[:2], k_BH1E.shape[-1], v_BH1E.shape[-1])
    state_BHEE = decay_BH11 * state_BHEE.float()
    recalled_BH1E = k_BH1E @ state_BHEE  # what the state holds under k now
    state_BHEE = state_BHEE + k_BH1E.transpose(-1, -2) @ (beta_BH11 * (v_BH1E.float() - recalled_BH1E))
    return q_BH1E @ state_BHEE, state_BHEE


def recurrent_gated_delta(
    q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor, beta_BHT: torch.Tensor,
    log_a_BHT: torch.Tensor, state_BHEE: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form over T positions, one step at a time (the reference for the chunked form)."""
    outs = []
    for t in range(q_BHTE.shape[2]):
        step = slice(t, t + 1)
        out_BH1E, state_BHEE = gated_delta_step(q_BHTE[:, :, step], k_BHTE[:, :, step], v_BHTE[:, :, step],
                                                beta_BHT[:, :, step], log_a_BHT[:, :, step], state_BHEE)
        outs.append(out_BH1E)
    return torch.cat(outs, dim=2), state_BHEE


def chunked_gated_delta(
    q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor, beta_BHT: torch.Tensor,
    log_a_BHT: torch.Tensor, chunk_size: int, state_BHEE: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of :func:`gated_delta_step` over T positions: float32 ``out_BHTE`` and the state after.

    Inside a chunk the state after position t is ``g_t S_0 + sum_{s<=t} (g_t / g_s) k_s w_s^T``
    (``g`` the decay since the chunk began, ``S_0`` the state entering it), where the
    corrections ``w_s = b_s (v_s - (what the state held under k_s))`` solve one unit lower
    triangular system per chunk, ``(I + A) W = b V - b g K S_0`` with ``A[t, s] = b_t (g_t / g_s)
    k_t . k_s`` (s < t): exact, with matrix products instead of T steps. Every decay ratio is
    at most 1. A loop carries the state across chunks (each chunk's system reads the state
    entering it). Padding positions must have ``b = 0`` and ``log a = 0``: they then change nothing.
    """
    if torch.compiler.is_exporting():
        raise NotImplementedError(
            "replacement kind gated_delta_rule cannot be exported for inputs of any length (torch.export, "
            "torch.onnx.export): its state crosses chunks through a loop, which a traced graph would fix at the "
            "example's length. Export a student of another kind (linear_attention, gated_linear_attention, "
            "sliding_window_linear)."
        )
    seq_len, head_dim = q_BHTE.shape[2], k_BHTE.shape[-1]
    chunk = min(chunk_size, seq_len)
    pad = -seq_len % chunk
    q_BHNCE, k_BHNCE, v_BHNCE = (
        F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, chunk))
        for x in (unit_keys(q_BHTE), unit_keys(k_BHTE), v_BHTE.float())
    )
    beta_BHNC = F.pad(beta_BHT.float(), (0, pad)).unflatten(2, (-1, chunk))
    cum_BHNC = F.pad(log_a_BHT.float(), (0, pad)).unflatten(2, (-1, chunk)).cumsum(dim=-1)
    causal_CC = torch.ones(chunk, chunk, dtype=torch.bool, device=q_BHNCE.device).tril()
    ratio_BHNCC = (cum_BHNC[..., :, None] - cum_BHNC[..., None, :]).masked_fill(~causal_CC, -torch.inf).exp()
    eye_CC = torch.eye(chunk, device=q_BHNCE.device)
    lower_BHNCC = eye_CC + (beta_BHNC[..., None] * ratio_BHNCC * (k_BHNCE @ k_BHNCE.transpose(-1, -2))).tril(-1)
    bv_BHNCE = beta_BHNC[..., None] * v_BHNCE
    bgk_BHNCE = (beta_BHNC * cum_BHNC.exp())[..., None] * k_BHNCE
    solved_BHNCX = torch.linalg.solve_triangular(lower_BHNCC, torch.cat([bv_BHNCE, bgk_BHNCE], dim=-1),
                                                 upper=False, unitriangular=True)
    u_BHNCE, wk_BHNCE = solved_BHNCX[..., :v_BHNCE.shape[-1]], solved_BHNCX[..., v_BHNCE.shape[-1]:]
    scores_BHNCC = (q_BHNCE @ k_BHNCE.transpose(-1, -2)) * ratio_BHNCC
    to_end_BHNC = (cum_BHNC[..., -1:] - cum_BHNC).exp()
    if state_BHEE is None:
        state_BHEE = q_BHNCE.new_zeros(*q_BHNCE.shape[:2], head_dim, v_BHNCE.shape[-1])
    state_BHEE = state_BHEE.float()
    outs = []
    for n in range(q_BHNCE.shape[2]):
        w_BHCE = u_BHNCE[:, :, n] - wk_BHNCE[:, :, n] @ state_BHEE
        decay_BHC1 = cum_BHNC[:, :, n, :, None].exp()
        outs.append((q_BHNCE[:, :, n] * decay_BHC1) @ state_BHEE + scores_BHNCC[:, :, n] @ w_BHCE)
        state_BHEE = (cum_BHNC[:, :, n, -1, None, None].exp() * state_BHEE
                      + (k_BHNCE[:, :, n] * to_end_BHNC[:, :, n, :, None]).transpose(-1, -2) @ w_BHCE)
    return torch.stack(outs, dim=2).flatten(2, 3)[:, :, :seq_len], state_BHEE


# ---------------------------------------------------------------------- linear attention


class FeatureMap(nn.Module):
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
    """Learnable feature maps for q and k plus the kernel: chunked, or recurrent for one new token."""

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
        self,
        q_BHTE: torch.Tensor,
        k_BHTE: torch.Tensor,
        v_BHTE: torch.Tensor,
        mask_BT: torch.Tensor | None = None,
        state_BHFX: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 ``out_BHTE`` and the state after the last position (None when bidirectional).

        ``mask_BT`` (1 = token, 0 = padding) zeroes the keys' features of padded positions
        before they reach the state or the normaliser.
        """
        phi_q_BHTF, phi_k_BHTF = self.q_features(q_BHTE), self.k_features(k_BHTE)
        if mask_BT is not None:
            phi_k_BHTF = phi_k_BHTF * mask_BT[:, None, :, None]
        if not self.causal:
            return bidirectional_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE), None
        if state_BHFX is not None and q_BHTE.shape[2] == 1:
            return linear_attention_step(phi_q_BHTF, phi_k_BHTF, v_BHTE, state_BHFX)
        return causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, self.chunk_size, state_BHFX)

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


class SlidingWindowLinearAttention(LinearAttention):
    """Exact softmax attention over a window of nearby positions, linear attention over the rest, one normaliser.

    LoLCATs' formulation (Zhang et al. 2024): ``out_t = (w_h sum_{s in window} exp(q_t . k_s / sqrt(E) - m_t) v_s
    + sum_{s outside} phi(q_t) . phi(k_s) v_s) / (the same sums without v)``, ``m_t`` the window's
    largest score and ``w_h = sigmoid(window_factor_h)`` a learned per-head weight of the window
    against the linear part. Causal: the window is the last ``window`` positions (the query's
    own included) and linear attention covers every older one. Bidirectional: the window is
    every position less than ``window`` away on either side (2 * window - 1 of them: the same
    reach as the causal window, in both directions, as an encoder's context is) and linear
    attention covers the farther ones. With ``window`` >= T it is exactly softmax attention.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_map: str,
        feature_dim: int,
        causal: bool,
        chunk_size: int,
        window: int,
        scale: float,
        window_factor_init: float = 0.0,
        **factory: Any,
    ) -> None:
        super().__init__(num_heads, head_dim, feature_map, feature_dim, causal, chunk_size, **factory)
        self.window = window
        self.scale = scale
        self.window_factor_init = window_factor_init
        self.window_factor_H = nn.Parameter(torch.full((num_heads,), float(window_factor_init), **factory))

    def forward(
        self,
        q_BHTE: torch.Tensor,
        k_BHSE: torch.Tensor,
        v_BHSE: torch.Tensor,
        mask_BS: torch.Tensor | None = None,
        state_BHFX: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 ``out_BHTE`` and (causal) the linear state of every key older than the next position's window.

        Keys and values are the ``S - T`` (< window) positions before the queries (the KV ring
        of a cache) and the T new ones; ``state_BHFX`` holds every position before those;
        ``mask_BS`` (1 = token, 0 = padding) covers the S keys.
        """
        seq_len, num_keys = q_BHTE.shape[2], k_BHSE.shape[2]
        past, window = num_keys - seq_len, self.window
        weight_H11 = torch.sigmoid(self.window_factor_H.float())[:, None, None]
        v1_BHSX = with_ones(v_BHSE)
        if self.causal and seq_len == 1 and state_BHFX is not None:
            return self._step(q_BHTE, k_BHSE, v1_BHSX, mask_BS, state_BHFX, weight_H11)
        after = 0 if self.causal else window - 1
        keep_BHTW = window_keep(mask_BS, num_keys, seq_len, window - 1, after, q_BHTE.device)
        window_BHTX = window_softmax_numden(q_BHTE, k_BHSE, v1_BHSX, keep_BHTW, window - 1, after, self.scale)
        phi_q_BHTF = self.q_features(q_BHTE)
        if not self.causal:
            return normalise(weight_H11 * window_BHTX + self._far_numden(phi_q_BHTF, k_BHSE, v1_BHSX, mask_BS)), None
        gone = max(0, num_keys - window + 1)  # keys older than the next position's window
        phi_k_BHLF = self.k_features(k_BHSE[:, :, :gone])
        if mask_BS is not None:
            phi_k_BHLF = phi_k_BHLF * mask_BS[:, None, :gone, None]
        older_BHTX, state_BHFX = causal_linear_numden(
            phi_q_BHTF, delayed_keys(phi_k_BHLF, seq_len, past, window),
            delayed_keys(v1_BHSX[:, :, :gone], seq_len, past, window), self.chunk_size, state_BHFX,
        )
        if gone:  # the key leaving the window now: seen by the next position's linear part
            state_BHFX = state_BHFX + phi_k_BHLF[:, :, -1:].transpose(-1, -2) @ v1_BHSX[:, :, gone - 1 : gone]
        return normalise(weight_H11 * window_BHTX + older_BHTX), state_BHFX

    def _step(
        self, q_BH1E: torch.Tensor, k_BHSE: torch.Tensor, v1_BHSX: torch.Tensor, mask_BS: torch.Tensor | None,
        state_BHFX: torch.Tensor, weight_H11: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent form for one position: its window is every key given (the ring and itself), the state the rest."""
        scores_BH1S = (q_BH1E.float() @ k_BHSE.float().transpose(-1, -2)) * self.scale
        keep_B11S = torch.ones_like(scores_BH1S[:1, :1], dtype=torch.bool) if mask_BS is None else (
            mask_BS[:, None, None, :] > 0)
        scores_BH1S = scores_BH1S.masked_fill(~keep_B11S, torch.finfo(torch.float32).min)
        weights_BH1S = torch.exp(scores_BH1S - scores_BH1S.amax(dim=-1, keepdim=True)) * keep_B11S
        numden_BH1X = weight_H11 * (weights_BH1S @ v1_BHSX) + self.q_features(q_BH1E) @ state_BHFX.float()
        if k_BHSE.shape[2] == self.window:  # the oldest key leaves the window: into the state
            phi_k_BH1F = self.k_features(k_BHSE[:, :, :1])
            if mask_BS is not None:
                phi_k_BH1F = phi_k_BH1F * mask_BS[:, None, :1, None]
            state_BHFX = state_BHFX.float() + phi_k_BH1F.transpose(-1, -2) @ v1_BHSX[:, :, :1]
        return normalise(numden_BH1X), state_BHFX

    def _far_numden(
        self, phi_q_BHTF: torch.Tensor, k_BHTE: torch.Tensor, v1_BHTX: torch.Tensor, mask_BT: torch.Tensor | None
    ) -> torch.Tensor:
        """Bidirectional: linear attention over keys ``window`` or more places before or after each query."""
        phi_k_BHTF = self.k_features(k_BHTE)
        if mask_BT is not None:
            phi_k_BHTF = phi_k_BHTF * mask_BT[:, None, :, None]
        seq_len = phi_q_BHTF.shape[2]
        total_BHTX = phi_q_BHTF.new_zeros(*phi_q_BHTF.shape[:-1], v1_BHTX.shape[-1])
        for flip in (False, True):  # keys before, then keys after (the sequence reversed)
            q_BHTF, k_BHTF, v_BHTX = (x.flip(2) if flip else x for x in (phi_q_BHTF, phi_k_BHTF, v1_BHTX))
            far_BHTX, _ = causal_linear_numden(
                q_BHTF, delayed_keys(k_BHTF, seq_len, 0, self.window), delayed_keys(v_BHTX, seq_len, 0, self.window),
                self.chunk_size,
            )
            total_BHTX = total_BHTX + (far_BHTX.flip(2) if flip else far_BHTX)
        return total_BHTX

    def flops_per_token(self, seq_len: int) -> int:
        """Feature maps, the linear kernel over the older keys, and the window, per token over all heads.

        Per head: the chunked linear kernel as :class:`LinearAttention`'s (state update and
        readout ``F (E + 1)`` each, in-chunk ``C (F + E + 1)``; bidirectional runs it both ways),
        plus the window's scores and weighted values, ``(2E + 1)`` per place: ``window`` places
        causal, ``2 window - 1`` bidirectional.
        """
        features, head_dim = self.q_features.num_features, self.head_dim
        chunk = min(self.chunk_size, seq_len)
        passes, places = (1, self.window) if self.causal else (2, 2 * self.window - 1)
        macs = passes * (2 * features * (head_dim + 1) + chunk * (features + head_dim + 1))
        macs += places * (2 * head_dim + 1)
        maps = self.q_features.flops_per_token() + self.k_features.flops_per_token()
        return maps + 2 * self.num_heads * macs


def gate_bias(gate_init: float) -> float:
    """The gate's bias that makes its decay ``gate_init`` while its weight is zero: ``logit(gate_init)``."""
    return torch.logit(torch.tensor(gate_init, dtype=torch.float64, device="cpu")).item()


class GatedLinearAttention(LinearAttention):
    """Linear attention whose state decays by a per-head gate computed from the layer input.

    ``S_t = g_t S_{t-1} + phi(k_t) [v_t, 1]^T`` and ``out_t = phi(q_t) S_t`` normalised by its
    last column (which decays with the values), so the output stays a weighted average of
    values, recent ones weighing more where the gate closes. ``log g_t = logsigmoid(x_t W + b)``
    per head: ``W`` starts at zero and ``b`` at ``logit(gate_init)``, so a ``gate_init`` near 1
    starts the layer at (nearly) the ungated linear attention and training makes the decay
    depend on the input. Bidirectional (encoders): keys on both sides, each decayed by the
    gates between it and the query.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        feature_map: str,
        feature_dim: int,
        causal: bool,
        chunk_size: int,
        hidden_size: int,
        gate_init: float,
        **factory: Any,
    ) -> None:
        super().__init__(num_heads, head_dim, feature_map, feature_dim, causal, chunk_size, **factory)
        self.gate = nn.Linear(hidden_size, num_heads, **factory)
        self.gate_init = gate_init
        self.reset_gate()

    def reset_gate(self) -> None:
        """The gate's start: the same decay ``gate_init`` everywhere, whatever the input."""
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.bias.fill_(gate_bias(self.gate_init))

    def forward(
        self,
        q_BHTE: torch.Tensor,
        k_BHTE: torch.Tensor,
        v_BHTE: torch.Tensor,
        x_BTD: torch.Tensor,
        mask_BT: torch.Tensor | None = None,
        state_BHFX: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 ``out_BHTE`` and the state after the last position (None when bidirectional).

        ``x_BTD`` is what the gate reads (the layer's normed input); padded positions
        (``mask_BT`` 0) add nothing to the state and decay nothing.
        """
        phi_q_BHTF, phi_k_BHTF = self.q_features(q_BHTE), self.k_features(k_BHTE)
        log_g_BHT = F.logsigmoid(self.gate(x_BTD).float()).transpose(1, 2)
        if mask_BT is not None:
            phi_k_BHTF = phi_k_BHTF * mask_BT[:, None, :, None]
            log_g_BHT = log_g_BHT * mask_BT[:, None, :]
        if not self.causal:
            return normalise(bidirectional_gated_numden(phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), log_g_BHT,
                                                        self.chunk_size)), None
        if state_BHFX is not None and q_BHTE.shape[2] == 1:
            return gated_linear_attention_step(phi_q_BHTF, phi_k_BHTF, v_BHTE, log_g_BHT, state_BHFX)
        numden_BHTX, state_BHFX = gated_linear_numden(
            phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), log_g_BHT, self.chunk_size, state_BHFX
        )
        return normalise(numden_BHTX), state_BHFX

    def flops_per_token(self, seq_len: int) -> int:
        """:class:`LinearAttention`'s count plus the decays (the gate's map is an ``nn.Linear``, counted with the block's).

        Per head: one multiply per in-chunk score and ``2F`` to decay queries and keys to the
        chunk's ends; bidirectional runs the causal kernel twice.
        """
        features, head_dim = self.q_features.num_features, self.head_dim
        chunk = min(self.chunk_size, seq_len)
        macs = 2 * features * (head_dim + 1) + chunk * (features + head_dim + 2) + 2 * features
        passes = 1 if self.causal else 2
        maps = self.q_features.flops_per_token() + self.k_features.flops_per_token()
        return maps + 2 * self.num_heads * passes * macs


class GatedDeltaRule(nn.Module):
    """The gated delta rule (Yang et al. 2025, Gated DeltaNet): a state of key -> value
    associations that each position corrects rather than adds to.

    ``S_t = a_t (S_{t-1} - b_t k_t (k_t^T S_{t-1})) + b_t k_t v_t^T``, ``out_t = S_t^T q_t``, with
    queries and keys scaled to length 1: writing ``v`` under ``k`` replaces a fraction ``b_t`` of
    what was stored there, so old associations are overwritten instead of piling up (what keeps
    recall of a long context in linearisation studies), and ``a_t`` decays the whole state.
    ``a_t = sigmoid(x_t W_a + c_a)`` and ``b_t = sigmoid(x_t W_b + c_b)`` per head from the layer's
    normed input; the maps start at zero and the biases at ``logit(gate_init)`` and
    ``logit(beta_init)``, so every head starts with one decay and one write strength. No
    feature map and no normaliser: queries and keys are the teacher's (after rotary), values its
    values. Causal only.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        hidden_size: int,
        chunk_size: int,
        gate_init: float,
        beta_init: float,
        **factory: Any,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_heads, **factory)
        self.beta = nn.Linear(hidden_size, num_heads, **factory)
        self.num_heads, self.head_dim, self.chunk_size = num_heads, head_dim, chunk_size
        self.gate_init, self.beta_init = gate_init, beta_init
        self.reset_gates()

    def reset_gates(self) -> None:
        """The start: every head with decay ``gate_init`` and write strength ``beta_init``, whatever the input."""
        with torch.no_grad():
            for linear, start in ((self.gate, self.gate_init), (self.beta, self.beta_init)):
                linear.weight.zero_()
                linear.bias.fill_(gate_bias(start))

    def forward(
        self,
        q_BHTE: torch.Tensor,
        k_BHTE: torch.Tensor,
        v_BHTE: torch.Tensor,
        x_BTD: torch.Tensor,
        mask_BT: torch.Tensor | None = None,
        state_BHEE: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``out_BHTE`` and the state after the last position; padded positions
        (``mask_BT`` 0) write nothing and decay nothing."""
        log_a_BHT = F.logsigmoid(self.gate(x_BTD).float()).transpose(1, 2)
        beta_BHT = torch.sigmoid(self.beta(x_BTD).float()).transpose(1, 2)
        if mask_BT is not None:
            log_a_BHT, beta_BHT = log_a_BHT * mask_BT[:, None, :], beta_BHT * mask_BT[:, None, :]
        if state_BHEE is not None and q_BHTE.shape[2] == 1:
            return gated_delta_step(q_BHTE, k_BHTE, v_BHTE, beta_BHT, log_a_BHT, state_BHEE)
        return chunked_gated_delta(q_BHTE, k_BHTE, v_BHTE, beta_BHT, log_a_BHT, self.chunk_size, state_BHEE)

    def flops_per_token(self, seq_len: int) -> int:
        """Multiply-adds per token over all heads (the gate maps are ``nn.Linear``s, counted with the block's).

        Per head: decay, recall, write and readout of the ``E x E`` state (``4 E^2``, each chunk's
        state work shared by its positions: the same order); in-chunk scores, key products and
        the triangular solve ``C (4E)``.
        """
        chunk = min(self.chunk_size, seq_len)
        return 2 * self.num_heads * (4 * self.head_dim * self.head_dim + 4 * chunk * self.head_dim)


def apply_rotary(x_BHTE: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as Llama/Qwen2/Mistral apply it (rotate-half layout)."""
    half = x_BHTE.shape[-1] // 2
    rotated_BHTE = torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], dim=-1)
    return x_BHTE * cos_BTE.unsqueeze(1) + rotated_BHTE * sin_BTE.unsqueeze(1)


def split_heads(x_BTD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``(B, T, heads * E) -> (B, heads, T, E)``."""
    return x_BTD.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def merge_heads(x_BHTE: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, T, E) -> (B, T, H * E)`` in the model's dtype."""
    return x_BHTE.transpose(1, 2).flatten(2).to(dtype)


class LinearAttentionBlock(nn.Module):
    """The teacher's pre-norm decoder layer with linear attention in place of softmax attention.

    Its q/k/v/o projections, optional q/k norms (Qwen3), norms, MLP and rotary embedding are
    the modules of a teacher layer (``layer`` and ``rotary_emb``, or fresh ones of the
    teacher's classes built from ``config``); only the attention's own parameters (feature
    maps; a gate or a window weight in the subclasses) are new. Subclasses change how the
    heads attend (``_make_attention``, ``_attend``), nothing else.
    """

    def __init__(
        self,
        config: DistillLlamaConfig,
        layer_idx: int,
        layer: nn.Module | None = None,
        rotary_emb: nn.Module | None = None,
    ) -> None:
        super().__init__()
        spec = config.distill_layers[str(layer_idx)]
        layer = layer if layer is not None else teacher_class(config, "layer")(config, layer_idx)
        attn = layer.self_attn
        self.input_layernorm = layer.input_layernorm
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj = attn.o_proj
        self.q_norm = getattr(attn, "q_norm", nn.Identity())
        self.k_norm = getattr(attn, "k_norm", nn.Identity())
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        weight = attn.q_proj.weight
        if rotary_emb is None:
            rotary_emb = teacher_class(config, "rotary")(config=teacher_view(config))
        self.rotary_emb = rotary_emb
        self.head_dim = attn.head_dim
        self.num_kv_groups = attn.num_key_value_groups
        self.layer_idx = layer_idx
        shape = {"num_heads": attn.q_proj.out_features // attn.head_dim, "head_dim": attn.head_dim,
                 "feature_map": spec.get("feature_map"), "feature_dim": int(spec.get("feature_dim") or 0),
                 "causal": bool(getattr(config, "is_causal", True)), "chunk_size": int(spec["chunk_size"]),
                 "device": weight.device, "dtype": weight.dtype}
        self.attention = self._make_attention(spec, shape, config, attn)

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillLlamaConfig,
                        attn: nn.Module) -> nn.Module:
        return LinearAttention(**shape)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Pre-norm attention residual, then pre-norm MLP residual, as in the teacher."""
        seq_len = hidden_BTD.shape[1]
        position_ids = default_positions(position_ids, cache, self.layer_idx, seq_len, hidden_BTD.device)
        normed_BTD = self.input_layernorm(hidden_BTD)
        q_BHTE = self.q_norm(split_heads(self.q_proj(normed_BTD), self.head_dim))
        k_BKTE = self.k_norm(split_heads(self.k_proj(normed_BTD), self.head_dim))
        v_BKTE = split_heads(self.v_proj(normed_BTD), self.head_dim)
        cos_BTE, sin_BTE = self.rotary_emb(hidden_BTD, position_ids)
        q_BHTE = apply_rotary(q_BHTE, cos_BTE, sin_BTE)
        k_BKTE = apply_rotary(k_BKTE, cos_BTE, sin_BTE)
        out_BHTE = self._attend_in_pieces(normed_BTD, q_BHTE, k_BKTE, v_BKTE, attention_mask, cache)
        hidden_BTD = hidden_BTD + self.o_proj(merge_heads(out_BHTE, hidden_BTD.dtype))
        return hidden_BTD + self.mlp(self.post_attention_layernorm(hidden_BTD))

    def _attend_in_pieces(self, normed_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor,
                          v_BKTE: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """:meth:`_attend` over every position at once; while the cache records its past, its last
        positions one at a time (:func:`steps_to_record`), so each leaves a state to go back to.
        Only the kernel runs per position: projections and MLP stay batched."""
        seq_len = q_BHTE.shape[2]
        steps = steps_to_record(cache, self.layer_idx, seq_len)
        if not steps:
            return self._attend(normed_BTD, q_BHTE, k_BKTE, v_BKTE, attention_mask, cache)
        cuts = ([0] if steps < seq_len else []) + list(range(seq_len - steps, seq_len + 1))
        pieces = []
        for start, end in zip(cuts[:-1], cuts[1:], strict=True):
            mask = None if attention_mask is None else attention_mask[:, : attention_mask.shape[1] - (seq_len - end)]
            pieces.append(self._attend(normed_BTD[:, start:end], q_BHTE[:, :, start:end], k_BKTE[:, :, start:end],
                                       v_BKTE[:, :, start:end], mask, cache))
        return torch.cat(pieces, dim=2)

    def _attend(self, normed_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """Linear attention over every position; its state goes to the cache."""
        seq_len = q_BHTE.shape[2]
        out_BHTE, state_BHFX = self.attention(
            q_BHTE, self._all_heads(k_BKTE), self._all_heads(v_BKTE), new_token_mask(attention_mask, seq_len),
            recurrent_state(cache, self.layer_idx),
        )
        store_state(cache, self.layer_idx, state_BHFX, seq_len)
        return out_BHTE

    def _all_heads(self, x_BKTE: torch.Tensor) -> torch.Tensor:
        """KV heads repeated for the query heads they serve (grouped-query attention)."""
        return x_BKTE.repeat_interleave(self.num_kv_groups, 1)


class SlidingWindowLinearBlock(LinearAttentionBlock):
    """:class:`LinearAttentionBlock` with :class:`SlidingWindowLinearAttention`.

    Its cache layer (``hybrid_sliding``) keeps the last keys and values (after rotary, per KV
    head) in a ring and the linear state of every older position; each call reads the ring's
    last ``window - 1`` positions before adding its own.
    """

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillLlamaConfig,
                        attn: nn.Module) -> nn.Module:
        return SlidingWindowLinearAttention(
            **shape, window=int(spec["window"]), scale=float(getattr(attn, "scaling", attn.head_dim**-0.5)),
            window_factor_init=float(spec.get("window_factor_init", 0.0)),
        )

    def _attend(self, normed_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """The window over the ring and the new positions, linear attention beyond; ring and state to the cache."""
        seq_len = q_BHTE.shape[2]
        ring_k_BKPE, ring_v_BKPE = window_ring(cache, self.layer_idx, self.attention.window - 1)
        keys_BKSE = k_BKTE if ring_k_BKPE is None else torch.cat([ring_k_BKPE, k_BKTE], dim=2)
        values_BKSE = v_BKTE if ring_v_BKPE is None else torch.cat([ring_v_BKPE, v_BKTE], dim=2)
        out_BHTE, state_BHFX = self.attention(
            q_BHTE, self._all_heads(keys_BKSE), self._all_heads(values_BKSE),
            key_mask(attention_mask, keys_BKSE.shape[2]), recurrent_state(cache, self.layer_idx),
        )
        if cache is not None:
            cache.layers[self.layer_idx].update(k_BKTE, v_BKTE)
        store_state(cache, self.layer_idx, state_BHFX, seq_len)
        return out_BHTE


class GatedLinearAttentionBlock(LinearAttentionBlock):
    """:class:`LinearAttentionBlock` with :class:`GatedLinearAttention`, its gate reading the normed layer input."""

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillLlamaConfig,
                        attn: nn.Module) -> nn.Module:
        return GatedLinearAttention(**shape, hidden_size=config.hidden_size,
                                    gate_init=float(spec.get("gate_init", 0.999)))

    def _attend(self, normed_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """Gated linear attention over every position; its state goes to the cache."""
        seq_len = q_BHTE.shape[2]
        out_BHTE, state_BHFX = self.attention(
            q_BHTE, self._all_heads(k_BKTE), self._all_heads(v_BKTE), normed_BTD,
            new_token_mask(attention_mask, seq_len), recurrent_state(cache, self.layer_idx),
        )
        store_state(cache, self.layer_idx, state_BHFX, seq_len)
        return out_BHTE


class GatedDeltaRuleBlock(GatedLinearAttentionBlock):
    """:class:`LinearAttentionBlock` with :class:`GatedDeltaRule`, its gates reading the normed layer input."""

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillLlamaConfig,
                        attn: nn.Module) -> nn.Module:
        factory = {"device": shape["device"], "dtype": shape["dtype"]}
        return GatedDeltaRule(shape["num_heads"], shape["head_dim"], config.hidden_size, shape["chunk_size"],
                              gate_init=float(spec.get("gate_init", 0.999)),
                              beta_init=float(spec.get("beta_init", 0.5)), **factory)


# ---------------------------------------------------------------------- replaced layers


class LowRankLinear(nn.Module):
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
    """Swap each named ``nn.Linear`` of ``layer`` for an (uninitialised) LowRankLinear of its rank."""
    for name, rank in ranks.items():
        linear = layer.get_submodule(name)
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        low_rank = LowRankLinear(linear.in_features, linear.out_features, int(rank), linear.bias is not None, **factory)
        layer.set_submodule(name, low_rank)


def teacher_view(config: DistillLlamaConfig) -> DistillLlamaConfig:
    """``config`` as the teacher's classes read it: ``layer_types`` are the teacher's attention
    types (the student's own are its cache layers), which Gemma-3's rotary embedding keys its bases by."""
    view = copy.copy(config)
    view.layer_types = list(config.teacher_layer_types)
    return view


def layer_config(config: DistillLlamaConfig, overrides: dict[str, Any]) -> DistillLlamaConfig:
    """``config`` with one layer's overrides (a pruned layer's sizes); itself when there are none."""
    if not overrides:
        return config
    out = copy.copy(config)
    for key, value in overrides.items():
        setattr(out, key, value)
    return out


def attention_of(layer: nn.Module) -> nn.Module:
    """The attention module of a teacher layer (``self_attn``; GPT-NeoX's is ``attention``, GPT-2's ``attn``)."""
    for name in ("self_attn", "attention", "attn"):
        attention = getattr(layer, name, None)
        if attention is not None:
            return attention
    raise AttributeError(f"{type(layer).__name__} has no self_attn, attention or attn")


def cache_argument(layer: nn.Module) -> str:
    """The name a teacher layer takes its cache by: ``cache``, or GPT-NeoX's ``layer_past``."""
    names = _arguments(type(layer).forward)
    return next((name for name in ("cache", "layer_past", "past_key_values") if name in names), "cache")


def _arguments(function: Any) -> tuple[str, ...]:
    while hasattr(function, "__wrapped__"):  # under torch.no_grad, rope-update and kwarg decorators
        function = function.__wrapped__
    code = function.__code__
    return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def rotary_of_type(rotary_emb: nn.Module | None, hidden_BTD: torch.Tensor, position_ids: torch.Tensor,
                   layer_type: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) for layers of ``layer_type``: Gemma-3's rotary embedding keeps one base per
    layer type and takes the type; the others have one for all layers; GPT-2 has none (None)."""
    if rotary_emb is None:
        return None
    if "layer_type" in _arguments(type(rotary_emb).forward):
        return rotary_emb(hidden_BTD, position_ids, layer_type)
    return rotary_emb(hidden_BTD, position_ids)


def run_teacher_layer(
    layer: nn.Module,
    rotary_emb: nn.Module,
    layer_type: str,
    hidden_BTD: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Cache | None = None,
) -> torch.Tensor:
    """Call a layer of the teacher's class with what the teacher's model would pass it.

    The mask of its attention type is built from the 2D padding mask and the layer's own
    cache layer, exactly as the teacher's forward builds it; keys and values go to the cache.
    """
    attention = attention_of(layer)
    config, layer_idx = attention.config, attention.layer_idx
    position_ids = default_positions(position_ids, cache, layer_idx, hidden_BTD.shape[1], hidden_BTD.device)
    mask_fn = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
    mask = mask_fn(
        config=config,
        inputs_embeds=hidden_BTD,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
        layer_idx=layer_idx if cache is not None else None,
    )
    rotary = rotary_of_type(rotary_emb, hidden_BTD, position_ids, layer_type)
    output = layer(
        hidden_BTD,
        attention_mask=mask,
        **({} if rotary is None else {"position_embeddings": rotary}),
        position_ids=position_ids,
        use_cache=cache is not None,
        **{cache_argument(layer): cache},
    )
    return output[0] if isinstance(output, tuple) else output


class DistillLlamaTeacherLayer(nn.Module):
    """Kinds copy, pruned and lowrank: a layer of the teacher's class, run as the teacher runs it.

    ``pruned`` builds it from the config with the layer's ``config_overrides`` (fewer MLP units,
    fewer KV heads); ``lowrank`` factorises the linear maps named in ``ranks``. Activation
    checkpointing reaches it through that layer, a ``GradientCheckpointingLayer`` of the
    teacher's class: wrapping it again would checkpoint it twice and miscount
    ``every_n_layers``.
    """

    def __init__(self, config: DistillLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.distill_layers[str(layer_idx)]
        own_config = layer_config(config, spec.get("config_overrides") or {})
        self.layer = teacher_class(config, "layer")(own_config, layer_idx)
        factorise(self.layer, spec.get("ranks") or {})
        self.rotary_emb = (teacher_class(config, "rotary")(config=teacher_view(config))
                           if "rotary" in config.teacher_classes else None)
        self.layer_type = config.teacher_layer_types[layer_idx]

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        return run_teacher_layer(self.layer, self.rotary_emb, self.layer_type, hidden_BTD, attention_mask, position_ids, cache)


class DistillLlamaResidualMLP(GradientCheckpointingLayer):
    """Kind mlp: ``x + W2 act(W1 norm(x))``, token by token (its cache layer only counts positions)."""

    def __init__(self, config: DistillLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.distill_layers[str(layer_idx)]
        hidden, units, eps = config.hidden_size, int(spec["hidden_units"]), float(spec["norm_eps"])
        self.norm = nn.RMSNorm(hidden, eps=eps) if spec["norm"] == "rms" else nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, units)
        self.act = ACT2FN[spec["activation"]]
        self.down = nn.Linear(units, hidden)
        self.layer_idx = layer_idx

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        store_state(cache, self.layer_idx, None, hidden_BTD.shape[1])
        return hidden_BTD + self.down(self.act(self.up(self.norm(hidden_BTD))))


LINEAR_BLOCKS: dict[str, type[LinearAttentionBlock]] = {
    "linear_attention": LinearAttentionBlock,
    "sliding_window_linear": SlidingWindowLinearBlock,
    "gated_linear_attention": GatedLinearAttentionBlock,
    "gated_delta_rule": GatedDeltaRuleBlock,
}
"""Kind -> the block of a :class:`DistillLlamaLinearAttentionLayer`."""


class DistillLlamaLinearAttentionLayer(GradientCheckpointingLayer):
    """Kinds linear_attention, sliding_window_linear, gated_linear_attention, gated_delta_rule: the kind's block of ``LINEAR_BLOCKS``.

    State in the layer's cache layer: a ``LinearAttentionLayer`` (linear and gated linear
    attention), a ``LinearAttentionAndSlidingWindowAttentionLayer`` (the window's KV ring
    plus the linear state).
    """

    def __init__(self, config: DistillLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.block = LINEAR_BLOCKS[config.distill_layers[str(layer_idx)]["kind"]](config, layer_idx)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        return self.block(hidden_BTD, attention_mask, position_ids, cache)


REPLACED_LAYERS: dict[str, type[nn.Module]] = {
    "copy": DistillLlamaTeacherLayer,
    "pruned": DistillLlamaTeacherLayer,
    "lowrank": DistillLlamaTeacherLayer,
    "mlp": DistillLlamaResidualMLP,
    "linear_attention": DistillLlamaLinearAttentionLayer,
    "sliding_window_linear": DistillLlamaLinearAttentionLayer,
    "gated_linear_attention": DistillLlamaLinearAttentionLayer,
    "gated_delta_rule": DistillLlamaLinearAttentionLayer,
}
"""``config.distill_layers[i]["kind"]`` -> the class of layer i."""


def teacher_class(config: DistillLlamaConfig, role: str) -> type[nn.Module]:
    """The teacher's class for ``role`` ("layer", "norm", "rotary"), from transformers.models only."""
    path = config.teacher_classes[role]
    module_name, _, class_name = path.rpartition(".")
    if not module_name.startswith(("transformers.models.", "torch.nn.modules.")):
        raise ValueError(f"teacher_classes[{role!r}]={path!r} is not a transformers class")
    return getattr(importlib.import_module(module_name), class_name)


# ---------------------------------------------------------------------- the model


class DistillLlamaPreTrainedModel(PreTrainedModel):
    config_class = DistillLlamaConfig
    config: DistillLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DistillLlamaTeacherLayer", "DistillLlamaResidualMLP", "DistillLlamaLinearAttentionLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        """The defaults, plus our parameters' start: feature maps at the identity, the window weight, the gate."""
        super()._init_weights(module)
        if isinstance(getattr(module, "rope_type", None), dict):
            _init_rotary_per_layer_type(module)
        elif isinstance(module, FeatureMap):
            num_heads, head_dim, feature_dim = module.weight_HEF.shape
            eye_HEF = torch.eye(head_dim, feature_dim).expand(num_heads, -1, -1)
            init.copy_(module.weight_HEF, eye_HEF.to(module.weight_HEF.dtype))
            init.zeros_(module.bias_HF)
        elif isinstance(module, SlidingWindowLinearAttention):
            init.constant_(module.window_factor_H, module.window_factor_init)
        elif isinstance(module, GatedLinearAttention):
            init.zeros_(module.gate.weight)
            init.constant_(module.gate.bias, gate_bias(module.gate_init))
        elif isinstance(module, GatedDeltaRule):
            for linear, start in ((module.gate, module.gate_init), (module.beta, module.beta_init)):
                init.zeros_(linear.weight)
                init.constant_(linear.bias, gate_bias(start))


def _init_rotary_per_layer_type(module: nn.Module) -> None:
    """Rotary buffers of a rotary embedding with one base per layer type (Gemma-3), as its own
    family initialises them: they are not saved, and transformers' generic init knows one base."""
    for layer_type in module.layer_types:
        rope_type = module.rope_type[layer_type]
        rope_fn = module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, _ = rope_fn(module.config, layer_type=layer_type)
        init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
        init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)


class DistillLlamaModel(DistillLlamaPreTrainedModel):
    """The decoder: teacher embeddings, layers (teacher's or replaced), final norm."""

    def __init__(self, config: DistillLlamaConfig) -> None:
        super().__init__(config)
        self.padding_idx = getattr(config, "pad_token_id", None)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([_build_layer(config, idx) for idx in range(config.num_hidden_layers)])
        eps = config.teacher_norm_eps if config.teacher_norm_eps is not None else config.rms_norm_eps
        self.norm = teacher_class(config, "norm")(config.hidden_size, eps=eps)
        self.rotary_emb = (teacher_class(config, "rotary")(config=teacher_view(config))
                           if "rotary" in config.teacher_classes else None)
        self.embed_positions = (nn.Embedding(config.distill_learned_positions, config.hidden_size)
                                if config.distill_learned_positions else None)
        self.gradient_checkpointing = False  # set by activation_checkpointing_enable(), as on the layers
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = kwargs.pop("past_key_values", cache)
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # a checkpointed layer runs twice (forward, then again in backward): a cache would take its state twice
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.")
            use_cache = False
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        inputs_embeds = self._embed(input_ids, inputs_embeds)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        _check_cache(cache, self.config)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, cache, inputs_embeds.shape[1], inputs_embeds.device)
        if self.embed_positions is not None:
            inputs_embeds = inputs_embeds + self.embed_positions(position_ids)
        masks = self._teacher_masks(inputs_embeds, attention_mask, cache, position_ids)
        position_embeddings = {layer_type: rotary_of_type(self.rotary_emb, inputs_embeds, position_ids, layer_type)
                               for layer_type in set(self.config.teacher_layer_types)}
        hidden_BTD, all_hidden = inputs_embeds, []
        for idx, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(hidden_BTD)
            if str(idx) in self.config.distill_layers:  # hidden states positional: what activation checkpointing replays
                hidden_BTD = layer(hidden_BTD, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
                continue
            rotary = position_embeddings[self.config.teacher_layer_types[idx]]
            hidden_BTD = layer(
                hidden_BTD,
                attention_mask=masks[self.config.teacher_layer_types[idx]],
                **({} if rotary is None else {"position_embeddings": rotary}),
                position_ids=position_ids,
                use_cache=use_cache,
                **{cache_argument(layer): cache},
                **kwargs,
            )
            hidden_BTD = hidden_BTD[0] if isinstance(hidden_BTD, tuple) else hidden_BTD
        hidden_BTD = self.norm(hidden_BTD)
        if output_hidden_states:
            all_hidden.append(hidden_BTD)
        out = BaseModelOutputWithPast(
            last_hidden_state=hidden_BTD,
            cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
        )
        return out if return_dict is not False else out.to_tuple()

    def _embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """What enters layer 0, scaled as the teacher scales it (``config.distill_embedding``)."""
        scaling = self.config.distill_embedding
        if inputs_embeds is not None:
            if scaling is None or not scaling["on_inputs_embeds"]:
                return inputs_embeds
            return inputs_embeds * scaling["scale"]
        inputs_embeds = self.embed_tokens(input_ids)
        if scaling is None:
            return inputs_embeds
        if scaling["in_weight_dtype"]:
            return inputs_embeds * torch.tensor(scaling["scale"], dtype=self.embed_tokens.weight.dtype)
        return inputs_embeds * scaling["scale"]

    def _teacher_masks(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None, position_ids: torch.Tensor
    ) -> dict[str, Any]:
        """The mask of each attention type the kept teacher layers use, as the teacher builds it."""
        kept = {self.config.teacher_layer_types[idx] for idx in range(len(self.layers)) if str(idx) not in self.config.distill_layers}
        kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "cache": cache, "position_ids": position_ids}
        masks: dict[str, Any] = {}
        for layer_type in kept:
            mask_fn = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
            masks[layer_type] = mask_fn(**kwargs)
        return masks


def _build_layer(config: DistillLlamaConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``: the class of its kind where replaced, else the teacher's own."""
    spec = config.distill_layers.get(str(layer_idx))
    if spec is None:
        return teacher_class(config, "layer")(config, layer_idx)
    return REPLACED_LAYERS[spec["kind"]](config, layer_idx)


def _check_cache(cache: Cache | None, config: DistillLlamaConfig) -> None:
    """A cache this model can use: one built from its config (``DynamicCache(config=model.config)``),
    its recurrent layers then adopted (:func:`adopt_cache`). A static cache is refused: its KV
    buffers are preallocated (a window's ring would read empty places) and ``generate`` then gives
    4D masks, where these layers read the 2D padding mask."""
    if cache is None:
        return
    if isinstance(cache, StaticCache) or any(isinstance(layer, StaticLayer) for layer in getattr(cache, "layers", ())):
        raise ValueError(
            "this student does not take a static cache (cache_implementation='static' or StaticCache): its "
            "replaced layers read the 2D padding mask, and recurrent ones keep a fixed-size state of their own. Use "
            "the default dynamic cache (no cache_implementation, or cache=DynamicCache(config=model.config)); "
            "to compile decoding, torch.compile the model (its forward has no graph breaks with that cache)."
        )
    layers = getattr(cache, "layers", None)
    ok = layers is not None and len(layers) == config.num_hidden_layers and all(
        hasattr(layers[idx], "update_recurrent_state")
        for idx, layer_type in enumerate(config.layer_types)
        if layer_type in (RECURRENT_LAYER_TYPE, HYBRID_LAYER_TYPE)
    )
    if not ok:
        raise ValueError(
            "this student keeps recurrent state for its replaced layers: pass "
            "cache=DynamicCache(config=model.config) (or none: the model makes one)."
        )
    adopt_cache(cache)


class DistillLlamaForCausalLM(DistillLlamaPreTrainedModel, GenerationMixin):
    """The decoder plus the teacher's LM head; ``generate()`` decodes with the cache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DistillLlamaConfig) -> None:
        super().__init__(config)
        self.model = DistillLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        hidden_BTD = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits_BTV = self._finish_logits(self.lm_head(hidden_BTD[:, keep, :]))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits_BTV, labels=labels, vocab_size=self.config.vocab_size)
        out = CausalLMOutputWithPast(loss=loss, logits=logits_BTV, cache=outputs.cache, hidden_states=outputs.hidden_states)
        return out if return_dict is not False else out.to_tuple()


    def _finish_logits(self, logits_BTV: torch.Tensor) -> torch.Tensor:
        """The teacher's scaling and soft-cap of its logits (``config.distill_logits``)."""
        transform = self.config.distill_logits
        if transform.get("divisor") is not None:
            logits_BTV = logits_BTV / transform["divisor"]
        if transform.get("softcap") is not None:
            logits_BTV = torch.tanh(logits_BTV / transform["softcap"]) * transform["softcap"]
        return logits_BTV


DistillLlamaConfig.register_for_auto_class()
DistillLlamaModel.register_for_auto_class("AutoModel")
DistillLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["DistillLlamaForCausalLM", "DistillLlamaModel", "DistillLlamaPreTrainedModel"]
