"""Low-rank adapters (LoRA, Hu et al. 2021) for the ``nn.Linear`` maps of a replacement.

The end-to-end stage can train only a low-rank update ``W + (alpha / r) * B @ A`` of every
linear map in the replacements instead of all their weights: fewer trainable parameters
and optimizer state, and the update starts at zero (B = 0), so the stage starts exactly
from the layer-wise student. ``merge_lora`` folds the update back into plain
``nn.Linear`` modules, so an exported student has the architecture its config rebuilds.

Our own ~60 lines rather than ``peft``: we only wrap ``nn.Linear`` inside modules we own,
need no adapter registry or saving format, and keep the dependency list short.

Shape legend: N any leading dims, I in_features, O out_features, R rank.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with ``base`` frozen; B starts at zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"student.e2e.lora_rank={rank} must be >= 1")
        self.base = base
        self.base.requires_grad_(False)
        weight = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear initialises its weight
        self.scale = alpha / rank

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        return self.base(x_NI) + F.linear(F.linear(x_NI, self.lora_A), self.lora_B) * self.scale

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing the same map (weight += scale * B @ A), trainable."""
        linear = copy.deepcopy(self.base)
        with torch.no_grad():
            linear.weight += (self.lora_B @ self.lora_A) * self.scale
        return linear.requires_grad_(True)


def add_lora(module: nn.Module, rank: int, alpha: float) -> int:
    """Wrap every ``nn.Linear`` under ``module`` in a :class:`LoRALinear`; freeze the rest.

    Returns how many maps were wrapped. Parameters outside linear maps (norms, feature
    maps' non-linear parts) are frozen too: with LoRA only the adapters train.
    """
    module.requires_grad_(False)
    targets = [(parent, name, child) for parent in module.modules() if not isinstance(parent, LoRALinear)
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, LoRALinear(child, rank, alpha))
    return len(targets)


def merge_lora(module: nn.Module) -> int:
    """Replace every :class:`LoRALinear` under ``module`` by its merged ``nn.Linear``."""
    targets = [(parent, name, child) for parent in module.modules()
               for name, child in parent.named_children() if isinstance(child, LoRALinear)]
    for parent, name, child in targets:
        setattr(parent, name, child.merged())
    return len(targets)
