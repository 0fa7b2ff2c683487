"""SlidingWindowLinearLayer: exact softmax attention over a short window, linear attention beyond it.

LoLCATs (Zhang et al. 2024, "Linearizing Large Language Models") keeps a teacher's softmax
attention exactly where it matters most, over the last ``window`` positions, and replaces
it with linear attention (a learnable Hedgehog or elu feature map, as
``replacement=linear_attention``) over every older position; both sums share one
normaliser, so each output is a single weighted average of values:

    out_t = (w sum_{window} exp(q_t . k_s / sqrt(E) - m_t) v_s + sum_{older} phi(q_t) . phi(k_s) v_s)
            / (w sum_{window} exp(q_t . k_s / sqrt(E) - m_t) + sum_{older} phi(q_t) . phi(k_s))

with ``m_t`` the largest score in the window and ``w = sigmoid(window_factor)`` a learned
per-head weight of the window against the linear part (``window_factor_init`` 0: w = 0.5,
LoLCATs' start). Everything else (q/k/v/o projections, rotary, norms, MLP) is the teacher
layer's, so with ``window`` >= the sequence length the layer is the teacher layer exactly.

Decoders: causal; the decode state is a KV ring of the last positions (transformers'
``hybrid_sliding`` cache layer) plus the linear state of everything older, fixed in size.
Encoders: the window is every position less than ``window`` away on either side
(``2 * window - 1`` positions): the same reach as a decoder's window, on both sides because
an encoder reads both; linear attention covers the farther positions in both directions.

Cost per token: the linear kernel as ``replacement=linear_attention`` plus ``window`` (or
``2 * window - 1``) exact scores and weighted values per head, independent of the context.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distill.replacements.linear_attention import AttentionSwapLayer

if TYPE_CHECKING:
    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)


class SlidingWindowLinearLayer(AttentionSwapLayer):
    """Teacher layer ``layer_idx`` with sliding-window softmax + linear attention.

    Options:
        window: positions of exact softmax attention per query (the query's own included;
            encoders: this reach on both sides). Small against the context, or the layer is
            just the teacher's attention.
        feature_map, feature_dim, chunk_size: the linear part's, as ``replacement=linear_attention``.
        window_factor_init: start of the per-head window weight's logit (0: weight 0.5).
    """

    kind = "sliding_window_linear"

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        window: int = 16,
        feature_map: str = "hedgehog",
        feature_dim: int | None = None,
        chunk_size: int = 64,
        window_factor_init: float = 0.0,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"replacement.window={window!r} must be a whole number of positions >= 1 (16 is the default)."
            )
        options = {"window": window, "window_factor_init": float(window_factor_init)}
        super().__init__(teacher, layer_idx, feature_map, feature_dim, chunk_size, options)
