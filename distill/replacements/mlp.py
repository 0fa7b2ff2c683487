"""ResidualMLP: a token-wise residual MLP standing in for a whole teacher layer.

The cheapest replacement there is: no token mixing, so it can only learn what a layer
does to each token on its own. It starts as (nearly) the identity, which is what a layer
whose residual update is small already is, so training starts from a sensible point.

Shape legend: B batch, T sequence length, D hidden size, H MLP hidden units.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from distill.model.modeling.modeling_distill_llama import store_state
from distill.replacements import check_layer_idx, linear_flops_per_token

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

DEFAULT_NORM_EPS = 1e-6


class ResidualMLP(nn.Module):
    """``x + W2 act(W1 norm(x))`` with ``W2`` initialised small so it starts near identity.

    Options:
        hidden_mult: MLP hidden units as a multiple of the teacher's hidden size.
        activation: a name from ``transformers.activations.ACT2FN``.
        output_init_std: std of the output projection's initial weights; 0 makes the
            module exactly the identity at init (then ``W1`` gets no gradient on the
            first step, which is why the default is small rather than zero).
    """

    def __init__(
        self,
        teacher: Teacher,
        layer_idx: int,
        hidden_mult: float = 2.0,
        activation: str = "gelu",
        output_init_std: float = 1e-3,
    ) -> None:
        super().__init__()
        check_layer_idx(teacher, layer_idx)
        _check_options(hidden_mult, activation, output_init_std)
        self.layer_idx = layer_idx
        hidden_size = teacher.hidden_size
        num_units = max(1, round(hidden_mult * hidden_size))
        factory = {"device": teacher.device, "dtype": teacher.dtype}
        self.norm = _make_norm(teacher, **factory)
        self.up = nn.Linear(hidden_size, num_units, **factory)
        self.act = ACT2FN[activation]
        self.activation = activation
        self.down = nn.Linear(num_units, hidden_size, **factory)
        nn.init.normal_(self.down.weight, std=output_init_std)
        nn.init.zeros_(self.down.bias)

    def forward(
        self,
        hidden_BTD: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Add the MLP's update to the residual stream, token by token (padding is irrelevant;
        a cache only counts the positions)."""
        store_state(cache, self.layer_idx, None, hidden_BTD.shape[1])
        update_BTH = self.act(self.up(self.norm(hidden_BTD)))
        return hidden_BTD + self.down(update_BTH)

    def layer_spec(self) -> dict[str, Any]:
        """Sizes, activation and norm of the MLP, as the exported student rebuilds it."""
        norm = "layer" if isinstance(self.norm, nn.LayerNorm) else "rms"
        return {"kind": "mlp", "hidden_units": self.up.out_features, "activation": self.activation,
                "norm": norm, "norm_eps": float(self.norm.eps)}

    def flops_per_token(self, seq_len: int) -> int:
        """Two matmuls per token; independent of ``seq_len`` (no token mixing)."""
        return linear_flops_per_token(self)


def _check_options(hidden_mult: float, activation: str, output_init_std: float) -> None:
    """Reject options that cannot build a working MLP, naming the key to change."""
    if hidden_mult <= 0:
        raise ValueError(
            f"replacement.hidden_mult={hidden_mult} must be > 0; try 2.0 (hidden units = "
            "hidden_mult * teacher hidden size)."
        )
    if activation not in ACT2FN:
        raise ValueError(
            f"replacement.activation={activation!r} is not a known activation; use one of "
            f"{sorted(ACT2FN)[:12]}... (e.g. 'gelu' or 'silu')."
        )
    if output_init_std < 0:
        raise ValueError(
            f"replacement.output_init_std={output_init_std} must be >= 0; use 0 for an exact "
            "identity at init or a small value such as 1e-3."
        )


def _make_norm(teacher: Teacher, **factory: object) -> nn.Module:
    """Pick the teacher family's own norm so inputs are scaled the way the layer saw them."""
    config = teacher.model.config
    if teacher.family == "bert":
        return nn.LayerNorm(teacher.hidden_size, eps=config.layer_norm_eps, **factory)
    eps = getattr(config, "rms_norm_eps", DEFAULT_NORM_EPS)
    return nn.RMSNorm(teacher.hidden_size, eps=eps, **factory)
