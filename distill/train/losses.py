"""The layer-stage loss, shared by the trainer, its validation and the end-to-end stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distill.config import Loss


def layer_loss(pred_BTD: torch.Tensor, target_BTD: torch.Tensor, kind: str) -> torch.Tensor:
    """``nmse``: MSE(s, t) / MSE(t, 0) in fp32 (scale-free across layers); ``cosine``: 1 - cos."""
    pred, target = pred_BTD.float(), target_BTD.float()
    if kind == Loss.nmse:
        return (pred - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)
    if kind == Loss.cosine:
        return 1.0 - F.cosine_similarity(pred, target, dim=-1).mean()
    raise ValueError(f"student.loss={kind!r}: choose one of {[k.value for k in Loss]}")
