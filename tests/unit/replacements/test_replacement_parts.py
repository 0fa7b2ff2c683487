"""Replacement building blocks against plain references on random tensors.

The chunked causal kernel and the bidirectional kernel are checked against the naive
O(T^2) masked form (values and gradients), the chunked form against the recurrent (decoding)
form, and the SVD factorisation against Eckart-Young. Sliding-window + linear attention is
checked against a naive masked form of its formula (and, with a window covering the sequence,
against softmax attention), decoding through a KV ring against the chunked form; gated linear
attention's decay against a case worked by hand, its chunked form against the recurrent one. The kernels are the exported
student's (distill.model.modeling), which the replacements train with.

Shape legend: B batch, H heads, T sequence length, F features, E head size,
I input features, O output features, X = E + 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distill.model.modeling import modeling_distill_bert
from distill.model.modeling.modeling_distill_llama import (
    DENOMINATOR_EPS,
    FeatureMap,
    SlidingWindowLinearAttention,
    bidirectional_gated_numden,
    bidirectional_linear_attention,
    causal_linear_attention,
    chunked_gated_delta,
    gated_linear_numden,
    normalise,
    recurrent_gated_delta,
    recurrent_gated_linear_attention,
    recurrent_linear_attention,
    with_ones,
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


# ---------------------------------------------------------------- sliding window + linear attention


def _window_attention(window: int, causal: bool, seed: int = 0) -> SlidingWindowLinearAttention:
    """Random (not identity) feature maps and window weights, so both parts matter."""
    torch.manual_seed(seed)
    attention = SlidingWindowLinearAttention(3, 5, "hedgehog", 4, causal, chunk_size=4, window=window, scale=5**-0.5)
    with torch.no_grad():
        for param in attention.parameters():
            param.add_(0.5 * torch.randn_like(param))
    return attention


def _qkv(seq_len: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(2 * torch.randn(2, 3, seq_len, 5, generator=gen) for _ in range(3))


def _naive_window_linear(attention: SlidingWindowLinearAttention, q_BHTE, k_BHTE, v_BHTE) -> torch.Tensor:
    """Reference: the formula on the full T x T matrices, the window and the rest as masks."""
    seq_len = q_BHTE.shape[2]
    dist_TT = torch.arange(seq_len)[:, None] - torch.arange(seq_len)[None, :]
    if attention.causal:
        window_TT, older_TT = (dist_TT >= 0) & (dist_TT < attention.window), dist_TT >= attention.window
    else:
        window_TT, older_TT = dist_TT.abs() < attention.window, dist_TT.abs() >= attention.window
    scores_BHTT = (q_BHTE @ k_BHTE.transpose(-1, -2) * attention.scale).masked_fill(~window_TT, -torch.inf)
    weight_H11 = torch.sigmoid(attention.window_factor_H)[:, None, None]
    exact_BHTT = weight_H11 * (scores_BHTT - scores_BHTT.amax(-1, keepdim=True)).exp()
    linear_BHTT = (attention.q_features(q_BHTE) @ attention.k_features(k_BHTE).transpose(-1, -2)) * older_TT
    weights_BHTT = exact_BHTT + linear_BHTT
    return (weights_BHTT @ v_BHTE) / (weights_BHTT.sum(-1, keepdim=True) + DENOMINATOR_EPS)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(("seq_len", "window"), [(1, 3), (11, 1), (11, 3), (13, 5)])
def test_sliding_window_kernel_matches_naive_formula(seq_len: int, window: int, causal: bool) -> None:
    attention = _window_attention(window, causal)
    inputs = [x.requires_grad_(True) for x in _qkv(seq_len)]
    out_BHTE, _ = attention(*inputs)
    ref_BHTE = _naive_window_linear(attention, *inputs)
    torch.testing.assert_close(out_BHTE, ref_BHTE, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out_BHTE.square().sum(), [*inputs, attention.window_factor_H])
    ref_grads = torch.autograd.grad(ref_BHTE.square().sum(), [*inputs, attention.window_factor_H])
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_window_covering_the_sequence_is_softmax_attention(causal: bool) -> None:
    """No position is older than the window: the layer is the teacher's softmax attention of the
    same q/k/v, whatever its feature maps and window weight (padding keys left out alike)."""
    attention = _window_attention(window=9, causal=causal)
    q_BHTE, k_BHTE, v_BHTE = _qkv(9)
    mask_BT = torch.ones(2, 9)
    mask_BT[1, 6:] = 0
    out_BHTE, _ = attention(q_BHTE, k_BHTE, v_BHTE, mask_BT)
    allowed_BHTT = mask_BT.bool()[:, None, None, :] & (torch.ones(9, 9).tril().bool() if causal else True)
    expected_BHTE = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, attn_mask=allowed_BHTT, scale=5**-0.5)
    torch.testing.assert_close(out_BHTE, expected_BHTE, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "split"), [(3, 0), (3, 2), (4, 7), (1, 5)])
def test_sliding_window_decoding_through_a_ring_equals_the_chunked_form(window: int, split: int) -> None:
    """Decoding keeps the last window - 1 keys and values and folds the one leaving into the
    linear state: a prefill of ``split`` positions, then one position per call, gives the
    chunked form's outputs to 1e-5."""
    attention = _window_attention(window, causal=True)
    q_BHTE, k_BHTE, v_BHTE = _qkv(12, seed=4)
    chunked_BHTE, _ = attention(q_BHTE, k_BHTE, v_BHTE)
    ring = window - 1
    outs, state_BHFX, start = [], None, 0
    for end in ([split] if split else []) + list(range(split + 1, 13)):
        past = min(start, ring)
        keys = slice(start - past, end)
        out_BHTE, state_BHFX = attention(q_BHTE[:, :, start:end], k_BHTE[:, :, keys], v_BHTE[:, :, keys], None,
                                         state_BHFX)
        outs.append(out_BHTE)
        start = end
    torch.testing.assert_close(torch.cat(outs, dim=2), chunked_BHTE, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- gated linear attention


def _gated_inputs(seq_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    phi_q_BHTF, phi_k_BHTF, v_BHTE = _random_inputs(seq_len, seed)
    log_g_BHT = torch.nn.functional.logsigmoid(torch.randn(2, 3, seq_len, generator=gen) + 1.0)
    return phi_q_BHTF, phi_k_BHTF, v_BHTE, log_g_BHT


def test_gated_decay_matches_a_case_worked_by_hand() -> None:
    """One head, one feature, phi(q) = 1, phi(k) = (1, 2, 3), v = (1, 2, 4), g = (0.5, 0.5, 0.25):
    S_2 = 0.5 [1, 1] + 2 [2, 1] = [4.5, 2.5]; S_3 = 0.25 S_2 + 3 [4, 1] = [13.125, 3.625].
    Bidirectional, position 1 also sees keys 2 and 3 decayed by g_1 and g_1 g_2: (1 + 2 + 3) / 2.75."""
    phi_q, phi_k = torch.ones(1, 1, 3, 1), torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1)
    v, log_g = torch.tensor([1.0, 2.0, 4.0]).view(1, 1, 3, 1), torch.tensor([0.5, 0.5, 0.25]).log().view(1, 1, 3)
    expected = torch.tensor([1.0, 4.5 / 2.5, 13.125 / 3.625]).view(1, 1, 3, 1)
    for chunk_size in (1, 2, 3):
        numden, state = gated_linear_numden(phi_q, phi_k, with_ones(v), log_g, chunk_size)
        torch.testing.assert_close(normalise(numden), expected)
        torch.testing.assert_close(state, torch.tensor([[[[13.125, 3.625]]]]))
    torch.testing.assert_close(recurrent_gated_linear_attention(phi_q, phi_k, v, log_g)[0], expected)
    both = normalise(bidirectional_gated_numden(phi_q, phi_k, with_ones(v), log_g, chunk_size=2))
    torch.testing.assert_close(both[0, 0, 0, 0], torch.tensor(6 / 2.75))


@pytest.mark.parametrize(("seq_len", "chunk_size", "split"), [(1, 4, 0), (9, 4, 0), (13, 4, 6), (20, 64, 11)])
def test_gated_chunked_form_equals_recurrent_form(seq_len: int, chunk_size: int, split: int) -> None:
    """As for linear attention: training's chunked kernel, decoding's recurrence and a prefill
    continued token by token agree to 1e-5."""
    phi_q_BHTF, phi_k_BHTF, v_BHTE, log_g_BHT = _gated_inputs(seq_len, seed=3)
    numden_BHTX, chunked_state_BHFX = gated_linear_numden(phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), log_g_BHT,
                                                          chunk_size)
    recurrent_BHTE, recurrent_state_BHFX = recurrent_gated_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, log_g_BHT)
    torch.testing.assert_close(normalise(numden_BHTX), recurrent_BHTE, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_state_BHFX, recurrent_state_BHFX, atol=1e-5, rtol=1e-5)
    if split:
        head = [x[:, :, :split] for x in (phi_q_BHTF, phi_k_BHTF, v_BHTE, log_g_BHT)]
        tail = [x[:, :, split:] for x in (phi_q_BHTF, phi_k_BHTF, v_BHTE, log_g_BHT)]
        _, state_BHFX = gated_linear_numden(*head[:2], with_ones(head[2]), head[3], chunk_size)
        tail_BHTE, _ = recurrent_gated_linear_attention(*tail, state_BHFX)
        torch.testing.assert_close(tail_BHTE, recurrent_BHTE[:, :, split:], atol=1e-5, rtol=1e-5)


