"""Replacement building blocks against plain references on random tensors.

The chunked causal kernel and the bidirectional kernel are checked against the naive
O(T^2) masked form (values and gradients), the chunked form against the recurrent (decoding)
form, and the SVD factorisation against Eckart-Young. The kernels are the exported
student's (distill.model.modeling), which the replacements train with.

Shape legend: B batch, H heads, T sequence length, F features, E head size,
I input features, O output features.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distill.model.modeling import modeling_distill_bert
from distill.model.modeling.modeling_distill_llama import (
    DENOMINATOR_EPS,
    FeatureMap,
    bidirectional_linear_attention,
    causal_linear_attention,
    recurrent_linear_attention,
)
from distill.replacements.lowrank import LowRankLinear


def _naive_linear_attention(
    phi_q_BHTF: torch.Tensor, phi_k_BHTF: torch.Tensor, v_BHTE: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Reference: materialise the T x T score matrix, mask it, normalise each row."""
    scores_BHTT = phi_q_BHTF @ phi_k_BHTF.transpose(-1, -2)
    if causal:
        seq_len = scores_BHTT.shape[-1]
        scores_BHTT = scores_BHTT * torch.ones(seq_len, seq_len).tril()
    return (scores_BHTT @ v_BHTE) / (scores_BHTT.sum(-1, keepdim=True) + DENOMINATOR_EPS)


def _random_inputs(seq_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Positive features (as any feature map produces) and signed values."""
    gen = torch.Generator().manual_seed(seed)
    phi_q_BHTF = torch.randn(2, 3, seq_len, 8, generator=gen).softmax(-1)
    phi_k_BHTF = torch.randn(2, 3, seq_len, 8, generator=gen).exp()
    v_BHTE = torch.randn(2, 3, seq_len, 5, generator=gen)
    return phi_q_BHTF, phi_k_BHTF, v_BHTE


@pytest.mark.parametrize(("seq_len", "chunk_size"), [(1, 4), (5, 4), (8, 4), (13, 64), (33, 8)])
def test_causal_kernel_matches_naive_masked_attention(seq_len: int, chunk_size: int) -> None:
    inputs = [x.requires_grad_(True) for x in _random_inputs(seq_len)]
    out_BHTE, _ = causal_linear_attention(*inputs, chunk_size=chunk_size)
    ref_BHTE = _naive_linear_attention(*inputs, causal=True)
    torch.testing.assert_close(out_BHTE, ref_BHTE, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out_BHTE.square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref_BHTE.square().sum(), inputs)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


def test_causal_kernel_ignores_future_positions() -> None:
    phi_q_BHTF, phi_k_BHTF, v_BHTE = _random_inputs(12)
    out_BHTE, _ = causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, chunk_size=4)
    phi_k_BHTF[:, :, 7:] *= 5.0
    v_BHTE[:, :, 7:] = -v_BHTE[:, :, 7:]
    changed_BHTE, _ = causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, chunk_size=4)
    torch.testing.assert_close(out_BHTE[:, :, :7], changed_BHTE[:, :, :7], atol=0, rtol=0)
    assert not torch.allclose(out_BHTE[:, :, 7:], changed_BHTE[:, :, 7:])


@pytest.mark.parametrize(("seq_len", "chunk_size", "split"), [(1, 4, 0), (9, 4, 0), (13, 4, 6), (20, 64, 11)])
def test_chunked_form_equals_recurrent_form(seq_len: int, chunk_size: int, split: int) -> None:
    """Training's chunked kernel and decoding's one-step recurrence agree to 1e-5, including
    a prefill of ``split`` positions continued token by token from the state it leaves."""
    phi_q_BHTF, phi_k_BHTF, v_BHTE = _random_inputs(seq_len, seed=3)
    chunked_BHTE, chunked_state_BHFX = causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, chunk_size)
    recurrent_BHTE, recurrent_state_BHFX = recurrent_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE)
    torch.testing.assert_close(chunked_BHTE, recurrent_BHTE, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_state_BHFX, recurrent_state_BHFX, atol=1e-5, rtol=1e-5)
    if split:
        head = [x[:, :, :split] for x in (phi_q_BHTF, phi_k_BHTF, v_BHTE)]
        tail = [x[:, :, split:] for x in (phi_q_BHTF, phi_k_BHTF, v_BHTE)]
        head_BHTE, state_BHFX = causal_linear_attention(*head, chunk_size)
        tail_BHTE, _ = recurrent_linear_attention(*tail, state_BHFX)
        torch.testing.assert_close(torch.cat([head_BHTE, tail_BHTE], 2), recurrent_BHTE, atol=1e-5, rtol=1e-5)
        resumed_BHTE, _ = causal_linear_attention(*tail, chunk_size, state_BHFX)
        torch.testing.assert_close(resumed_BHTE, tail_BHTE, atol=1e-5, rtol=1e-5)


def test_bidirectional_kernel_matches_naive_attention() -> None:
    inputs = _random_inputs(11)
    out_BHTE = bidirectional_linear_attention(*inputs)
    torch.testing.assert_close(out_BHTE, _naive_linear_attention(*inputs, causal=False))
    torch.testing.assert_close(modeling_distill_bert.bidirectional_linear_attention(*inputs), out_BHTE)


def test_causal_kernel_is_float32_and_finite_for_bfloat16_inputs() -> None:
    inputs = [x.to(torch.bfloat16) for x in _random_inputs(40)]
    out_BHTE, _ = causal_linear_attention(*inputs, chunk_size=16)
    assert out_BHTE.dtype == torch.float32
    assert torch.isfinite(out_BHTE).all()


@pytest.mark.parametrize("kind", ["hedgehog", "elu"])
def test_feature_map_is_positive_and_stable_for_large_inputs(kind: str) -> None:
    feature_map = FeatureMap(num_heads=3, head_dim=8, feature_dim=6, kind=kind)
    x_BHTE = 1e4 * torch.randn(2, 3, 5, 8)
    phi_BHTF = feature_map(x_BHTE)
    assert phi_BHTF.shape == (2, 3, 5, feature_map.num_features)
    assert torch.isfinite(phi_BHTF).all()
    assert (phi_BHTF >= 0).all()
    if kind == "hedgehog":
        torch.testing.assert_close(phi_BHTF.sum(-1), torch.full((2, 3, 5), 2.0))


def test_lowrank_linear_is_the_best_rank_r_approximation() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(12, 7)
    lowrank = LowRankLinear.from_linear(dense, rank=3)
    approx_OI = lowrank.up.weight @ lowrank.down.weight
    singular_values = torch.linalg.svdvals(dense.weight.detach())
    expected_error = singular_values[3:].square().sum().sqrt()
    actual_error = torch.linalg.matrix_norm(dense.weight.detach() - approx_OI)
    torch.testing.assert_close(actual_error, expected_error, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lowrank.up.bias, dense.bias, atol=0, rtol=0)
    assert (lowrank.in_features, lowrank.out_features, lowrank.rank) == (12, 7, 3)


def test_lowrank_linear_at_full_rank_reproduces_the_dense_map() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(9, 16)
    lowrank = LowRankLinear.from_linear(dense, rank=9)
    x_BTI = torch.randn(2, 4, 9)
    torch.testing.assert_close(lowrank(x_BTI), dense(x_BTI), atol=1e-5, rtol=1e-5)
