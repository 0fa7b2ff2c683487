"""What a teacher worker writes for a stage: the worker's batch function.

For a layer stage (model_cfg ``{"layers": [...]}``) each request id picks a training
chunk; the worker runs ONE batched forward over all chunks of the WORK it holds,
stopping after the last target layer, and copies each sample's boundary hidden
states straight into its slot (one copy, no intermediate bytes). On CUDA the
device-to-host copies go through pinned staging buffers on a side stream and are
finished by the worker after it has started the next forward (``distill.teacher.transfer``).

For the end-to-end stage (:func:`write_e2e_targets`) it runs one full forward and writes,
per sample, the top-k log-probabilities ``log_softmax(logits)`` with their token ids
([T, k]) and the final hidden state (after the final norm) in ``hidden[0]``; the loss that
reads them is :func:`distill.train.e2e.topk_kl`.

Shape legend: B batch, T tokens, D hidden size, V vocabulary, K top-k.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from distill.config import Config
from distill.model.data import sample_indices
from distill.model.teacher import Teacher
from distill.pipeline import SlotTarget
from distill.stages import Stage
from distill.teacher.transfer import DeviceToSlots

log = logging.getLogger(__name__)


SEED_STRIDE = 1_000_003
"""Mixes ``student.seed`` into the sample order (a prime, so nearby seeds give unrelated orders)."""


def sample_seed(cfg: Config) -> int:
    """Seed of the training-sample order: ``data.seed`` mixed with ``student.seed``, so a run with
    another ``student.seed`` trains on another order of the same chunks as well as from another
    init (``student.seed=0`` keeps the order of ``data.seed`` alone). The held-out split depends
    on ``data.seed`` only."""
    return int(cfg.data.seed) + SEED_STRIDE * int(cfg.student.seed)


class TeacherTargets:
    """The worker's batch function: chunks -> truncated teacher forward -> slots."""

    def __init__(self, teacher: Teacher, train_NT: torch.Tensor, seed: int) -> None:
        self.teacher = teacher
        self.train_NT = train_NT
        self.seed = seed
        self.samples = 0
        self.to_slots = DeviceToSlots(teacher.devices)
        """On CUDA: pinned, side-stream copies that the worker finishes after the next forward
        (one side stream per GPU of a teacher spread over several)."""

    def __call__(self, model_id: str, model_cfg: dict | None,
                 targets: list[SlotTarget]) -> Callable[[], None] | None:
        """Fill ``targets``; on CUDA return the callable that completes the device copies."""
        stage = Stage.from_model_cfg(model_cfg)
        rows = sample_indices(len(self.train_NT), [t.request_id for t in targets], self.seed)
        input_ids_BT = self.train_NT[rows]
        if stage.kind == "e2e":
            write_e2e_targets(self.teacher, input_ids_BT, targets)
            self.samples += len(targets)
            return None
        if stage.joint:  # the student runs the chain: only what enters layer 0
            states = [self.teacher.embed(input_ids_BT)]
        else:
            captured = self.teacher.capture(input_ids_BT, stage.captured_layers)
            states = [_state_at(captured, p) for p in stage.positions]
        for i, target in enumerate(targets):
            target.tensors["input_ids"].copy_(input_ids_BT[i])
        self.samples += len(targets)
        finish = self.to_slots.start(states, [target.tensors["hidden"] for target in targets])
        return finish if self.to_slots.cuda else None


class SleepingTeacher:
    """A synthetic slow teacher (``teacher.sleep_per_batch_s``): every batch takes at least
    ``batch_s``, the worker sleeping what the wrapped teacher's forward did not take.

    Why: "add teacher workers" is the advice for a teacher-bound run, and whether it holds is
    measured on machines without GPUs. A GPU teacher's forward costs the host almost no CPU (it
    waits on the device), so N of them run side by side; N CPU forwards would instead share the
    cores with the students. Sleeping is what the host sees of a GPU forward. The samples are
    the wrapped teacher's own, so the students train as usual.
    """

    def __init__(self, batch_fn: Callable, batch_s: float) -> None:
        self.batch_fn = batch_fn
        self.batch_s = batch_s

    def __call__(self, model_id: str, model_cfg: dict | None,
                 targets: list[SlotTarget]) -> Callable[[], None] | None:
        started = time.perf_counter()
        finish = self.batch_fn(model_id, model_cfg, targets)
        left = self.batch_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return finish


def _state_at(captured: dict[int, tuple[torch.Tensor, torch.Tensor]], position: int) -> torch.Tensor:
    """Hidden state at a boundary: input of layer p, or else output of layer p-1."""
    if position in captured:
        return captured[position][0]
    return captured[position - 1][1]


@torch.no_grad()
def write_e2e_targets(teacher: Teacher, input_ids_BT: torch.Tensor, targets: list[SlotTarget]) -> None:
    """Full forward of the batch; each slot gets its ids, final hidden state and, where the
    layout has room for them (teachers with an LM head), its top-k log-probs.

    Logits are formed one sample at a time so memory stays at T x V floats, not B x T x V.
    """
    final_BTD = teacher.model.base_model(input_ids=input_ids_BT.to(teacher.device), use_cache=False).last_hidden_state
    if "topk_logp" not in targets[0].tensors:  # an encoder: its final hidden state is the target
        for i, target in enumerate(targets):
            target.tensors["input_ids"].copy_(input_ids_BT[i])
            target.tensors["hidden"][0].copy_(final_BTD[i])
        return
    lm_head = teacher.model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"the samples have room for top-k log-probabilities but {teacher.name_or_path} "
                         "has no LM head: the workers and students disagree about the teacher")
    for i, target in enumerate(targets):
        out = target.tensors
        k = out["topk_logp"].shape[-1]
        logp_TV = torch.log_softmax(lm_head(final_BTD[i]).float(), dim=-1)
        values_TK, idx_TK = logp_TV.topk(k, dim=-1)
        out["input_ids"].copy_(input_ids_BT[i])
        out["topk_logp"].copy_(values_TK)
        out["topk_idx"].copy_(idx_TK)
        out["hidden"][0].copy_(final_BTD[i])
