"""The modules a stage trains, and rebuilding finished stages' replacements from their weights.

Every place that needs a trained replacement back (closed-loop inputs, the end-to-end
stage, the export at the end of a run) goes through :func:`load_stage_replacements`, so
a replacement is always rebuilt the way the stage that trained it built it.

Shape legend: B batch, T tokens, D hidden size.
"""

from __future__ import annotations

import logging

import torch
from hydra.utils import instantiate
from torch import nn

from distill.config import Config
from distill.model.teacher import Teacher
from distill.stages import Stage
from distill.train import checkpoint as ckpt
from distill.train.context import StudentContext

log = logging.getLogger(__name__)


class StageModule(nn.Module):
    """The replacements of one stage, each fed the teacher's input of its layer."""

    def __init__(self, replacements: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layer_idxs = sorted(replacements)
        self.blocks = nn.ModuleDict({str(layer): replacements[layer] for layer in self.layer_idxs})

    def forward(self, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: self.blocks[str(layer)](inputs[layer]) for layer in self.layer_idxs}


def build_replacement(cfg: Config, teacher: Teacher, layer: int) -> nn.Module:
    """Instantiate ``cfg.replacement`` for one teacher layer, trained in fp32."""
    try:
        factory = instantiate(cfg.replacement)
        return factory(teacher=teacher, layer_idx=layer).float()
    except TypeError as exc:  # an option the replacement does not take
        raise ValueError(f"replacement={cfg.replacement.get('_target_')}: {exc}; check the keys under "
                         "replacement (see conf/replacement/*.yaml for each option)") from exc


def build_stage_module(cfg: Config, teacher: Teacher, stage: Stage) -> StageModule:
    """Fresh replacements for every layer of ``stage``."""
    return StageModule({layer: build_replacement(cfg, teacher, layer) for layer in stage.layers})


def load_stage_replacements(ctx: StudentContext, stages: list[Stage]) -> dict[int, nn.Module]:
    """The trained replacements of finished ``stages``, from their weight files, in eval mode
    and frozen, on the rank's device."""
    replacements: dict[int, nn.Module] = {}
    for stage in stages:
        module = build_stage_module(ctx.cfg, ctx.teacher, stage)
        ckpt.load_stage_weights(ctx.checkpoint_dir, stage.index, module)
        module.to(ctx.device).eval().requires_grad_(False)
        for layer in stage.layers:
            replacements[layer] = module.blocks[str(layer)]
    return replacements
