"""The end-to-end stage's parts: the top-k KL loss against a direct computation, the
worker's top-k targets against the model's own logits, and what each trainable mode trains."""

from __future__ import annotations

import pytest
import torch

from distill.pipeline.slot import HEADER_BYTES, slot_stride
from distill.pipeline.worker import SlotTarget
from distill.replacements.mlp import ResidualMLP
from distill.train.e2e import E2EStudent, topk_kl
from distill.train.stages import sample_batch_config
from distill.train.targets import write_e2e_targets
from tests.tiny_teachers import tiny_bert, tiny_llama


def _reference_kl(student_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, k: int, tau: float,
                  renormalize_student: bool) -> torch.Tensor:
    """Token by token, from the teacher's full logits: KL(renormalised top-k at tau || student at tau)."""
    total = torch.zeros((), dtype=torch.float64)
    for s_V, t_V in zip(student_NV.double(), teacher_logits_NV.double(), strict=True):
        idx_K = t_V.topk(k).indices
        p_K = torch.softmax(t_V / tau, -1)[idx_K]
        p_K = p_K / p_K.sum()
        q_V = torch.softmax(s_V / tau, -1)
        q_K = q_V[idx_K] / q_V[idx_K].sum() if renormalize_student else q_V[idx_K]
        total += (p_K * (p_K.log() - q_K.log())).sum()
    return total / len(student_NV) * tau * tau


def _teacher_topk(teacher_logits_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(teacher_logits_NV, -1).topk(k, dim=-1)


@pytest.mark.parametrize("renormalize_student", [False, True])
@pytest.mark.parametrize(("k", "tau"), [(1, 1.0), (5, 1.0), (5, 2.5), (40, 0.5)])
def test_topk_kl_matches_a_direct_computation(k: int, tau: float, renormalize_student: bool) -> None:
    torch.manual_seed(0)
    student_NV, teacher_NV = torch.randn(12, 40) * 3, torch.randn(12, 40) * 3
    logp_NK, idx_NK = _teacher_topk(teacher_NV, k)
    got = topk_kl(student_NV, logp_NK, idx_NK, tau, renormalize_student)
    want = _reference_kl(student_NV, teacher_NV, k, tau, renormalize_student)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_topk_kl_is_zero_only_at_the_teacher_and_gives_gradients() -> None:
    torch.manual_seed(0)
    teacher_NV = torch.randn(6, 30)
    logp_NK, idx_NK = _teacher_topk(teacher_NV, 30)  # k = V: the full distribution
    assert topk_kl(teacher_NV, logp_NK, idx_NK, 1.0).abs() < 1e-5
    student_NV = torch.randn(6, 30, requires_grad=True)
    loss = topk_kl(student_NV, logp_NK, idx_NK, 1.0)
    loss.backward()
    assert loss > 0.1 and student_NV.grad.abs().sum() > 0


def test_temperature_softens_both_sides_and_scales_by_its_square() -> None:
    """A higher temperature flattens both distributions (smaller KL before the tau^2 factor);
    the factor keeps the loss on the scale of tau=1 (Hinton et al.)."""
    torch.manual_seed(1)
    student_NV, teacher_NV = torch.randn(50, 64) * 4, torch.randn(50, 64) * 4
    logp_NK, idx_NK = _teacher_topk(teacher_NV, 64)
    raw = {tau: float(topk_kl(student_NV, logp_NK, idx_NK, tau)) / tau**2 for tau in (1.0, 2.0, 8.0)}
    assert raw[1.0] > raw[2.0] > raw[8.0] > 0
    with pytest.raises(ValueError, match="temperature"):
        topk_kl(student_NV, logp_NK, idx_NK, 0.0)


def test_worker_writes_the_models_topk_logprobs_and_final_hidden() -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=2)
    config = sample_batch_config(3, 8, 32, "float32", top_k=6)
    stride = slot_stride(config.nbytes())
    buf = bytearray(2 * stride)
    views = [memoryview(buf)[i * stride + HEADER_BYTES:][:config.nbytes()] for i in range(2)]
    targets = [SlotTarget(i, 1, view, config.decode(view)) for i, view in enumerate(views)]
    ids_BT = torch.randint(0, 50, (2, 8))
    write_e2e_targets(teacher, ids_BT, targets)
    with torch.no_grad():
        out = teacher.model(ids_BT, output_hidden_states=True)
    want_logp, want_idx = torch.log_softmax(out.logits, -1).topk(6, dim=-1)
    for i, view in enumerate(views):
        sample = config.decode(view)
        assert torch.equal(sample["input_ids"], ids_BT[i])
        torch.testing.assert_close(sample["topk_logp"], want_logp[i])
        assert torch.equal(sample["topk_idx"], want_idx[i])
        torch.testing.assert_close(sample["hidden"][0], teacher.final_hidden(out.hidden_states[-1][i]))


@pytest.mark.parametrize("trainable", ["replacements", "lora", "all"])
def test_trainable_modes_train_what_they_say_and_leave_the_teacher_alone(trainable: str) -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=2)
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    replacements = {1: ResidualMLP(teacher, 1).float()}
    student = E2EStudent(teacher, replacements, trainable, lora_rank=2)
    names = {name for name, p in student.named_parameters() if p.requires_grad}
    if trainable == "replacements":
        assert names and all(".replacement." in n and "lora" not in n for n in names)
    elif trainable == "lora":
        assert names and all("lora_" in n for n in names)
    else:
        assert any("embed_tokens" in n for n in names) and any(".replacement." in n for n in names)
    ids_BT = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        start_logits = student(ids_BT)[0].clone()
    optimizer = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    logits_BTV, _ = student(ids_BT)
    logp_NK, idx_NK = _teacher_topk(torch.randn(16, 50), 5)
    topk_kl(logits_BTV.flatten(0, 1), logp_NK, idx_NK, 1.0).backward()
    optimizer.step()
    with torch.no_grad():
        assert not torch.allclose(student(ids_BT)[0], start_logits)
    for key, value in teacher.model.state_dict().items():
        assert torch.equal(value, before[key]), f"teacher weight {key} changed"
    with pytest.raises(ValueError, match="student.e2e.trainable"):
        E2EStudent(teacher, replacements, "everything")


def test_an_encoder_student_is_trained_on_its_final_hidden_state() -> None:
    """No LM head: the worker sends the final hidden state only, the student gives no logits."""
    teacher = tiny_bert(vocab_size=50, num_layers=2)
    config = sample_batch_config(1, 8, 32, "float32")  # what stage_layout gives an encoder: no top-k
    view = memoryview(bytearray(config.nbytes()))
    ids_BT = torch.randint(0, 50, (1, 8))
    write_e2e_targets(teacher, ids_BT, [SlotTarget(0, 1, view, config.decode(view))])
    with torch.no_grad():
        want_BTD = teacher.model(ids_BT).last_hidden_state
    torch.testing.assert_close(config.decode(view)["hidden"][0], want_BTD[0])
    student = E2EStudent(teacher, {1: ResidualMLP(teacher, 1).float()}, "replacements")
    logits, final_BTD = student(ids_BT)
    assert logits is None and final_BTD.shape == want_BTD.shape
