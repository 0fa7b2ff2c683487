"""GatedDeltaRuleLayer: the teacher layer with softmax attention swapped for the gated delta rule.

Linear attention adds every key's value to its state, so associations pile up and recall
blurs as the context grows. The delta rule (Schlag et al. 2021; gated: Yang et al. 2025,
Gated DeltaNet) corrects instead: before writing ``v_t`` under key ``k_t`` it removes a fraction
``b_t`` of what the state held under that key, and a gate ``a_t`` decays the whole state,

    S_t = a_t (S_{t-1} - b_t k_t (k_t^T S_{t-1})) + b_t k_t v_t^T,      out_t = S_t^T q_t,

queries and keys scaled to length 1. It is the mixer that keeps long-context recall best in
published linearisation studies. ``a_t`` and ``b_t`` come per head from the layer's normed
input (two ``D x H`` maps starting at zero, biases at ``logit(gate_init)`` and
``logit(beta_init)``); queries, keys and values are the teacher's own projections (after
rotary), so only the two gates start from scratch. Projections, norms and MLP as
``replacement=linear_attention``.

Decoders train a chunked form (one unit lower triangular solve per chunk turns the T steps
into matrix products; exact, every decay ratio at most 1) and decode recurrently, the state
(``E x E`` per head, fixed in size) in the cache's ``linear_attention`` layer. Causal only:
encoders are refused. Its chunks are carried by a loop, so ``torch.export``/ONNX refuse it
(a traced graph would keep the example's length). Plain PyTorch.

Shape legend: B batch, T sequence length, D hidden size, H heads, E head size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distill.replacements.linear_attention import AttentionSwapLayer

if TYPE_CHECKING:
    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)


class GatedDeltaRuleLayer(AttentionSwapLayer):
    """Teacher layer ``layer_idx`` with the gated delta rule (decoders).

    Options:
        gate_init: the decay every head starts with, in (0, 1); near 1 keeps a long memory.
        beta_init: the write strength every head starts with, in (0, 1): the fraction of what
            is stored under a key that a new value replaces.
        chunk_size: positions per chunk of the causal kernel.
    """

    kind = "gated_delta_rule"

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        gate_init: float = 0.999,
        beta_init: float = 0.5,
        chunk_size: int = 64,
    ) -> None:
        for name, value in (("gate_init", gate_init), ("beta_init", beta_init)):
            if not 0.0 < value < 1.0:
                raise ValueError(f"replacement.{name}={value} must be in (0, 1).")
        super().__init__(teacher, layer_idx, None, None, chunk_size,
                         {"gate_init": float(gate_init), "beta_init": float(beta_init)})
