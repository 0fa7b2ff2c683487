"""The end-to-end stage: after the layer stages, train the assembled student on the teacher's
next-token distribution (causal LMs) or on its final hidden state (encoders).

Layer stages train each replacement on the teacher's inputs, so their errors add up once
all are spliced in. :class:`E2ETask` is a task for :class:`~distill.train.trainer.StageTrainer`
(same data path, DDP, gradient accumulation, checkpoints and resume) whose module is the
teacher with every trained replacement spliced in (:class:`E2EStudent`) and whose loss is
the top-k KL of :func:`topk_kl` (plus an optional final-hidden NMSE term), against the
targets the workers write (:func:`distill.teacher.targets.write_e2e_targets`). Its settings
come from ``student.e2e``; it validates by held-out perplexity, also before its first step,
and keeps the weights of its best validation (:class:`~distill.train.validation.BestWeights`),
so it never ends worse than the layer stages left the student.

A teacher without an LM head (an encoder) has no next-token distribution: there the loss is
1 - cosine between the student's and the teacher's final hidden states (the metric the run
is scored by, see :mod:`distill.model.evaluate`), and the stage validates by that held-out
cosine.

Its finished weights are the whole student's state dict (LoRA merged), saved as stage
``len(layer stages)``; :func:`load_e2e_student` rebuilds the student from them for export.

Memory. The student's logits are never formed for a whole batch: the loss runs in chunks
of ``student.e2e.loss_chunk_tokens`` tokens, recomputed in backward
(:func:`chunked_topk_kl`), so it does not grow with vocabulary x batch x sequence. A
frozen base (``trainable=replacements|lora``) is the rank's teacher itself, not a copy
(:class:`E2EStudent`). With ``student.e2e.parallel=fsdp`` the trained parameters, their
gradients and optimizer state are sharded over the ranks (FSDP2, see
:func:`distill.train.context.wrap_for_training`).

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

import dataclasses
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from distill.config import Inputs, Loss, StudentConfig, Trainable
from distill.model.assemble import layer_list_name, splice
from distill.model.evaluate import metric_kind, perplexity_of
from distill.model.lora import add_lora, merge_lora
from distill.model.teacher import Teacher
from distill.stages import Stage, e2e_stage
from distill.train import checkpoint as ckpt
from distill.train.context import (
    StudentContext,
    barrier,
    broadcast_chunks,
    is_sharded,
    wrap_for_training,
)
from distill.train.counters import StageCounters
from distill.train.losses import layer_loss
from distill.train.modules import load_stage_replacements
from distill.train.stopping import with_budget
from distill.train.trainer import StageTrainer, train_stage
from distill.train.validation import Validation

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- loss
def topk_kl(student_logits_NV: torch.Tensor, teacher_logp_NK: torch.Tensor, teacher_idx_NK: torch.Tensor,
            temperature: float, renormalize_student: bool = False) -> torch.Tensor:
    """tau^2 * mean over tokens of KL(teacher top-k at tau || student at tau), in float32.

    The plain formula on logits that are all there; training goes through
    :func:`chunked_topk_kl`, which gives the same value and gradients without them.
    """
    tau = _checked_temperature(temperature)
    kl_N = _kl_per_token(student_logits_NV, teacher_logp_NK, teacher_idx_NK, tau, renormalize_student)
    return kl_N.mean() * tau * tau


def chunked_topk_kl(hidden_ND: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                    teacher_logp_NK: torch.Tensor, teacher_idx_NK: torch.Tensor, temperature: float,
                    chunk_tokens: int, renormalize_student: bool = False) -> torch.Tensor:
    """``topk_kl(logits_of(hidden_ND), ...)`` with at most ``chunk_tokens`` rows of logits at once.

    The student's logits are the largest tensor of the end-to-end stage (N x V floats: 8 x
    1024 tokens of a 128k vocabulary are 4 GiB in float32, as much as a 1B model in float32,
    and the log-softmax and its gradient as much again). Each chunk's KL runs under
    activation checkpointing, which keeps only its slice of ``hidden_ND`` for backward and
    recomputes the chunk's logits there, one chunk at a time: peak memory is a few
    chunk x V buffers in forward and in backward, at the price of a second LM-head matmul
    per chunk in backward (about 1/3 more head FLOPs).
    """
    tau = _checked_temperature(temperature)
    if chunk_tokens < 1:
        raise ValueError(f"student.e2e.loss_chunk_tokens={chunk_tokens} must be >= 1")
    num_tokens = hidden_ND.shape[0]
    total = hidden_ND.new_zeros((), dtype=torch.float32)
    for start in range(0, num_tokens, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_kl_sum, hidden_ND[rows], logits_of, teacher_logp_NK[rows],
                                   teacher_idx_NK[rows], tau, renormalize_student, use_reentrant=False)
    return total / max(num_tokens, 1) * tau * tau


def _chunk_kl_sum(hidden_CD: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                  teacher_logp_CK: torch.Tensor, teacher_idx_CK: torch.Tensor, tau: float,
                  renormalize_student: bool) -> torch.Tensor:
    """Summed KL of one chunk of tokens (the body :func:`chunked_topk_kl` checkpoints)."""
    return _kl_per_token(logits_of(hidden_CD), teacher_logp_CK, teacher_idx_CK, tau, renormalize_student).sum()


def _kl_per_token(student_logits_NV: torch.Tensor, teacher_logp_NK: torch.Tensor, teacher_idx_NK: torch.Tensor,
                  tau: float, renormalize_student: bool) -> torch.Tensor:
    """KL(teacher top-k at tau || student at tau) of each token, float32 (module docstring)."""
    logp_t_NK = torch.log_softmax(teacher_logp_NK.float() / tau, dim=-1)
    scaled_NV = student_logits_NV if tau == 1.0 else student_logits_NV.float() / tau  # tau=1: no [N, V] copy
    idx_NK = teacher_idx_NK.long()
    if renormalize_student:
        logq_NK = torch.log_softmax(scaled_NV.gather(-1, idx_NK).float(), dim=-1)
    else:  # the upcast fused into the log-softmax: no float32 copy of bf16 logits
        logq_NK = torch.log_softmax(scaled_NV, dim=-1, dtype=torch.float32).gather(-1, idx_NK)
    return (logp_t_NK.exp() * (logp_t_NK - logq_NK)).sum(-1)


def _checked_temperature(temperature: float) -> float:
    tau = float(temperature)
    if tau <= 0:
        raise ValueError(f"student.e2e.temperature={temperature} must be > 0")
    return tau


# ---------------------------------------------------------------------- the student
class E2EStudent(nn.Module):
    """The teacher with replacements spliced in; the teacher itself stays as it was.

    ``trainable`` picks what the end-to-end stage trains: the replacements' parameters,
    LoRA adapters on their linear maps, or every parameter (teacher parts included).
    With the first two the teacher's parts stay frozen and are *shared* with the teacher
    (``splice(share_weights=True)``): the rank holds its teacher once. ``all`` trains a
    copy of them, in float32 like the replacements (a bfloat16 teacher's weights would
    lose most small updates); that copy is the student being trained, not a second
    frozen teacher.
    """

    def __init__(self, teacher: Teacher, replacements: dict[int, nn.Module], trainable: str,
                 lora_rank: int = 8, lora_alpha: float = 16.0, temperature: float = 1.0,
                 loss_chunk_tokens: int = 1024) -> None:
        super().__init__()
        if trainable not in {t.value for t in Trainable}:
            raise ValueError(f"student.e2e.trainable={trainable!r}: choose one of {[t.value for t in Trainable]}")
        self.temperature = temperature
        self.loss_chunk_tokens = loss_chunk_tokens
        self.lm = metric_kind(teacher) == "lm"
        """Whether the student predicts tokens (else: an encoder, trained on its final hidden state)."""
        self.layers_name = layer_list_name(teacher)
        if trainable == Trainable.all:
            self.model = splice(teacher, replacements).float().requires_grad_(True)
        else:
            self.model = splice(teacher, replacements, share_weights=True)
        for replacement in replacements.values():
            replacement.train()
            if trainable == Trainable.lora:
                count = add_lora(replacement, lora_rank, lora_alpha)
                if count == 0:
                    raise ValueError(f"student.e2e.trainable=lora: replacement of layer {replacement.layer_idx} "
                                     "has no nn.Linear to adapt; use trainable=replacements")
            else:
                replacement.requires_grad_(True)

    def forward(self, input_ids_BT: torch.Tensor, teacher_logp_BTK: torch.Tensor | None = None,
                teacher_idx_BTK: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(top-k KL against the teacher, or None for an encoder; final hidden_BTD after the final norm).

        The loss is computed here, inside the forward that DDP / FSDP wrap, in chunks of
        tokens (:func:`chunked_topk_kl`): the [B, T, V] logits never exist.
        """
        final_BTD = self.final_hidden(input_ids_BT)
        if not self.lm:  # an encoder: its final hidden state is its output (the loss is on it)
            return None, final_BTD
        loss = chunked_topk_kl(final_BTD.flatten(0, 1), self.logits, teacher_logp_BTK.flatten(0, 1),
                               teacher_idx_BTK.flatten(0, 1), self.temperature, self.loss_chunk_tokens)
        return loss, final_BTD

    def final_hidden(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """The base model's last hidden state (after the final norm)."""
        return self.model.base_model(input_ids=input_ids_BT, use_cache=False).last_hidden_state

    def logits(self, final_BTD: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states (any leading shape)."""
        return self.model.get_output_embeddings()(final_BTD)

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def shard_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards one by one (each layer); the root takes the rest."""
        return list(self.model.get_submodule(self.layers_name))


# ---------------------------------------------------------------------- the stage
LOSS_KEY = -1
"""Key of the end-to-end loss in the per-layer loss dict the training loop passes around."""


def e2e_student_config(student_cfg: StudentConfig) -> StudentConfig:
    """The student config as the end-to-end stage sees it: its own steps, lr and batch."""
    e2e = student_cfg.e2e
    return dataclasses.replace(
        student_cfg, steps_per_stage=e2e.steps, lr=e2e.lr, warmup_steps=e2e.warmup_steps,
        micro_batch_size=e2e.micro_batch_size or student_cfg.micro_batch_size,
        max_tokens_per_stage=None, patience=0, inputs=Inputs.teacher)


class E2ETask:
    """The assembled student trained on the teacher's top-k log-probabilities (or, for an
    encoder, its final hidden state): a task for :class:`~distill.train.trainer.StageTrainer`."""

    validate_at_start = True  # the layer stages' student: kept if the stage does no better

    def __init__(self, ctx: StudentContext, stage: Stage) -> None:
        self.ctx = ctx
        self.stage = stage
        self.planned = e2e_student_config(ctx.cfg.student)
        self.cfg = with_budget(self.planned, ctx.world_size, ctx.cfg.data.seq_len)
        self.ecfg = ctx.cfg.student.e2e
        self.val_targets: list[torch.Tensor] = []

    def build(self) -> tuple[nn.Module, nn.Module]:
        """The teacher with every trained replacement spliced in, wrapped as ``e2e.parallel`` says."""
        ctx = self.ctx
        replacements = load_stage_replacements(ctx, ctx.stages)
        self.module = E2EStudent(ctx.teacher, replacements, self.ecfg.trainable, self.ecfg.lora_rank,
                                 self.ecfg.lora_alpha, self.ecfg.temperature,
                                 self.ecfg.loss_chunk_tokens).to(ctx.device)
        if ctx.leader:
            log.info("end-to-end stage: %s trainable, %d parameters, %s over %d rank(s)", self.ecfg.trainable,
                     self.module.num_trainable(), self.ecfg.parallel, ctx.world_size)
        self.model = wrap_for_training(self.module, ctx, self.ecfg.parallel)
        return self.module, self.model

    def prepare(self, start_step: int) -> None:
        """Validation is the student's held-out perplexity (an encoder's: its final-hidden cosine
        against the teacher's, whose targets are computed here once): on the leader, or on every
        rank when the student is sharded (each rank's forward takes part in gathering the weights).
        The inputs are the batch's token ids: nothing to build them from."""
        self.sharded = is_sharded(self.module)
        self.heldout_NT = broadcast_chunks(self.ctx.heldout_NT, self.ctx) if self.sharded else self.ctx.heldout_NT
        if (self.ctx.leader or self.sharded) and not self.module.lm:
            with torch.no_grad():
                self.val_targets = [self.ctx.teacher.model.base_model(input_ids=batch_BT.to(self.ctx.device))
                                    .last_hidden_state for batch_BT in self.heldout_NT.split(self.cfg.micro_batch_size)]

    def micro_step(self, batch: dict[str, torch.Tensor], accum: int) -> dict[int, float]:
        """Forward and backward of one micro-batch (gradients scaled by 1/accum); the loss under ``LOSS_KEY``."""
        device = self.ctx.device
        teacher_BTD = batch["hidden"][:, 0].to(device)
        if not self.module.lm:
            _, final_BTD = self.model(batch["input_ids"].to(device))
            loss = layer_loss(final_BTD, teacher_BTD, Loss.cosine)
        else:
            loss, final_BTD = self.model(batch["input_ids"].to(device), batch["topk_logp"].to(device),
                                         batch["topk_idx"].to(device))
            if self.ecfg.hidden_weight > 0:
                loss = loss + self.ecfg.hidden_weight * layer_loss(final_BTD, teacher_BTD, "nmse")
        (loss / accum).backward()
        return {LOSS_KEY: float(loss.detach())}

    def gradients(self) -> float:
        """One norm over the whole student: its loss is one, not a layer's own."""
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip))

    def train_record(self, step: int, losses: dict[int, float], grad_norm: float, lr: float,
                     counters: StageCounters) -> tuple[dict, dict[str, str]]:
        """An ``e2e_train`` event (not ``train``: the per-layer curves stay the layer stages')."""
        loss, rate = losses.get(LOSS_KEY, math.nan), counters.samples_per_s()
        record = {"event": "e2e_train", "stage": self.stage.index, "step": step, "loss": loss, "lr": lr,
                  "grad_norm": grad_norm, "samples_per_s": rate}
        return record, {"kl": f"{loss:.4f}", "samples_s": f"{rate:.3g}"}

    @torch.no_grad()
    def validate(self, step: int) -> Validation:
        """Held-out perplexity (or encoder cosine) of the assembled student, logged as an
        ``e2e_val`` event; scored lower-is-better (perplexity, or 1 - cosine) on the leader."""
        result = Validation()
        if (self.ctx.leader or self.sharded) and len(self.heldout_NT):
            self.module.eval()
            if self.module.lm:
                ppl = perplexity_of(self.module.final_hidden, self.module.logits, self.heldout_NT,
                                    self.cfg.micro_batch_size, self.ctx.device)
                result = Validation(ppl, {"ppl": ppl})
            else:
                cosine = self._heldout_cosine()
                result = Validation(1.0 - cosine, {"cosine": cosine})
            self.module.train()
            if self.ctx.leader:
                self.ctx.log_metrics({"event": "e2e_val", "stage": self.stage.index, "step": step,
                                      **result.record})
                log.info("end-to-end stage step %d: held-out %s", step,
                         ", ".join(f"{k} {v:.4f}" for k, v in result.record.items()))
        barrier(self.ctx)
        return result if self.ctx.leader else Validation()

    def _heldout_cosine(self) -> float:
        """Mean per-token cosine of the student's final hidden states against the teacher's."""
        total, count = 0.0, 0
        for batch_BT, teacher_BTD in zip(self.heldout_NT.split(self.cfg.micro_batch_size), self.val_targets,
                                         strict=True):
            student_BTD = self.module.final_hidden(batch_BT.to(self.ctx.device))
            total += F.cosine_similarity(student_BTD.float(), teacher_BTD.float(), dim=-1).sum().item()
            count += batch_BT.numel()
        return total / max(1, count)

    def finish(self) -> None:
        """Fold LoRA into plain linear maps: the stage's weights are a plain student's."""
        merge_lora(self.module)

    def progress_name(self) -> str:
        return f"stage {self.stage.index} end-to-end"