def test_gated_kernels_reduce_to_linear_attention_without_decay() -> None:
    """g = 1 everywhere: the causal and the bidirectional gated kernels are the ungated ones."""
    phi_q_BHTF, phi_k_BHTF, v_BHTE = _random_inputs(11)
    no_decay_BHT = torch.zeros(2, 3, 11)
    gated_BHTX, _ = gated_linear_numden(phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), no_decay_BHT, 4)
    torch.testing.assert_close(normalise(gated_BHTX), causal_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE, 4)[0])
    both_BHTX = bidirectional_gated_numden(phi_q_BHTF, phi_k_BHTF, with_ones(v_BHTE), no_decay_BHT, 4)
    torch.testing.assert_close(normalise(both_BHTX), bidirectional_linear_attention(phi_q_BHTF, phi_k_BHTF, v_BHTE))


# ---------------------------------------------------------------- the gated delta rule


def _delta_inputs(seq_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q_BHTE, k_BHTE, v_BHTE = (torch.randn(2, 3, seq_len, 8, generator=gen) for _ in range(3))
    beta_BHT = torch.rand(2, 3, seq_len, generator=gen)
    log_a_BHT = F.logsigmoid(torch.randn(2, 3, seq_len, generator=gen) + 2)
    return q_BHTE, k_BHTE, v_BHTE, beta_BHT, log_a_BHT


def _naive_delta(q_BHTE, k_BHTE, v_BHTE, beta_BHT, log_a_BHT) -> torch.Tensor:
    """The rule as written, per position: S <- a (I - b k k^T) S + b k v^T, out = S^T q (unit q, k)."""
    q_BHTE, k_BHTE = F.normalize(q_BHTE, dim=-1), F.normalize(k_BHTE, dim=-1)
    state_BHEE = torch.zeros(*q_BHTE.shape[:2], 8, 8, dtype=torch.float64)
    eye_EE = torch.eye(8, dtype=torch.float64)
    outs = []
    for t in range(q_BHTE.shape[2]):
        k_BHE1, b_BH11 = k_BHTE[:, :, t, :, None].double(), beta_BHT[:, :, t, None, None].double()
        transition_BHEE = log_a_BHT[:, :, t, None, None].double().exp() * (eye_EE - b_BH11 * k_BHE1 @ k_BHE1.transpose(-1, -2))
        state_BHEE = transition_BHEE @ state_BHEE + b_BH11 * k_BHE1 @ v_BHTE[:, :, t, None, :].double()
        outs.append(state_BHEE.transpose(-1, -2) @ q_BHTE[:, :, t, :, None].double())
    return torch.cat(outs, dim=-1).transpose(-1, -2).float()


@pytest.mark.parametrize(("seq_len", "chunk_size", "split"), [(1, 4, 0), (9, 4, 0), (13, 4, 6), (20, 64, 11), (37, 8, 16)])
def test_delta_rule_chunked_form_equals_recurrent_form_and_the_rule(seq_len: int, chunk_size: int, split: int) -> None:
    """Training's chunked kernel (a triangular solve per chunk), decoding's recurrence, the rule
    written out in float64, and a prefill continued token by token agree to 1e-5."""
    inputs = _delta_inputs(seq_len, seed=4)
    chunked_BHTE, chunked_state_BHEE = chunked_gated_delta(*inputs, chunk_size)
    recurrent_BHTE, recurrent_state_BHEE = recurrent_gated_delta(*inputs)
    torch.testing.assert_close(chunked_BHTE, recurrent_BHTE, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_state_BHEE, recurrent_state_BHEE, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(recurrent_BHTE, _naive_delta(*inputs), atol=1e-5, rtol=1e-5)
    if split:
        head = [x[:, :, :split] for x in inputs]
        tail = [x[:, :, split:] for x in inputs]
        _, state_BHEE = chunked_gated_delta(*head, chunk_size)
        tail_BHTE, _ = recurrent_gated_delta(*tail, state_BHEE)
        torch.testing.assert_close(tail_BHTE, recurrent_BHTE[:, :, split:], atol=1e-5, rtol=1e-5)
        chunked_tail_BHTE, _ = chunked_gated_delta(*tail, chunk_size, state_BHEE)
        torch.testing.assert_close(chunked_tail_BHTE, recurrent_BHTE[:, :, split:], atol=1e-5, rtol=1e-5)


def test_delta_rule_recalls_the_last_value_written_under_a_key() -> None:
    """b = 1, no decay: writing v1 then v2 under one key leaves v2 (the delta rule overwrites;
    linear attention would return their sum), and another key's value is untouched."""
    k_E = F.normalize(torch.randn(8), dim=0)
    other_E = torch.linalg.qr(torch.stack([k_E, torch.randn(8)], dim=1))[0][:, 1]  # orthogonal to k
    keys_BHTE = torch.stack([k_E, other_E, k_E])[None, None]
    values_BHTE = torch.randn(1, 1, 3, 8)
    out_BHTE, state_BHEE = chunked_gated_delta(keys_BHTE, keys_BHTE, values_BHTE, torch.ones(1, 1, 3),
                                               torch.zeros(1, 1, 3), 4)
    torch.testing.assert_close(k_E @ state_BHEE[0, 0], values_BHTE[0, 0, 2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other_E @ state_BHEE[0, 0], values_BHTE[0, 0, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_BHTE[0, 0, 2], values_BHTE[0, 0, 2], atol=1e-5, rtol=1e-5)


def test_delta_rule_padding_positions_change_nothing() -> None:
    """b = 0 and log a = 0 at a position (how padding reaches the kernel): the state and every later output
    are those of the sequence without it."""
    q_BHTE, k_BHTE, v_BHTE, beta_BHT, log_a_BHT = _delta_inputs(10, seed=5)
    beta_BHT[:, :, 4], log_a_BHT[:, :, 4] = 0.0, 0.0
    with_pad_BHTE, with_pad_state = chunked_gated_delta(q_BHTE, k_BHTE, v_BHTE, beta_BHT, log_a_BHT, 4)
    keep = [t for t in range(10) if t != 4]
    without_BHTE, without_state = chunked_gated_delta(*(x[:, :, keep] for x in (q_BHTE, k_BHTE, v_BHTE, beta_BHT,
                                                                               log_a_BHT)), 4)
    torch.testing.assert_close(with_pad_BHTE[:, :, keep], without_BHTE, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_pad_state, without_state, atol=1e-5, rtol=1e-5)
