"""The end-to-end stage's parts: the top-k KL loss against a direct computation (and its
chunked form against the plain one), the worker's top-k targets against the model's own
logits, what each trainable mode trains, and that a frozen base is the teacher's own memory."""

from __future__ import annotations

import pytest
import torch

from distill.model.teacher import Teacher
from distill.pipeline.slot import HEADER_BYTES, slot_stride
from distill.pipeline.worker import SlotTarget
from distill.replacements.mlp import ResidualMLP
from distill.stages import sample_batch_config
from distill.teacher.targets import write_e2e_targets
from distill.train.e2e import E2EStudent, chunked_topk_kl, topk_kl
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
        start_logits = student.logits(student.final_hidden(ids_BT)).clone()
    optimizer = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    logp_NK, idx_NK = _teacher_topk(torch.randn(16, 50), 5)
    loss, _ = student(ids_BT, logp_NK.view(2, 8, 5), idx_NK.view(2, 8, 5))
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        assert not torch.allclose(student.logits(student.final_hidden(ids_BT)), start_logits)
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


class _RecordingHead(torch.nn.Module):
    """An LM head that records how many rows of logits it formed per call."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, vocab)
        self.rows: list[int] = []

    def forward(self, hidden_CD: torch.Tensor) -> torch.Tensor:
        self.rows.append(hidden_CD.shape[0])
        return self.linear(hidden_CD)


@pytest.mark.parametrize("renormalize_student", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 30, 64])
def test_chunked_kl_is_the_plain_formula_without_the_full_logits(chunk: int, renormalize_student: bool) -> None:
    """Same value and gradients (hidden states and head weights) as topk_kl on the full logits,
    while no call ever forms more than ``chunk`` rows of logits, in forward or backward."""
    torch.manual_seed(0)
    num_tokens, hidden, vocab, k, tau = 30, 16, 40, 5, 1.7
    head = _RecordingHead(hidden, vocab)
    logp_NK, idx_NK = _teacher_topk(torch.randn(num_tokens, vocab) * 3, k)
    hidden_ND = torch.randn(num_tokens, hidden, requires_grad=True)
    want = topk_kl(head(hidden_ND), logp_NK, idx_NK, tau, renormalize_student)
    want_grads = torch.autograd.grad(want, [hidden_ND, head.linear.weight, head.linear.bias])
    head.rows.clear()
    got = chunked_topk_kl(hidden_ND, head, logp_NK, idx_NK, tau, chunk, renormalize_student)
    forward_rows = list(head.rows)
    got_grads = torch.autograd.grad(got, [hidden_ND, head.linear.weight, head.linear.bias])
    torch.testing.assert_close(got, want)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad)
    assert max(head.rows) == min(chunk, num_tokens)
    assert sum(forward_rows) == num_tokens and sum(head.rows) == 2 * num_tokens  # recomputed in backward
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunked_topk_kl(hidden_ND, head, logp_NK, idx_NK, tau, 0)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_kl_keeps_no_full_logits_for_backward(device: str) -> None:
    """Nothing of [N, V] size is kept between forward and backward (saved-tensor hooks see
    what autograd keeps); on CUDA the allocator's peak stays below one [N, V] float32 tensor."""
    torch.manual_seed(0)
    num_tokens, hidden, vocab, chunk = 2048, 64, 4096, 128
    head = torch.nn.Linear(hidden, vocab, bias=False).to(device)
    hidden_ND = torch.randn(num_tokens, hidden, device=device, requires_grad=True)
    logp_NK, idx_NK = _teacher_topk(torch.randn(num_tokens, 64, device=device), 8)
    saved: list[int] = []
    full_bytes = num_tokens * vocab * 4
    if device == "cuda":  # cuBLAS's workspace (tens of MiB on Hopper) comes with the first matmuls: not ours
        chunked_topk_kl(hidden_ND, head, logp_NK, idx_NK, 1.0, chunk).backward()
        hidden_ND.grad = head.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = chunked_topk_kl(hidden_ND, head, logp_NK, idx_NK, 1.0, chunk)
    loss.backward()
    assert max(saved) < num_tokens * vocab // 4
    if device == "cuda":
        assert torch.cuda.max_memory_allocated() - base < full_bytes / 2


@pytest.mark.parametrize("trainable", ["replacements", "lora", "all"])
def test_frozen_base_is_the_teachers_own_memory(trainable: str) -> None:
    """No second copy of the teacher for a frozen base; trainable=all trains its own float32 copy."""
    teacher = tiny_llama(vocab_size=50, num_layers=3)
    student = E2EStudent(teacher, {1: ResidualMLP(teacher, 1).float()}, trainable, lora_rank=2)
    teacher_ptrs = {p.data_ptr() for p in teacher.model.parameters()}
    base = [p for name, p in student.named_parameters() if ".replacement." not in name]
    shared = [p.data_ptr() in teacher_ptrs for p in base]
    if trainable == "all":
        assert not any(shared) and all(p.dtype == torch.float32 and p.requires_grad for p in base)
    else:
        assert all(shared) and not any(p.requires_grad for p in base)


def test_bf16_teacher_with_float32_replacements() -> None:
    """A bfloat16 teacher's stream runs through float32 replacements (cast at the boundary):
    the loss is finite and the replacement's float32 weights get gradients."""
    fp32 = tiny_llama(vocab_size=50, num_layers=2)
    teacher = Teacher(fp32.model.to(torch.bfloat16))
    replacement = ResidualMLP(teacher, 1).float()
    student = E2EStudent(teacher, {1: replacement}, "replacements", loss_chunk_tokens=5)
    logp_NK, idx_NK = _teacher_topk(torch.randn(16, 50), 5)
    loss, final_BTD = student(torch.randint(0, 50, (2, 8)), logp_NK.view(2, 8, 5), idx_NK.view(2, 8, 5))
    loss.backward()
    assert final_BTD.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 and p.grad is not None for p in replacement.parameters())
