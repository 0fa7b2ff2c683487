"""Every replacement against its teacher layer, on tiny Llama, Qwen2 and BERT teachers.

The first half checks the contract all replacements share (shape/dtype, gradients,
teacher untouched, causality, accounting, option files); the second half checks each
replacement against a plain reference (the teacher layer itself, or softmax attention).

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    DynamicCache,
    LlamaConfig,
    LlamaModel,
    Qwen2Config,
    Qwen2Model,
    Qwen3Config,
    Qwen3Model,
)

import distill
from distill.model.native import student_config
from distill.model.teacher import Teacher
from distill.replacements import Replacement, count_params, describe
from distill.replacements.gated_delta_rule import GatedDeltaRuleLayer
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.lowrank import LowRankLayer, LowRankLinear
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from distill.replacements.teacher_copy import TeacherCopy

FAMILIES = ("llama", "qwen2", "bert")
BATCH, SEQ_LEN, HIDDEN = 2, 10, 64
LAYER_IDX = 1
CONF_DIR = Path(distill.__file__).parent / "conf" / "replacement"


# Small settings: chunk_size < SEQ_LEN so the causal kernel carries state across chunks, a
# window shorter than the sequence, a gate that decays noticeably.
REPLACEMENTS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "copy": (TeacherCopy, {}),
    "mlp": (ResidualMLP, {"hidden_mult": 1.0}),
    "linear_attention": (LinearAttentionLayer, {"chunk_size": 4}),
    "sliding_window_linear": (SlidingWindowLinearLayer, {"chunk_size": 4, "window": 3}),
    "gated_linear_attention": (GatedLinearAttentionLayer, {"chunk_size": 4, "gate_init": 0.9}),
    "gated_delta_rule": (GatedDeltaRuleLayer, {"chunk_size": 4, "gate_init": 0.9, "beta_init": 0.5}),
    "pruned": (PrunedLayer, {"mlp_keep_fraction": 0.5}),
    "lowrank": (LowRankLayer, {"rank_fraction": 0.25}),
}
CAUSAL_ONLY = ("gated_delta_rule",)
"""Kinds encoders refuse (test_the_delta_rule_is_refused_for_encoders_before_training)."""


def _tiny_teacher(family: str, dtype: torch.dtype = torch.float32) -> Teacher:
    """A 2-layer teacher with random weights; a large init range makes layers non-trivial."""
    torch.manual_seed(0)
    sizes = {
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 128,
        "initializer_range": 0.2,
    }
    if family == "llama":
        model = LlamaModel(LlamaConfig(**sizes, num_key_value_heads=2))
    elif family == "qwen2":
        model = Qwen2Model(Qwen2Config(**sizes, num_key_value_heads=2))
    elif family == "qwen3":  # per-head q/k RMSNorm before rotary
        model = Qwen3Model(Qwen3Config(**sizes, num_key_value_heads=2, head_dim=16))
    else:
        model = BertModel(
            BertConfig(**sizes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        )
    return Teacher(model.to(dtype))


@pytest.fixture(scope="module", params=FAMILIES)
def teacher(request: pytest.FixtureRequest) -> Teacher:
    return _tiny_teacher(request.param)


@pytest.fixture(scope="module")
def llama_teacher() -> Teacher:
    return _tiny_teacher("llama")


def _build(name: str, teacher: Teacher, **overrides: Any) -> nn.Module:
    """Replacement ``name`` at its small test settings (fewer KV heads for pruned GQA)."""
    _skip_refused(name, teacher)
    cls, options = REPLACEMENTS[name]
    options = {**options, **overrides}
    if name == "pruned" and teacher.family == "llama":
        options.setdefault("num_key_value_heads", 1)
    return cls(teacher=teacher, layer_idx=LAYER_IDX, **options)


def _skip_refused(name: str, teacher: Teacher) -> None:
    if name in CAUSAL_ONLY and not teacher.causal:
        pytest.skip(f"{name} is causal only: encoders refuse it")


def _hidden(teacher: Teacher, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ_LEN, HIDDEN, generator=gen).to(teacher.dtype)


def _teacher_output(teacher: Teacher, hidden_BTD: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return teacher.run_layer(teacher.layers[LAYER_IDX], hidden_BTD)


# ---------------------------------------------------------------- shared contract


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_output_keeps_shape_and_dtype(name: str, teacher: Teacher) -> None:
    replacement = _build(name, teacher)
    hidden_BTD = _hidden(teacher)
    assert isinstance(replacement, Replacement)
    out_BTD = replacement(hidden_BTD)
    assert out_BTD.shape == hidden_BTD.shape
    assert out_BTD.dtype == hidden_BTD.dtype
    assert torch.isfinite(out_BTD).all()


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_bfloat16_teacher_gives_bfloat16_replacement(name: str) -> None:
    teacher = _tiny_teacher("llama", torch.bfloat16)
    replacement = _build(name, teacher)
    assert {p.dtype for p in replacement.parameters()} == {torch.bfloat16}
    assert replacement(_hidden(teacher)).dtype == torch.bfloat16


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_gradients_reach_replacement_and_not_teacher(name: str, teacher: Teacher) -> None:
    replacement = _build(name, teacher)
    hidden_BTD = _hidden(teacher)
    target_BTD = _teacher_output(teacher, hidden_BTD) + 0.1 * torch.randn_like(hidden_BTD)
    F.mse_loss(replacement(hidden_BTD), target_BTD).backward()
    for param_name, param in replacement.named_parameters():
        assert param.requires_grad, param_name
        assert param.grad is not None and param.grad.abs().sum() > 0, param_name
    assert all(p.grad is None and not p.requires_grad for p in teacher.model.parameters())


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_training_leaves_teacher_weights_unchanged(name: str, teacher: Teacher) -> None:
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    replacement = _build(name, teacher)
    teacher_storage = {p.untyped_storage().data_ptr() for p in teacher.model.parameters()}
    assert not teacher_storage & {p.untyped_storage().data_ptr() for p in replacement.parameters()}
    optimizer = torch.optim.AdamW(replacement.parameters(), lr=1e-2)
    hidden_BTD = _hidden(teacher)
    for _ in range(3):
        optimizer.zero_grad()
        replacement(hidden_BTD).square().mean().backward()
        optimizer.step()
    for key, value in teacher.model.state_dict().items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_teacher_stays_out_of_state_dict_and_deep_copies(name: str, llama_teacher: Teacher) -> None:
    replacement = _build(name, llama_teacher)
    assert not any("teacher" in key for key in replacement.state_dict())
    teacher_ids = {id(p) for p in llama_teacher.model.parameters()}
    assert not teacher_ids & {id(p) for p in replacement.parameters()}
    clone = copy.deepcopy(replacement)
    if hasattr(replacement, "teacher_handle"):
        assert clone.teacher_handle.teacher is llama_teacher
    hidden_BTD = _hidden(llama_teacher)
    torch.testing.assert_close(clone(hidden_BTD), replacement(hidden_BTD), atol=0, rtol=0)


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_decoders_are_causal_and_encoders_bidirectional(name: str, teacher: Teacher) -> None:
    replacement = _build(name, teacher)
    hidden_BTD = _hidden(teacher)
    changed_BTD = hidden_BTD.clone()
    changed_BTD[:, 6:] = torch.randn_like(changed_BTD[:, 6:])
    with torch.no_grad():
        out_BTD, changed_out_BTD = replacement(hidden_BTD), replacement(changed_BTD)
    assert not torch.allclose(out_BTD[:, 6:], changed_out_BTD[:, 6:])
    past_unchanged = torch.allclose(out_BTD[:, :6], changed_out_BTD[:, :6], atol=1e-6, rtol=0)
    token_wise = name == "mlp"
    assert past_unchanged == (teacher.causal or token_wise)


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_describe_counts_replacement_and_teacher_layer(name: str, teacher: Teacher) -> None:
    replacement = _build(name, teacher)
    report = describe(replacement, teacher, seq_len=128)
    assert report["params"] == count_params(replacement)
    assert report["teacher_params"] == count_params(teacher.layers[LAYER_IDX])
    assert report["teacher_flops_per_token"] == teacher.layer_flops_per_token(128)
    assert report["flops_per_token"] == replacement.flops_per_token(128)
    assert report["params_ratio"] == report["params"] / report["teacher_params"]
    assert report["flops_ratio"] == report["flops_per_token"] / report["teacher_flops_per_token"]


@pytest.mark.parametrize("name", ["mlp", "lowrank", "pruned"])
def test_small_settings_are_smaller_and_cheaper(name: str, llama_teacher: Teacher) -> None:
    report = describe(_build(name, llama_teacher), llama_teacher, seq_len=128)
    assert report["params_ratio"] < 1
    assert report["flops_ratio"] < 1


@pytest.mark.parametrize("name", ["linear_attention", "sliding_window_linear", "gated_linear_attention", "gated_delta_rule"])
def test_linear_attention_kinds_are_cheaper_at_long_context(name: str, llama_teacher: Teacher) -> None:
    replacement = _build(name, llama_teacher)
    assert describe(replacement, llama_teacher, seq_len=4096)["flops_ratio"] < 0.5
    assert replacement.flops_per_token(4096) == replacement.flops_per_token(8192)


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_layer_idx_out_of_range_is_rejected(name: str, llama_teacher: Teacher) -> None:
    cls, options = REPLACEMENTS[name]
    with pytest.raises(ValueError, match="layer_idx=2"):
        cls(teacher=llama_teacher, layer_idx=2, **options)


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF_DIR.glob("*.yaml")))
def test_option_file_builds_a_working_replacement(name: str, teacher: Teacher) -> None:
    path = CONF_DIR / f"{name}.yaml"
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# ")
    assert f"python -m distill mode=local replacement={name}" in path.read_text()
    cfg = OmegaConf.load(path)
    assert cfg._partial_ is True
    _skip_refused(name, teacher)
    replacement = instantiate(cfg)(teacher=teacher, layer_idx=LAYER_IDX)
    assert replacement(_hidden(teacher)).shape == (BATCH, SEQ_LEN, HIDDEN)


def test_option_files_cover_every_replacement() -> None:
    assert {p.stem for p in CONF_DIR.glob("*.yaml")} == set(REPLACEMENTS)


# ---------------------------------------------------------------- TeacherCopy


def test_copy_equals_teacher_layer_exactly(teacher: Teacher) -> None:
    hidden_BTD = _hidden(teacher)
    out_BTD = _build("copy", teacher)(hidden_BTD)
    torch.testing.assert_close(out_BTD, _teacher_output(teacher, hidden_BTD), atol=0, rtol=0)


def test_copy_trains_to_zero_loss(llama_teacher: Teacher) -> None:
    """The pipeline sanity check: a copy sits at zero loss, and a perturbed one returns."""
    replacement = _build("copy", llama_teacher)
    hidden_BTD = _hidden(llama_teacher)
    target_BTD = _teacher_output(llama_teacher, hidden_BTD)
    assert F.mse_loss(replacement(hidden_BTD), target_BTD).item() == 0.0
    with torch.no_grad():
        for param in replacement.parameters():
            param.add_(0.02 * torch.randn_like(param))
    optimizer = torch.optim.Adam(replacement.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.mse_loss(replacement(hidden_BTD), target_BTD)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


# ---------------------------------------------------------------- ResidualMLP


def test_mlp_starts_near_identity_and_exactly_at_zero_init(teacher: Teacher) -> None:
    hidden_BTD = _hidden(teacher)
    exact = _build("mlp", teacher, output_init_std=0.0)
    torch.testing.assert_close(exact(hidden_BTD), hidden_BTD, atol=0, rtol=0)
    near = _build("mlp", teacher)
    assert (near(hidden_BTD) - hidden_BTD).abs().max() < 0.05


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"hidden_mult": 0.0}, "replacement.hidden_mult"),
        ({"activation": "nope"}, "replacement.activation"),
        ({"output_init_std": -1.0}, "replacement.output_init_std"),
    ],
)
def test_mlp_rejects_bad_options(options: dict, key: str, llama_teacher: Teacher) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _build("mlp", llama_teacher, **options)


# ---------------------------------------------------------------- LowRankLayer


def test_lowrank_at_full_rank_matches_teacher_layer(teacher: Teacher) -> None:
    replacement = _build("lowrank", teacher, rank_fraction=1.0)
    hidden_BTD = _hidden(teacher)
    expected_BTD = _teacher_output(teacher, hidden_BTD)
    torch.testing.assert_close(replacement(hidden_BTD), expected_BTD, atol=1e-4, rtol=1e-4)


def test_lowrank_factorises_only_the_selected_maps(llama_teacher: Teacher) -> None:
    replacement = _build("lowrank", llama_teacher, rank_fraction=None, rank=8, modules=["mlp.*"])
    factorised = {n for n, m in replacement.layer.named_modules() if isinstance(m, LowRankLinear)}
    assert factorised == {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert isinstance(replacement.layer.self_attn.q_proj, nn.Linear)
    assert replacement.layer.mlp.up_proj.rank == 8


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"rank_fraction": None, "rank": 33}, "replacement.rank=33"),
        ({"rank_fraction": None, "rank": 0}, "replacement.rank=0"),
        ({"rank": 4}, "Choose one"),
        ({"rank_fraction": 1.5}, "replacement.rank_fraction"),
        ({"modules": ["attn.nothing"]}, "replacement.modules"),
    ],
)
def test_lowrank_rejects_bad_options(options: dict, key: str, llama_teacher: Teacher) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _build("lowrank", llama_teacher, **options)


# ---------------------------------------------------------------- PrunedLayer


@pytest.mark.parametrize(
    "options",
    [{"mlp_keep_fraction": 1.0}, {"mlp_keep_fraction": None, "intermediate_size": 128}],
)
def test_pruned_keeping_everything_equals_teacher_layer(options: dict, teacher: Teacher) -> None:
    if teacher.family == "llama":
        options = {**options, "num_key_value_heads": 2}
    replacement = _build("pruned", teacher, **options)
    assert type(replacement.layer) is type(teacher.layers[LAYER_IDX])
    hidden_BTD = _hidden(teacher)
    expected_BTD = _teacher_output(teacher, hidden_BTD)
    torch.testing.assert_close(replacement(hidden_BTD), expected_BTD, atol=1e-6, rtol=1e-6)


def test_pruned_mlp_keeps_highest_scoring_units(llama_teacher: Teacher) -> None:
    mlp = llama_teacher.layers[LAYER_IDX].mlp
    scores = [
        mlp.gate_proj.weight[j].norm()
        * mlp.up_proj.weight[j].norm()
        * mlp.down_proj.weight[:, j].norm()
        for j in range(128)
    ]
    expected = sorted(sorted(range(128), key=lambda j: -scores[j])[:32])
    replacement = _build("pruned", llama_teacher, mlp_keep_fraction=0.25, num_key_value_heads=None)
    pruned_mlp = replacement.layer.mlp
    assert pruned_mlp.intermediate_size == 32
    torch.testing.assert_close(pruned_mlp.gate_proj.weight, mlp.gate_proj.weight[expected])
    torch.testing.assert_close(pruned_mlp.down_proj.weight, mlp.down_proj.weight[:, expected])


@pytest.mark.parametrize("kv_merge", ["mean", "norm"])
def test_pruned_kv_heads_merge_each_group(kv_merge: str) -> None:
    teacher = _tiny_teacher("qwen2")  # Qwen2: K/V biases must be merged too
    attn = teacher.layers[LAYER_IDX].self_attn
    head_dim = attn.head_dim
    replacement = _build(
        "pruned", teacher, mlp_keep_fraction=None, num_key_value_heads=1, kv_merge=kv_merge
    )
    merged = replacement.layer.self_attn
    assert merged.num_key_value_groups == 4
    k_heads = attn.k_proj.weight.unflatten(0, (2, head_dim))
    v_heads = attn.v_proj.weight.unflatten(0, (2, head_dim))
    if kv_merge == "mean":
        expected_k, expected_bias = k_heads.mean(0), attn.k_proj.bias.unflatten(0, (2, -1)).mean(0)
    else:
        best = int((k_heads.flatten(1).norm(dim=1) * v_heads.flatten(1).norm(dim=1)).argmax())
        expected_k, expected_bias = k_heads[best], attn.k_proj.bias.unflatten(0, (2, -1))[best]
    torch.testing.assert_close(merged.k_proj.weight, expected_k)
    torch.testing.assert_close(merged.k_proj.bias, expected_bias)


@pytest.mark.parametrize(
    ("family", "options", "key"),
    [
        ("llama", {"intermediate_size": 64}, "Choose one"),
        (
            "llama",
            {"mlp_keep_fraction": None, "intermediate_size": 256},
            "replacement.intermediate_size",
        ),
        ("llama", {"mlp_keep_fraction": 0.0}, "replacement.mlp_keep_fraction"),
        ("llama", {"num_key_value_heads": 3}, "replacement.num_key_value_heads"),
        ("llama", {"kv_merge": "max"}, "replacement.kv_merge"),
        ("llama", {"mlp_keep_fraction": None, "num_key_value_heads": None}, "nothing to prune"),
        ("bert", {"num_key_value_heads": 1}, "replacement.num_key_value_heads"),
    ],
)
def test_pruned_rejects_bad_options(family: str, options: dict, key: str) -> None:
    teacher = _tiny_teacher(family)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _build("pruned", teacher, **options)


def test_pruned_refuses_a_layer_without_the_expected_mlp() -> None:
    teacher = _tiny_teacher("llama")
    del teacher.layers[LAYER_IDX].mlp.gate_proj  # as in a fused gate_up MLP
    with pytest.raises(ValueError, match=r"replacement=pruned cannot prune.*mlp\.gate_proj"):
        _build("pruned", teacher)


# ---------------------------------------------------------------- LinearAttentionLayer


class _SoftmaxAttention(nn.Module):
    """Plain softmax attention with the LinearAttention call signature (decoders also return
    a state, None here: it is only called without a cache)."""

    def __init__(self, causal: bool, decoder: bool) -> None:
        super().__init__()
        self.causal = causal
        self.decoder = decoder

    def forward(
        self, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor, mask_BT=None, state=None
    ) -> torch.Tensor | tuple[torch.Tensor, None]:
        out_BHTE = F.scaled_dot_product_attention(
            q_BHTE.float(), k_BHTE.float(), v_BHTE.float(), is_causal=self.causal
        )
        return (out_BHTE, None) if self.decoder else out_BHTE


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3"])
def test_linear_attention_wiring_matches_teacher_with_softmax_kernel(family: str) -> None:
    """Projections, rotary, GQA, q/k norms, norms and MLP are right: only the kernel differs."""
    teacher = _tiny_teacher(family)
    replacement = _build("linear_attention", teacher)
    replacement.block.attention = _SoftmaxAttention(teacher.causal, teacher.family != "bert")
    hidden_BTD = _hidden(teacher)
    expected_BTD = _teacher_output(teacher, hidden_BTD)
    torch.testing.assert_close(replacement(hidden_BTD), expected_BTD, atol=1e-5, rtol=1e-5)


def test_linear_attention_refuses_layers_with_unknown_parts() -> None:
    teacher = _tiny_teacher("llama")
    teacher.layers[LAYER_IDX].pre_feedforward_layernorm = nn.Identity()  # as in Gemma2
    with pytest.raises(ValueError, match="pre_feedforward_layernorm"):
        _build("linear_attention", teacher)


@pytest.mark.parametrize("options", [{"feature_map": "elu"}, {"feature_dim": 8}])
def test_linear_attention_feature_options(options: dict, llama_teacher: Teacher) -> None:
    replacement = _build("linear_attention", llama_teacher, **options)
    assert replacement(_hidden(llama_teacher)).shape == (BATCH, SEQ_LEN, HIDDEN)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"feature_map": "relu"}, "replacement.feature_map"),
        ({"feature_dim": 0}, "replacement.feature_dim"),
        ({"chunk_size": 0}, "replacement.chunk_size"),
    ],
)
def test_linear_attention_rejects_bad_options(
    options: dict, key: str, llama_teacher: Teacher
) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _build("linear_attention", llama_teacher, **options)


# ---------------------------------------------------------------- SlidingWindowLinearLayer, GatedLinearAttentionLayer


def test_a_window_covering_the_sequence_is_the_teacher_layer(teacher: Teacher) -> None:
    """Nothing is older than the window: exact softmax attention, so the teacher layer itself (to
    float32 rounding through the tiny teacher's large weights; the kernel is held to 1e-5 in
    test_replacement_parts)."""
    replacement = _build("sliding_window_linear", teacher, window=SEQ_LEN)
    hidden_BTD = _hidden(teacher)
    torch.testing.assert_close(replacement(hidden_BTD), _teacher_output(teacher, hidden_BTD), atol=1e-4, rtol=1e-4)


def test_the_gate_starts_at_ungated_linear_attention(teacher: Teacher) -> None:
    """A gate opened (nearly) fully is linear attention with the same weights; the default start
    is much closer to it than linear attention is to the teacher."""
    hidden_BTD = _hidden(teacher)
    linear_BTD = _build("linear_attention", teacher)(hidden_BTD)
    open_BTD = _build("gated_linear_attention", teacher, gate_init=1 - 1e-7)(hidden_BTD)
    torch.testing.assert_close(open_BTD, linear_BTD, atol=1e-4, rtol=1e-4)
    default_BTD = _build("gated_linear_attention", teacher, gate_init=0.999)(hidden_BTD)
    teacher_gap = (linear_BTD - _teacher_output(teacher, hidden_BTD)).norm()
    assert (default_BTD - linear_BTD).norm() < 0.05 * teacher_gap


@pytest.mark.parametrize(
    ("name", "options", "key"),
    [
        ("sliding_window_linear", {"window": 0}, "replacement.window"),
        ("sliding_window_linear", {"window": 2.5}, "replacement.window"),
        ("sliding_window_linear", {"feature_map": "relu"}, "replacement.feature_map"),
        ("gated_linear_attention", {"gate_init": 1.0}, "replacement.gate_init"),
        ("gated_linear_attention", {"gate_init": 0.0}, "replacement.gate_init"),
        ("gated_linear_attention", {"chunk_size": 0}, "replacement.chunk_size"),
    ],
)
def test_window_and_gated_kinds_reject_bad_options(name: str, options: dict, key: str, llama_teacher: Teacher) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _build(name, llama_teacher, **options)


# ---------------------------------------------------------------- padding, positions, cache


def _padded(teacher: Teacher, padding: str, length: int = 6) -> tuple[torch.Tensor, ...]:
    """A batch whose second row is ``length`` real positions padded with noise, its 2D mask,
    the positions a model gives it (from the mask, as ``generate`` does) and the row alone."""
    hidden_BTD = _hidden(teacher)
    alone_1LD = _hidden(teacher, seed=2)[1:, :length]
    noise_1PD = 10 * torch.randn(1, SEQ_LEN - length, HIDDEN).to(teacher.dtype)
    row = [alone_1LD, noise_1PD] if padding == "right" else [noise_1PD, alone_1LD]
    hidden_BTD = torch.cat([hidden_BTD[:1], torch.cat(row, dim=1)])
    real_T = torch.arange(SEQ_LEN) < length if padding == "right" else torch.arange(SEQ_LEN) >= SEQ_LEN - length
    mask_BT = torch.stack([torch.ones(SEQ_LEN, dtype=torch.bool), real_T]).long()
    positions_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    return hidden_BTD, mask_BT, positions_BT, alone_1LD, real_T


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", REPLACEMENTS)
def test_padded_batch_equals_one_by_one(name: str, padding: str, teacher: Teacher) -> None:
    """Padded positions contribute nothing: the padded row's real positions equal the row run alone."""
    replacement = _build(name, teacher)
    hidden_BTD, mask_BT, positions_BT, alone_1LD, real_T = _padded(teacher, padding)
    with torch.no_grad():
        batch_BTD = replacement(hidden_BTD, attention_mask=mask_BT, position_ids=positions_BT)
        expected_1LD = replacement(alone_1LD)
    torch.testing.assert_close(batch_BTD[1:, real_T], expected_1LD, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", REPLACEMENTS)
def test_left_padded_decoding_with_cache_equals_one_by_one(name: str, teacher: Teacher) -> None:
    """Prefill a left-padded prompt into the cache, then decode position by position: the same
    outputs as the unpadded row decoded alone, and as the whole row without a cache."""
    if not teacher.causal:
        pytest.skip("encoders keep no cache")
    replacement = _build(name, teacher)
    hidden_BTD, mask_BT, positions_BT, alone_1LD, real_T = _padded(teacher, "left")
    config = student_config(teacher, {LAYER_IDX: replacement.layer_spec()})
    with torch.no_grad():
        batch_BTD = _decode_with_cache(replacement, config, hidden_BTD, mask_BT, positions_BT, num_steps=3)
        alone_1LD = _decode_with_cache(replacement, config, alone_1LD, None, None, num_steps=3)
        full_1LD = replacement(_padded(teacher, "left")[3])
    torch.testing.assert_close(batch_BTD[1:, real_T], alone_1LD, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone_1LD, full_1LD, atol=1e-5, rtol=1e-5)


def _decode_with_cache(replacement: nn.Module, config: Any, hidden_BTD: torch.Tensor, mask_BT: torch.Tensor | None,
                       positions_BT: torch.Tensor | None, num_steps: int) -> torch.Tensor:
    """Outputs of a prefill of all but ``num_steps`` positions, then one call per position, all
    through one cache (masks over past + new positions, positions of the new ones, as a model passes)."""
    cache = DynamicCache(config=config)
    ends = [hidden_BTD.shape[1] - num_steps, *range(hidden_BTD.shape[1] - num_steps + 1, hidden_BTD.shape[1] + 1)]
    outs, start = [], 0
    for end in ends:
        mask = None if mask_BT is None else mask_BT[:, :end]
        positions = None if positions_BT is None else positions_BT[:, start:end]
        outs.append(replacement(hidden_BTD[:, start:end], mask, positions, cache))
        start = end
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------- GatedDeltaRuleLayer


def test_the_delta_rule_is_refused_for_encoders_before_training() -> None:
    with pytest.raises(ValueError, match="replacement=gated_delta_rule cannot reproduce the bert teacher's layers: "
                                         "attention in both directions"):
        GatedDeltaRuleLayer(_tiny_teacher("bert"), LAYER_IDX)


@pytest.mark.parametrize(("options", "key"), [({"gate_init": 1.0}, "replacement.gate_init"),
                                              ({"beta_init": 0.0}, "replacement.beta_init"),
                                              ({"chunk_size": 0}, "replacement.chunk_size")])
def test_the_delta_rule_rejects_bad_options(options: dict, key: str, llama_teacher: Teacher) -> None:
    with pytest.raises(ValueError, match=key):
        GatedDeltaRuleLayer(llama_teacher, LAYER_IDX, **options)


def test_the_delta_rule_keeps_no_feature_map_and_exports_its_gates(llama_teacher: Teacher) -> None:
    layer = _build("gated_delta_rule", llama_teacher)
    assert layer.layer_spec() == {"kind": "gated_delta_rule", "chunk_size": 4, "gate_init": 0.9, "beta_init": 0.5}
    new = {name for name, _ in layer.block.attention.named_parameters()}
    assert new == {"gate.weight", "gate.bias", "beta.weight", "beta.bias"}
