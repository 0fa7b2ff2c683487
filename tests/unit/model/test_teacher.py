"""distill.model.teacher: capture, run_layer and the stack ends against full HF forwards.

Tiny models are built from configs with a fixed seed (no hub). References come from
the model's own forward with output_hidden_states, an independent code path from the
hooks that `capture` uses.

Shape legend: B batch, T tokens, D hidden.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    GPTJConfig,
    GPTJForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from distill.model.teacher import Teacher

VOCAB = 128
NUM_LAYERS = 3
B, T = 2, 12
SMALL = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
}


def _build(kind: str, attn: str = "sdpa"):
    """A tiny model of `kind` with seeded weights and the given attention implementation."""
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=2))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=2))
    elif kind == "qwen2_sliding":  # window 4 < T on layers 1, 2: masks differ per layer
        config = Qwen2Config(
            **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
        model = Qwen2ForCausalLM(config)
    elif kind == "bert":
        model = BertModel(BertConfig(**SMALL, max_position_embeddings=64))
    else:
        raise AssertionError(kind)
    model.config._attn_implementation = attn
    return model


KINDS = ["llama", "qwen2", "qwen2_sliding", "bert"]
DECODERS = ["llama", "qwen2", "qwen2_sliding"]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def _ids_BT(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _reference(model, ids_BT: torch.Tensor):
    """(hidden_states, last_hidden_state) of a full forward."""
    base = model.base_model
    with torch.no_grad():
        out = base(input_ids=ids_BT, output_hidden_states=True)
    return out.hidden_states, out.last_hidden_state


# ------------------------------------------------------------------ family detection


@pytest.mark.parametrize(("kind", "family", "causal"), [
    ("llama", "llama", True), ("qwen2", "llama", True), ("bert", "bert", False),
])
def test_family_and_freezing(kind: str, family: str, causal: bool) -> None:
    teacher = Teacher(_build(kind))
    assert (teacher.family, teacher.causal) == (family, causal)
    assert (teacher.num_layers, teacher.hidden_size) == (NUM_LAYERS, 32)
    assert teacher.dtype == torch.float32 and teacher.device == torch.device("cpu")
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert len(teacher.layers) == NUM_LAYERS


def test_unsupported_architecture_is_rejected() -> None:
    model = GPTJForCausalLM(GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4))
    with pytest.raises(ValueError, match=r"model_type='gptj'.*parallel residual.*`teacher\.name_or_path`"):
        Teacher(model)


# ------------------------------------------------------------------ (a) capture


def test_capture_matches_full_forward(kind: str) -> None:
    model = _build(kind)
    teacher = Teacher(model)
    ids_BT = _ids_BT()
    hidden_states, last_hidden = _reference(model, ids_BT)
    captured = teacher.capture(ids_BT, list(range(NUM_LAYERS)))
    assert sorted(captured) == list(range(NUM_LAYERS))
    for idx, (input_BTD, output_BTD) in captured.items():
        assert input_BTD.shape == output_BTD.shape == (B, T, 32)
        assert not input_BTD.requires_grad and not output_BTD.requires_grad
        torch.testing.assert_close(input_BTD, hidden_states[idx], rtol=0, atol=1e-6)
        if idx < NUM_LAYERS - 1:
            torch.testing.assert_close(output_BTD, hidden_states[idx + 1], rtol=0, atol=1e-6)
    # hidden_states[-1] has the final norm applied (llama): final_hidden must add exactly that
    last_output_BTD = captured[NUM_LAYERS - 1][1]
    torch.testing.assert_close(teacher.final_hidden(last_output_BTD), last_hidden, rtol=0, atol=1e-6)


def test_capture_subset_and_embed(kind: str) -> None:
    teacher = Teacher(_build(kind))
    ids_BT = _ids_BT()
    full = teacher.capture(ids_BT, [0, 1, 2])
    subset = teacher.capture(ids_BT, [2, 0])
    assert sorted(subset) == [0, 2]
    for idx in subset:
        torch.testing.assert_close(subset[idx], full[idx], rtol=0, atol=0)
    torch.testing.assert_close(teacher.embed(ids_BT), full[0][0], rtol=0, atol=0)
    assert teacher.capture(ids_BT, []) == {}
    with pytest.raises(ValueError, match="out of range"):
        teacher.capture(ids_BT, [NUM_LAYERS])


# ------------------------------------------------------------------ (b) run_layer


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_run_layer_reproduces_captured_output(kind: str, attn: str) -> None:
    teacher = Teacher(_build(kind, attn))
    captured = teacher.capture(_ids_BT(), list(range(NUM_LAYERS)))
    for idx, (input_BTD, output_BTD) in captured.items():
        with torch.no_grad():
            torch.testing.assert_close(
                teacher.run_layer(teacher.layers[idx], input_BTD), output_BTD, rtol=0, atol=1e-5
            )


def test_run_layer_trains_a_copy(kind: str) -> None:
    teacher = Teacher(_build(kind))
    input_BTD, output_BTD = teacher.capture(_ids_BT(), [1])[1]
    student = copy.deepcopy(teacher.layers[1]).requires_grad_(True)
    loss = (teacher.run_layer(student, input_BTD) - output_BTD).pow(2).mean()
    assert loss.item() < 1e-10  # an exact copy starts at zero error
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss = (teacher.run_layer(student, input_BTD) - output_BTD).pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    assert not any(p.requires_grad for p in teacher.model.parameters())


# ------------------------------------------------------------------ (c) early stop


def test_capture_runs_only_the_layers_it_needs(kind: str) -> None:
    teacher = Teacher(_build(kind))
    calls = [0] * NUM_LAYERS
    handles = [
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(teacher.layers)
    ]
    try:
        teacher.capture(_ids_BT(), [0])
        assert calls == [1, 0, 0]
        teacher.capture(_ids_BT(), [1, 0])
        assert calls == [2, 1, 0]
    finally:
        for handle in handles:
            handle.remove()
    assert all(not layer._forward_hooks for layer in teacher.layers)  # capture cleans up


# ------------------------------------------------------------------ (d) causality


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", DECODERS)
def test_run_layer_is_causal_for_decoders(kind: str, attn: str) -> None:
    teacher = Teacher(_build(kind, attn))
    torch.manual_seed(2)
    hidden_BTD = torch.randn(B, T, 32)
    for t in (0, 5, T - 2):
        changed_BTD = hidden_BTD.clone()
        changed_BTD[:, t + 1 :] = torch.randn(B, T - t - 1, 32)
        for layer in teacher.layers:
            out_BTD = teacher.run_layer(layer, hidden_BTD)
            changed_out_BTD = teacher.run_layer(layer, changed_BTD)
            torch.testing.assert_close(changed_out_BTD[:, : t + 1], out_BTD[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(changed_out_BTD[:, t + 1 :], out_BTD[:, t + 1 :])


def test_run_layer_is_bidirectional_for_bert() -> None:
    teacher = Teacher(_build("bert"))
    torch.manual_seed(2)
    hidden_BTD = torch.randn(B, T, 32)
    changed_BTD = hidden_BTD.clone()
    changed_BTD[:, -1] = torch.randn(B, 32)
    out_BTD = teacher.run_layer(teacher.layers[0], hidden_BTD)
    assert not torch.allclose(teacher.run_layer(teacher.layers[0], changed_BTD)[:, 0], out_BTD[:, 0])


def test_sliding_window_layers_get_their_own_mask() -> None:
    """Positions further back than the window (4) must not matter on sliding layers."""
    teacher = Teacher(_build("qwen2_sliding"))
    hidden_BTD = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(3))
    changed_BTD = hidden_BTD.clone()
    changed_BTD[:, :4] = 0.0
    for idx, sees_far_past in [(0, True), (1, False), (2, False)]:
        out_BTD = teacher.run_layer(teacher.layers[idx], hidden_BTD)[:, -1]
        changed_out_BTD = teacher.run_layer(teacher.layers[idx], changed_BTD)[:, -1]
        assert torch.allclose(out_BTD, changed_out_BTD, atol=1e-6) != sees_far_past


# ------------------------------------------------------------------ stack ends, cost


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_final_logits_match_model_logits(kind: str) -> None:
    model = _build(kind)
    teacher = Teacher(model)
    ids_BT = _ids_BT()
    last_output_BTD = teacher.capture(ids_BT, [NUM_LAYERS - 1])[NUM_LAYERS - 1][1]
    with torch.no_grad():
        logits_BTV = model(input_ids=ids_BT).logits
        torch.testing.assert_close(teacher.final_logits(last_output_BTD), logits_BTV, rtol=0, atol=1e-5)


def test_final_logits_raise_for_bert() -> None:
    teacher = Teacher(_build("bert"))
    with pytest.raises(ValueError, match="final_hidden"):
        teacher.final_logits(torch.zeros(1, 2, 32))


def test_layer_flops_per_token() -> None:
    teacher = Teacher(_build("llama"))  # hidden 32, 4 heads of 8, 2 kv heads, mlp 64
    matmul_weights = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * 32 * 64
    assert teacher.layer_flops_per_token(100) == 2 * matmul_weights + 4 * 100 * 32
    assert teacher.layer_flops_per_token(200) > teacher.layer_flops_per_token(100)


# ------------------------------------------------------------------ (e) from_pretrained


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_from_pretrained_local_dir(kind: str, tmp_path: Path) -> None:
    model = _build(kind)
    model.save_pretrained(tmp_path / "ckpt")
    teacher = Teacher.from_pretrained(str(tmp_path / "ckpt"))
    assert type(teacher.model) is type(model)
    ids_BT = _ids_BT()
    loaded = teacher.capture(ids_BT, [1])[1]
    original = Teacher(model).capture(ids_BT, [1])[1]
    torch.testing.assert_close(loaded, original, rtol=0, atol=0)
    half = Teacher.from_pretrained(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    assert half.capture(ids_BT, [0])[0][1].dtype == torch.bfloat16


def test_from_pretrained_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"teacher\.name_or_path=.*does not exist"):
        Teacher.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"teacher\.name_or_path"):
        Teacher.from_pretrained("./no/such/dir")
    with pytest.raises(ValueError, match=r"`teacher\.dtype='float64'`"):
        Teacher.from_pretrained(str(tmp_path), dtype="float64")


def test_threads_capture_on_one_teacher_at_once() -> None:
    """Two threads capturing different layers of one teacher (a student validating while a
    worker thread serves it, as in the trainer tests) each get exactly their own layers."""
    import threading

    teacher = Teacher(_build("llama"))
    ids_BT = _ids_BT()
    want = {layers: teacher.capture(ids_BT, list(layers)) for layers in ((0,), (2,))}
    errors: list[BaseException] = []

    def run(layers: tuple[int, ...]) -> None:
        try:
            for _ in range(30):
                got = teacher.capture(ids_BT, list(layers))
                assert set(got) == set(layers)
                for idx in layers:
                    torch.testing.assert_close(got[idx][1], want[layers][idx][1])
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(layers,)) for layers in want]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[0]
