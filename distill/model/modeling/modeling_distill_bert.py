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
    sliding_window_linear   the same, with exact softmax attention over every position less
                            than ``window`` away and linear attention over farther ones
    gated_linear_attention  the same, with linear attention over both sides whose terms decay
                            by gates computed from the layer input

Every replaced layer takes ``(hidden_states, attention_mask, position_ids, cache)`` like the
decoder's; ``attention_mask`` is the 2D padding mask (1 = token, 0 = padding) and padded
positions add nothing to any state or normaliser. Encoders keep no cache.

Shape legend: B batch, T positions, D hidden size, H attention heads, E head size,
F features per head, X = E + 1 (values plus the normaliser column), N chunks, C chunk length,
S keys, W places in a window, L keys older than a window, Y any last dimension.
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
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from .configuration_distill_bert import DistillBertConfig

if "cache" not in BaseModelOutputWithPast.__dataclass_fields__:  # its `past_key_values` before transformers 5.24
    raise ImportError("this distilled student's modeling code needs transformers>=5.24 (its `cache` API): "
                      "pip install -U 'transformers>=5.24,<6'")

DENOMINATOR_EPS = 1e-6
FEATURE_MAPS = ("hedgehog", "elu")


def new_token_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    # Copied from modeling_distill_llama.new_token_mask
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


# ---------------------------------------------------------------------- kernels


def normalise(numden_BHTX: torch.Tensor) -> torch.Tensor:
    # Copied from modeling_distill_llama.normalise
    """``num / den`` for values that carry their normaliser as the last column."""
    return numden_BHTX[..., :-1] / (numden_BHTX[..., -1:] + DENOMINATOR_EPS)


def with_ones(v_BHTE: torch.Tensor) -> torch.Tensor:
    # Copied from modeling_distill_llama.with_ones
    """float32 values with a column of ones, so the normaliser travels in the same matmuls."""
    return F.pad(v_BHTE.float(), (0, 1), value=1.0)


def causal_linear_numden(
    phi_q_BHTF: torch.Tensor,
    phi_k_BHTF: torch.Tensor,
    v1_BHTX: torch.Tensor,
    chunk_size: int,
    state_BHFX: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Copied from modeling_distill_llama.causal_linear_numden
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
    # Copied from modeling_distill_llama.causal_linear_attention
    """Chunked form: ``out_t = sum_{s<=t} (phi_q_t . phi_k_s) v_s / sum_{s<=t} phi_q_t . phi_k_s``.

    :func:`causal_linear_numden` with values carrying a column of ones (the normaliser).
    Returns float32 ``out_BHTE`` and the state after the last position (``state_BHFX``: the
    positions before this call, or none). Padding positions must have zero ``phi_k``.
    """
    numden_BHTX, final_BHFX = causal_linear_numden(phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), chunk_size, state_BHFX)
    return normalise(numden_BHTX), final_BHFX


def bidirectional_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor
) -> torch.Tensor:
    # Copied from modeling_distill_llama.bidirectional_linear_attention
    """``out_t = sum_s (phi_q_t . phi_k_s) v_s / sum_s phi_q_t . phi_k_s`` over all s (no state kept)."""
    q_BHTF, k_BHTF = phi_q_BHTF.float(), phi_k_BHTF.float()
    state_BHFX = k_BHTF.transpose(-1, -2) @ F.pad(v_BHTE.float(), (0, 1), value=1.0)
    numden_BHTX = q_BHTF @ state_BHFX
    return numden_BHTX[..., :-1] / (numden_BHTX[..., -1:] + DENOMINATOR_EPS)