def run_e2e_stage(ctx: StudentContext, finished: set[int]) -> None:
    """Train the end-to-end stage unless a previous run already finished it."""
    stage = e2e_stage(ctx.stages)
    if stage.index in finished:
        log.info("end-to-end stage %d already trained: skipping", stage.index)
        return
    train_stage(StageTrainer(ctx, E2ETask(ctx, stage)))


# ---------------------------------------------------------------------- after training
def e2e_finished(ctx: StudentContext) -> bool:
    return ctx.cfg.student.e2e.steps > 0 and \
        e2e_stage(ctx.stages).index in ckpt.read_progress(ctx.checkpoint_dir)["finished"]


def load_e2e_student(ctx: StudentContext) -> tuple[Teacher, dict[int, nn.Module]]:
    """(base, replacements) of the end-to-end-trained student, ready for export and evaluation.

    ``base`` is the teacher, or with ``trainable=all`` the trained student's own model (its
    trained embeddings, kept layers and head), so no further copy is made; the replaced
    layers' places get the teacher's own layers back (frozen, never run: export and scoring
    put the replacements in by index, and the native export reads the layers' class there).
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
    layers = student.model.get_submodule(student.layers_name)
    for idx in replacements:
        layers[idx] = ctx.teacher.layers[idx]
    return Teacher(student.model, device=ctx.device), replacements
