"""GatedLinearAttentionLayer: linear attention whose state forgets, at a rate the input decides.

Linear attention keeps ``S = sum_s phi(k_s) [v_s, 1]^T`` and weighs every past position
alike, however far back; softmax attention is mostly local. Gated linear attention (Yang et
al. 2024; the gated-delta-rule family, Mamba2 and RetNet decay states the same way) multiplies
the state by a per-head gate ``g_t in (0, 1)`` before each update,

    S_t = g_t S_{t-1} + phi(k_t) [v_t, 1]^T,      out_t = phi(q_t) S_t[:, :E] / phi(q_t) S_t[:, E],

so the normaliser decays with the values and each output stays a weighted average, recent
positions weighing more where the gate closes. ``g_t = sigmoid(x_t W + b)`` per head, ``x_t``
the layer's normed input (one ``D x H`` map); ``W`` starts at zero and ``b`` at
``logit(gate_init)``, so with ``gate_init`` near 1 the layer starts at (nearly) the
teacher-initialised linear attention of ``replacement=linear_attention`` and training makes
the decay depend on the input. Feature maps, projections, rotary, norms and MLP as there.

Decoders train a chunked form (decays inside a chunk from its own cumulative log-gates, the
state entering each chunk from every earlier chunk's keys through a matrix of decays, each at
most 1: nothing overflows, and no loop, so traced graphs hold for any length) and decode recurrently, the state
in the cache's ``linear_attention`` layer, fixed in size. Encoders: keys on both sides, each
decayed by the gates between it and the query (two causal passes, one over the reversed
sequence). Plain PyTorch; no kernel library is needed (nor used).

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distill.replacements.linear_attention import AttentionSwapLayer

if TYPE_CHECKING:
    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)


class GatedLinearAttentionLayer(AttentionSwapLayer):
    """Teacher layer ``layer_idx`` with gated linear attention.

    Options:
        gate_init: the decay every head starts with, in (0, 1); near 1 starts the layer at
            ungated linear attention, lower starts it more local.
        feature_map, feature_dim, chunk_size: as ``replacement=linear_attention``.
    """

    kind = "gated_linear_attention"

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        gate_init: float = 0.999,
        feature_map: str = "hedgehog",
        feature_dim: int | None = None,
        chunk_size: int = 64,
    ) -> None:
        if not 0.0 < gate_init < 1.0:
            raise ValueError(f"replacement.gate_init={gate_init} must be in (0, 1); 0.999 starts near linear attention.")
        super().__init__(teacher, layer_idx, feature_map, feature_dim, chunk_size, {"gate_init": float(gate_init)})
