"""The end-to-end stage of a run: after the layer stages, train the assembled student.

:class:`E2ETrainer` is a :class:`~distill.student.StageTrainer` (same data path, DDP,
gradient accumulation, checkpoints and resume) whose model is the teacher with every
trained replacement spliced in (:class:`~distill.e2e.E2EStudent`) and whose loss is the
top-k KL of :func:`~distill.e2e.topk_kl` (plus an optional final-hidden NMSE term).
Its settings come from ``student.e2e``; it validates by held-out perplexity.

Its finished weights are the whole student's state dict (LoRA merged), saved as stage
``len(layer stages)``; :func:`load_e2e_student` rebuilds the student from them for export.

Shape legend: B batch, T tokens, D hidden size, V vocabulary, K top-k.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distill import checkpoint as ckpt
from distill.closed_loop import load_stage_replacements
from distill.e2e import E2EStudent, topk_kl
from distill.evaluate import _student_layers, evaluate, metric_kind, perplexity
from distill.lora import merge_lora
from distill.stages import Stage, e2e_stage
from distill.student import StageTrainer, StudentContext, _barrier, layer_loss, train_stage
from distill.teacher import Teacher

log = logging.getLogger(__name__)

LOSS_KEY = -1
"""Key of the end-to-end loss in the per-layer loss dict the training loop passes around."""


def e2e_student_config(student_cfg: DictConfig) -> DictConfig:
    """The student config as the end-to-end stage sees it: its own steps, lr and batch."""
    e2e = student_cfg.e2e
    return OmegaConf.merge(student_cfg, {
        "steps_per_stage": e2e.steps, "lr": e2e.lr, "warmup_steps": e2e.warmup_steps,
        "micro_batch_size": e2e.micro_batch_size or student_cfg.micro_batch_size,
        "max_tokens_per_stage": None, "patience": 0, "inputs": "teacher"})


class E2ETrainer(StageTrainer):
    """Trains the assembled student on the teacher's top-k log-probabilities."""

    def __init__(self, ctx: StudentContext, stage: Stage) -> None:
        super().__init__(ctx, stage)
        self.scfg = e2e_student_config(ctx.cfg.student)
        self.ecfg = ctx.cfg.student.e2e

    def _setup_model(self) -> None:
        ctx = self.ctx
        if metric_kind(ctx.teacher) != "lm":
            raise ValueError(f"student.e2e.steps={self.ecfg.steps} needs a teacher with an LM head; "
                             f"{ctx.teacher.name_or_path} has none: set student.e2e.steps=0")
        torch.manual_seed(self.scfg.seed + self.stage.index)
        replacements = load_stage_replacements(ctx, ctx.stages)
        self.module = E2EStudent(ctx.teacher, replacements, self.ecfg.trainable, self.ecfg.lora_rank,
                                 self.ecfg.lora_alpha).to(ctx.device)
        if ctx.leader:
            log.info("end-to-end stage: %s trainable, %d parameters", self.ecfg.trainable,
                     self.module.num_trainable())
        if ctx.world_size > 1:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.model: nn.Module = DDP(self.module, device_ids=device_ids)
        else:
            self.model = self.module

    def _setup_validation(self) -> None:
        """Validation is the student's held-out perplexity (leader only)."""
        self.val_pairs = {}

    def _setup_inputs(self) -> None:
        self.closed_loop = None

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[int, float]]:
        device = self.ctx.device
        logits_BTV, final_BTD = self.model(batch["input_ids"].to(device))
        loss = topk_kl(logits_BTV.flatten(0, 1), batch["topk_logp"].to(device).flatten(0, 1),
                       batch["topk_idx"].to(device).flatten(0, 1), self.ecfg.temperature)
        if self.ecfg.hidden_weight > 0:
            teacher_BTD = batch["hidden"][:, 0].to(device)
            loss = loss + self.ecfg.hidden_weight * layer_loss(final_BTD, teacher_BTD, "nmse")
        return loss, {LOSS_KEY: float(loss.detach())}

    def _log_train(self, step: int, losses: dict[int, float], grad_norm: float, samples: int,
                   started: float, wait_s: float, compute_s: float, bar: Any) -> None:
        """An ``e2e_train`` event (not ``train``: the per-layer curves stay the layer stages')."""
        elapsed = max(time.monotonic() - started, 1e-9)
        loss = losses.get(LOSS_KEY, math.nan)
        bar.set_postfix(kl=f"{loss:.4f}", samples_s=f"{samples * self.ctx.world_size / elapsed:.0f}")
        self.ctx.log_metrics({"event": "e2e_train", "stage": self.stage.index, "step": step, "loss": loss,
                              "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                              "samples_per_s": samples * self.ctx.world_size / elapsed})

    @torch.no_grad()
    def validate(self, step: int) -> dict[int, float]:
        """Held-out perplexity of the assembled student, logged as an ``e2e_val`` event."""
        if self.ctx.leader and len(self.ctx.heldout_NT):
            self.module.eval()
            nll, tokens = 0.0, 0
            for batch_BT in self.ctx.heldout_NT.split(self.scfg.micro_batch_size):
                batch_BT = batch_BT.to(self.ctx.device)
                logits_BTV, _ = self.module(batch_BT)
                nll += torch.nn.functional.cross_entropy(
                    logits_BTV[:, :-1].flatten(0, 1).float(), batch_BT[:, 1:].flatten(), reduction="sum").item()
                tokens += batch_BT[:, 1:].numel()
            self.module.train()
            ppl = math.exp(nll / tokens)
            self.ctx.log_metrics({"event": "e2e_val", "stage": self.stage.index, "step": step, "ppl": ppl})
            log.info("end-to-end stage step %d: held-out perplexity %.4f", step, ppl)
        _barrier(self.ctx)
        return {}

    def finish(self) -> None:
        """Fold LoRA into plain linear maps, then record the stage like a layer stage."""
        merge_lora(self.module)
        super().finish()


def run_e2e_stage(ctx: StudentContext, finished: set[int]) -> None:
    """Train the end-to-end stage unless a previous run already finished it."""
    stage = e2e_stage(ctx.stages)
    if stage.index in finished:
        log.info("end-to-end stage %d already trained: skipping", stage.index)
        return
    train_stage(E2ETrainer(ctx, stage))


# ---------------------------------------------------------------------- after training
def e2e_finished(ctx: StudentContext) -> bool:
    return ctx.cfg.student.e2e.steps > 0 and \
        e2e_stage(ctx.stages).index in ckpt.read_progress(ctx.checkpoint_dir)["finished"]


def load_e2e_student(ctx: StudentContext) -> tuple[Teacher, dict[int, nn.Module]]:
    """(base, replacements) of the end-to-end-trained student, ready for export and evaluation.

    ``base`` is the teacher, or with ``trainable=all`` a copy carrying the trained
    teacher-side weights (embeddings, kept layers, head).
    """
    trainable = ctx.cfg.student.e2e.trainable
    replacements = load_stage_replacements(ctx, ctx.stages)
    student = E2EStudent(ctx.teacher, replacements, "replacements" if trainable == "lora" else trainable)
    ckpt.load_stage_weights(ctx.checkpoint_dir, e2e_stage(ctx.stages).index, student)
    for replacement in replacements.values():
        replacement.eval().requires_grad_(False)
    if trainable != "all":
        return ctx.teacher, replacements
    model = copy.deepcopy(ctx.teacher.model)
    own = set(model.state_dict())
    model.load_state_dict({k: v for k, v in student.model.state_dict().items() if k in own}, strict=False)
    return Teacher(model, device=ctx.device), replacements


def student_score(base: Teacher, replacements: dict[int, nn.Module], heldout_NT: torch.Tensor,
                  batch_size: int) -> float:
    """Held-out perplexity (LM teachers) or final-hidden cosine of ``base`` with ``replacements``."""
    if metric_kind(base) == "lm":
        return perplexity(base, _student_layers(base, replacements), heldout_NT, batch_size)
    return evaluate(base, replacements, heldout_NT, batch_size).student

