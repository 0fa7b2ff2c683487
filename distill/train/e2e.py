"""The end-to-end stage: after the layer stages, train the assembled student on the teacher's
next-token distribution (causal LMs) or on its final hidden state (encoders).

Layer stages train each replacement on the teacher's inputs, so their errors add up once
all are spliced in. :class:`E2ETrainer` is a :class:`~distill.train.trainer.StageTrainer`
(same data path, DDP, gradient accumulation, checkpoints and resume) whose model is the
teacher with every trained replacement spliced in (:class:`E2EStudent`) and whose loss is
the top-k KL of :func:`topk_kl` (plus an optional final-hidden NMSE term), against the
targets the workers write (:func:`distill.train.targets.write_e2e_targets`). Its settings
come from ``student.e2e``; it validates by held-out perplexity, and keeps the weights of
its best validation (:class:`~distill.train.validation.BestWeights`).

A teacher without an LM head (an encoder) has no next-token distribution: there the loss is
1 - cosine between the student's and the teacher's final hidden states (the metric the
run is scored by, see :mod:`distill.model.evaluate`), and the stage validates by that
held-out cosine.

Its finished weights are the whole student's state dict (LoRA merged), saved as stage
``len(layer stages)``; :func:`load_e2e_student` rebuilds the student from them for export.

The loss, and why this form. Only k of V log-probabilities travel, so the teacher's
distribution is known on its top k only. We renormalise it there at temperature tau:
``p = softmax(logp_topk / tau)``, which is exactly ``softmax(logits / tau)`` restricted
to the top k and renormalised (log_softmax differs from the logits by a per-token
constant). The student's log-probabilities are taken over the *full* vocabulary,
``log q = log_softmax(student_logits / tau)`` gathered at the k ids, so

    loss = tau^2 * mean_tokens sum_k p_k (log p_k - log q_k)

is KL(p || q_renormalised) - log q(top k): it matches the teacher's shape on its top k
*and* penalises student mass outside them (renormalising q as well would let that mass
leak for free; ``renormalize_student=True`` gives that variant). It is >= 0 and 0 iff the
student puts all its mass on the teacher's top k, in the teacher's proportions. The tau^2
factor keeps gradient sizes comparable across temperatures (Hinton et al. 2015).

Shape legend: B batch, T tokens, D hidden size, V vocabulary, K top-k, N tokens (B*T).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from distill.config import Loss, Trainable
from distill.model.assemble import splice
from distill.model.evaluate import metric_kind, perplexity_of
from distill.model.lora import add_lora, merge_lora
from distill.model.teacher import Teacher
from distill.train import checkpoint as ckpt
from distill.train.context import StudentContext, barrier, wrap_for_training
from distill.train.losses import layer_loss
from distill.train.modules import load_stage_replacements
from distill.train.stages import Stage, e2e_stage
from distill.train.trainer import StageTrainer, train_stage
from distill.train.validation import Validation

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- loss
def topk_kl(student_logits_NV: torch.Tensor, teacher_logp_NK: torch.Tensor, teacher_idx_NK: torch.Tensor,
            temperature: float, renormalize_student: bool = False) -> torch.Tensor:
    """tau^2 * mean over tokens of KL(teacher top-k at tau || student at tau), in float32."""
    tau = float(temperature)
    if tau <= 0:
        raise ValueError(f"student.e2e.temperature={temperature} must be > 0")
    logp_t_NK = torch.log_softmax(teacher_logp_NK.float() / tau, dim=-1)
    scaled_NV = student_logits_NV.float() / tau
    idx_NK = teacher_idx_NK.long()
    if renormalize_student:
        logq_NK = torch.log_softmax(scaled_NV.gather(-1, idx_NK), dim=-1)
    else:
        logq_NK = torch.log_softmax(scaled_NV, dim=-1).gather(-1, idx_NK)
    kl_N = (logp_t_NK.exp() * (logp_t_NK - logq_NK)).sum(-1)
    return kl_N.mean() * tau * tau


# ---------------------------------------------------------------------- the student
class E2EStudent(nn.Module):
    """The teacher with replacements spliced in (a copy: the teacher itself stays frozen).

    ``trainable`` picks what the end-to-end stage trains: the replacements' parameters,
    LoRA adapters on their linear maps, or every parameter (teacher parts included).
    """

    def __init__(self, teacher: Teacher, replacements: dict[int, nn.Module], trainable: str,
                 lora_rank: int = 8, lora_alpha: float = 16.0) -> None:
        super().__init__()
        if trainable not in {t.value for t in Trainable}:
            raise ValueError(f"student.e2e.trainable={trainable!r}: choose one of {[t.value for t in Trainable]}")
        self.lm = metric_kind(teacher) == "lm"
        """Whether the student predicts tokens (else: an encoder, trained on its final hidden state)."""
        self.model = splice(teacher, replacements)
        self.model.requires_grad_(trainable == Trainable.all)
        for replacement in replacements.values():
            replacement.train()
            if trainable == Trainable.lora:
                count = add_lora(replacement, lora_rank, lora_alpha)
                if count == 0:
                    raise ValueError(f"student.e2e.trainable=lora: replacement of layer {replacement.layer_idx} "
                                     "has no nn.Linear to adapt; use trainable=replacements")
            else:
                replacement.requires_grad_(True)

    def forward(self, input_ids_BT: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits_BTV, or None for an encoder; final hidden_BTD after the final norm)."""
        final_BTD = self.final_hidden(input_ids_BT)
        return (self.logits(final_BTD) if self.lm else None), final_BTD

    def final_hidden(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """The base model's last hidden state (after the final norm)."""
        return self.model.base_model(input_ids=input_ids_BT, use_cache=False).last_hidden_state

    def logits(self, final_BTD: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states (any leading shape)."""
        return self.model.get_output_embeddings()(final_BTD)

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


# ---------------------------------------------------------------------- the stage
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
    """Trains the assembled student on the teacher's top-k log-probabilities (or, for an
    encoder, its final hidden state)."""

    validate_at_start = True  # the layer stages' student: kept if the stage does no better

    def __init__(self, ctx: StudentContext, stage: Stage) -> None:
        super().__init__(ctx, stage, e2e_student_config(ctx.cfg.student))
        self.ecfg = ctx.cfg.student.e2e
        self.val_targets: list[torch.Tensor] = []

    def _setup_model(self) -> None:
        ctx = self.ctx
        torch.manual_seed(self.scfg.seed + self.stage.index)
        replacements = load_stage_replacements(ctx, ctx.stages)
        self.module = E2EStudent(ctx.teacher, replacements, self.ecfg.trainable, self.ecfg.lora_rank,
                                 self.ecfg.lora_alpha).to(ctx.device)
        if ctx.leader:
            log.info("end-to-end stage: %s trainable, %d parameters", self.ecfg.trainable,
                     self.module.num_trainable())
        self.model = wrap_for_training(self.module, ctx)

    def _earlier_replacements(self) -> dict[int, nn.Module]:
        return {}  # the student is whole: nothing to build its inputs from

    def _setup_validation(self, frozen: dict[int, nn.Module]) -> None:
        """Validation is the student's held-out perplexity, or for an encoder its final-hidden
        cosine against the teacher's, computed here once (leader only)."""
        ctx = self.ctx
        if ctx.leader and not self.module.lm:
            with torch.no_grad():
                self.val_targets = [ctx.teacher.model.base_model(input_ids=batch_BT.to(ctx.device)).last_hidden_state
                                    for batch_BT in ctx.heldout_NT.split(self.scfg.micro_batch_size)]

    def _setup_inputs(self, frozen: dict[int, nn.Module]) -> None:
        self.closed_loop = None

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[int, float]]:
        device = self.ctx.device
        logits_BTV, final_BTD = self.model(batch["input_ids"].to(device))
        teacher_BTD = batch["hidden"][:, 0].to(device)
        if logits_BTV is None:  # an encoder: its final hidden state is its output
            loss = layer_loss(final_BTD, teacher_BTD, Loss.cosine)
            return loss, {LOSS_KEY: float(loss.detach())}
        loss = topk_kl(logits_BTV.flatten(0, 1), batch["topk_logp"].to(device).flatten(0, 1),
                       batch["topk_idx"].to(device).flatten(0, 1), self.ecfg.temperature)
        if self.ecfg.hidden_weight > 0:
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
    def validate(self, step: int) -> Validation:
        """Held-out perplexity (or encoder cosine) of the assembled student, logged as an
        ``e2e_val`` event; scored lower-is-better (perplexity, or 1 - cosine)."""
        result = Validation()
        if self.ctx.leader and len(self.ctx.heldout_NT):
            self.module.eval()
            if self.module.lm:
                ppl = perplexity_of(self.module.final_hidden, self.module.logits, self.ctx.heldout_NT,
                                    self.scfg.micro_batch_size, self.ctx.device)
                result = Validation(ppl, {"ppl": ppl})
            else:
                cosine = self._heldout_cosine()
                result = Validation(1.0 - cosine, {"cosine": cosine})
            self.module.train()
            self.ctx.log_metrics({"event": "e2e_val", "stage": self.stage.index, "step": step, **result.record})
            log.info("end-to-end stage step %d: held-out %s", step,
                     ", ".join(f"{k} {v:.4f}" for k, v in result.record.items()))
        barrier(self.ctx)
        return result

    def _heldout_cosine(self) -> float:
        """Mean per-token cosine of the student's final hidden states against the teacher's."""
        total, count = 0.0, 0
        for batch_BT, teacher_BTD in zip(self.ctx.heldout_NT.split(self.scfg.micro_batch_size),
                                         self.val_targets, strict=True):
            student_BTD = self.module.final_hidden(batch_BT.to(self.ctx.device))
            total += F.cosine_similarity(student_BTD.float(), teacher_BTD.float(), dim=-1).sum().item()
            count += batch_BT.numel()
        return total / max(1, count)

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
    student = E2EStudent(ctx.teacher, replacements,
                         Trainable.replacements if trainable == Trainable.lora else trainable)
    ckpt.load_stage_weights(ctx.checkpoint_dir, e2e_stage(ctx.stages).index, student)
    for replacement in replacements.values():
        replacement.eval().requires_grad_(False)
    if trainable != Trainable.all:
        return ctx.teacher, replacements
    model = copy.deepcopy(ctx.teacher.model)
    own = set(model.state_dict())
    model.load_state_dict({k: v for k, v in student.model.state_dict().items() if k in own}, strict=False)
    return Teacher(model, device=ctx.device), replacements
