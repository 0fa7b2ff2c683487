"""End-to-end distillation: the assembled student against the teacher's next-token distribution.

Worker side (:func:`write_e2e_targets`): one full teacher forward per WORK batch; per
sample the top-k log-probabilities ``log_softmax(logits)`` and their token ids ([T, k]),
and the final hidden state (after the final norm) in ``hidden[0]``.

Student side (:class:`E2EStudent`, :func:`topk_kl`): the teacher with every trained
replacement spliced in, trained on KL(teacher || student) at temperature tau.

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

import logging

import torch
from torch import nn

from distill.assemble import splice
from distill.checks import E2E_TRAINABLE as TRAINABLE
from distill.lora import add_lora
from distill.pipeline import SlotTarget
from distill.teacher import Teacher

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


# ---------------------------------------------------------------------- worker side
@torch.no_grad()
def write_e2e_targets(teacher: Teacher, input_ids_BT: torch.Tensor, targets: list[SlotTarget]) -> None:
    """Full forward of the batch; each slot gets its ids, top-k log-probs and final hidden state.

    Logits are formed one sample at a time so memory stays at T x V floats, not B x T x V.
    """
    lm_head = teacher.model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"the end-to-end stage needs a teacher with an LM head; {teacher.name_or_path} "
                         "has none: set student.e2e.steps=0")
    final_BTD = teacher.model.base_model(input_ids=input_ids_BT.to(teacher.device), use_cache=False).last_hidden_state
    for i, target in enumerate(targets):
        out = target.tensors
        k = out["topk_logp"].shape[-1]
        logp_TV = torch.log_softmax(lm_head(final_BTD[i]).float(), dim=-1)
        values_TK, idx_TK = logp_TV.topk(k, dim=-1)
        out["input_ids"].copy_(input_ids_BT[i])
        out["topk_logp"].copy_(values_TK)
        out["topk_idx"].copy_(idx_TK)
        out["hidden"][0].copy_(final_BTD[i])


# ---------------------------------------------------------------------- the student
class E2EStudent(nn.Module):
    """The teacher with replacements spliced in (a copy: the teacher itself stays frozen).

    ``trainable`` picks what the end-to-end stage trains: the replacements' parameters,
    LoRA adapters on their linear maps, or every parameter (teacher parts included).
    """

    def __init__(self, teacher: Teacher, replacements: dict[int, nn.Module], trainable: str,
                 lora_rank: int = 8, lora_alpha: float = 16.0) -> None:
        super().__init__()
        if trainable not in TRAINABLE:
            raise ValueError(f"student.e2e.trainable={trainable!r}: choose one of {TRAINABLE}")
        self.model = splice(teacher, replacements)
        self.model.requires_grad_(trainable == "all")
        for replacement in replacements.values():
            replacement.train()
            if trainable == "lora":
                count = add_lora(replacement, lora_rank, lora_alpha)
                if count == 0:
                    raise ValueError(f"student.e2e.trainable=lora: replacement of layer {replacement.layer_idx} "
                                     "has no nn.Linear to adapt; use trainable=replacements")
            else:
                replacement.requires_grad_(True)

    def forward(self, input_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits_BTV, final hidden_BTD after the final norm)."""
        final_BTD = self.model.base_model(input_ids=input_ids_BT, use_cache=False).last_hidden_state
        return self.model.get_output_embeddings()(final_BTD), final_BTD

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