def key_windows(x_BHSY: torch.Tensor, num_queries: int, before: int, after: int) -> torch.Tensor:
    # Copied from modeling_distill_llama.key_windows
    """Each query's window of keys, ``(B, H, T, Y, before + 1 + after)`` (a view).

    Query t is key ``S - T + t`` (the ``S - T <= before`` keys before the first query are a
    past, e.g. a KV ring) and its window is keys ``S - T + t - before .. S - T + t + after``;
    places outside the keys hold zeros.
    """
    past = x_BHSY.shape[2] - num_queries
    return F.pad(x_BHSY, (0, 0, before - past, after)).unfold(2, before + 1 + after, 1)


def window_keep(mask_BS: torch.Tensor | None, num_keys: int, num_queries: int, before: int, after: int,
                device: torch.device) -> torch.Tensor:
    # Copied from modeling_distill_llama.window_keep
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
    # Copied from modeling_distill_llama.window_softmax_numden
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
    # Copied from modeling_distill_llama.delayed_keys
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
    # Copied from modeling_distill_llama.gated_linear_numden
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
    # Copied from modeling_distill_llama.gated_linear_attention_step
    """Recurrent form for one position: ``S = g S + phi(k) [v, 1]^T``, then ``out = phi(q) S`` normalised."""
    update_BHFX = phi_k_BH1F.float().transpose(-1, -2) @ with_ones(v_BH1E)
    if state_BHFX is not None:
        update_BHFX = update_BHFX + state_BHFX.float() * log_g_BH1.float().exp()[..., None]
    return normalise(phi_q_BH1F.float() @ update_BHFX), update_BHFX


def bidirectional_gated_numden(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v1_BHTX: torch.Tensor, log_g_BHT: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    # Copied from modeling_distill_llama.bidirectional_gated_numden
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


class SlidingWindowLinearAttention(LinearAttention):
    # Copied from modeling_distill_llama.SlidingWindowLinearAttention
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
    # Copied from modeling_distill_llama.gate_bias
    """The gate's bias that makes its decay ``gate_init`` while its weight is zero: ``logit(gate_init)``."""
    return torch.logit(torch.tensor(gate_init, dtype=torch.float64, device="cpu")).item()


class GatedLinearAttention(LinearAttention):
    # Copied from modeling_distill_llama.GatedLinearAttention
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
        shape = {"num_heads": self_attn.num_attention_heads, "head_dim": self.head_dim,
                 "feature_map": spec["feature_map"], "feature_dim": int(spec["feature_dim"]),
                 "causal": bool(getattr(config, "is_decoder", False)), "chunk_size": int(spec["chunk_size"]),
                 "device": weight.device, "dtype": weight.dtype}
        self.attention = self._make_attention(spec, shape, config, self_attn)

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillBertConfig,
                        self_attn: nn.Module) -> nn.Module:
        return LinearAttention(**shape)

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
        attended_BTD = merge_heads(self._attend(hidden_BTD, q_BHTE, k_BHTE, v_BHTE, mask_BT), hidden_BTD.dtype)
        attn_BTD = self.attention_output(attended_BTD, hidden_BTD)
        return self.output(self.intermediate(attn_BTD), attn_BTD)

    def _attend(self, hidden_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                mask_BT: torch.Tensor | None) -> torch.Tensor:
        return self.attention(q_BHTE, k_BHTE, v_BHTE, mask_BT)


class SlidingWindowLinearBlock(LinearAttentionBlock):
    """:class:`LinearAttentionBlock` with :class:`SlidingWindowLinearAttention` (no cache: encoders keep none)."""

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillBertConfig,
                        self_attn: nn.Module) -> nn.Module:
        return SlidingWindowLinearAttention(
            **shape, window=int(spec["window"]), scale=float(getattr(self_attn, "scaling", self.head_dim**-0.5)),
            window_factor_init=float(spec.get("window_factor_init", 0.0)),
        )

    def _attend(self, hidden_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                mask_BT: torch.Tensor | None) -> torch.Tensor:
        return self.attention(q_BHTE, k_BHTE, v_BHTE, mask_BT)[0]


class GatedLinearAttentionBlock(LinearAttentionBlock):
    """:class:`LinearAttentionBlock` with :class:`GatedLinearAttention`, its gate reading the layer input."""

    def _make_attention(self, spec: dict[str, Any], shape: dict[str, Any], config: DistillBertConfig,
                        self_attn: nn.Module) -> nn.Module:
        return GatedLinearAttention(**shape, hidden_size=config.hidden_size,
                                    gate_init=float(spec.get("gate_init", 0.999)))

    def _attend(self, hidden_BTD: torch.Tensor, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                mask_BT: torch.Tensor | None) -> torch.Tensor:
        return self.attention(q_BHTE, k_BHTE, v_BHTE, hidden_BTD, mask_BT)[0]


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
    """Kinds copy, pruned and lowrank: a layer of the teacher's class, run as the teacher runs it.

    Activation checkpointing reaches it through that layer, a ``GradientCheckpointingLayer``
    of the teacher's class (wrapping it again would checkpoint it twice).
    """

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


class DistillBertResidualMLP(GradientCheckpointingLayer):
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


LINEAR_BLOCKS: dict[str, type[LinearAttentionBlock]] = {
    "linear_attention": LinearAttentionBlock,
    "sliding_window_linear": SlidingWindowLinearBlock,
    "gated_linear_attention": GatedLinearAttentionBlock,
}
"""Kind -> the block of a :class:`DistillBertLinearAttentionLayer`."""


class DistillBertLinearAttentionLayer(GradientCheckpointingLayer):
    """Kinds linear_attention, sliding_window_linear, gated_linear_attention: the kind's block of ``LINEAR_BLOCKS``."""

    def __init__(self, config: DistillBertConfig, layer_idx: int) -> None:
        super().__init__()
        self.block = LINEAR_BLOCKS[config.distill_layers[str(layer_idx)]["kind"]](config, layer_idx)

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
    "sliding_window_linear": DistillBertLinearAttentionLayer,
    "gated_linear_attention": DistillBertLinearAttentionLayer,
}
"""``config.distill_layers[i]["kind"]`` -> the class of layer i."""


def teacher_class(config: DistillBertConfig, role: str) -> type[nn.Module]:
    # Copied from modeling_distill_llama.teacher_class
    """The teacher's class for ``role`` ("layer", "norm", "rotary"), from transformers.models only."""
    path = config.teacher_classes[role]
    module_name, _, class_name = path.rpartition(".")
    if not module_name.startswith(("transformers.models.", "torch.nn.modules.")):
        raise ValueError(f"teacher_classes[{role!r}]={path!r} is not a transformers class")
    return getattr(importlib.import_module(module_name), class_name)


# ---------------------------------------------------------------------- the model


class DistillBertPreTrainedModel(PreTrainedModel):
    config_class = DistillBertConfig
    config: DistillBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DistillBertTeacherLayer", "DistillBertResidualMLP", "DistillBertLinearAttentionLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        """The defaults, our parameters' start (feature maps, window weight, gate) and BERT's position-id buffers."""
        super()._init_weights(module)
        if isinstance(module, FeatureMap):
            num_heads, head_dim, feature_dim = module.weight_HEF.shape
            eye_HEF = torch.eye(head_dim, feature_dim).expand(num_heads, -1, -1)
            init.copy_(module.weight_HEF, eye_HEF.to(module.weight_HEF.dtype))
            init.zeros_(module.bias_HF)
        elif isinstance(module, SlidingWindowLinearAttention):
            init.constant_(module.window_factor_H, module.window_factor_init)
        elif isinstance(module, GatedLinearAttention):
            init.zeros_(module.gate.weight)
            init.constant_(module.gate.bias, gate_bias(module.gate_init))
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
            if str(idx) in self.config.distill_layers:  # hidden states positional: what activation checkpointing replays
                hidden_BTD = layer(hidden_BTD, attention_mask=attention_mask, position_ids=position_ids)
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
