"""The HF-native student (distill.model.native + distill.model.modeling) as a user runs it.

Students of every replacement kind, and a mixed one, are exported from Llama, Qwen2 (grouped
KV heads) and Mistral (sliding window of 4 positions, shorter than the texts) teachers built
from configs, then loaded back the way a user would: greedy generation with the cache must
equal generation without it token for token, a padded batch must equal its sequences one by
one (left padding for generation, right padding for encoders), a save/load round trip must
be bit for bit, recurrent state must not grow with the context, and the modeling files
must stay self-contained (torch and transformers only; copies kept identical).

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from distill.model.assemble import export_student, load_student, splice
from distill.model.modeling import modeling_distill_bert, modeling_distill_llama
from distill.model.native import MODELING_DIR
from distill.model.teacher import Teacher
from distill.replacements.gated_delta_rule import GatedDeltaRuleLayer
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.lowrank import LowRankLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from distill.replacements.teacher_copy import TeacherCopy

VOCAB, T, NEW = 64, 10, 8
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "initializer_range": 0.2}
KINDS = {
    "copy": (TeacherCopy, {}),
    "mlp": (ResidualMLP, {"hidden_mult": 1.0}),
    "linear_attention": (LinearAttentionLayer, {"chunk_size": 4}),
    "sliding_window_linear": (SlidingWindowLinearLayer, {"chunk_size": 4, "window": 3}),
    "gated_linear_attention": (GatedLinearAttentionLayer, {"chunk_size": 4, "gate_init": 0.9}),
    "gated_delta_rule": (GatedDeltaRuleLayer, {"chunk_size": 4, "gate_init": 0.9, "beta_init": 0.5}),
    "pruned": (PrunedLayer, {"mlp_keep_fraction": 0.5}),
    "lowrank": (LowRankLayer, {"rank_fraction": 0.5}),
}
CFG = {"_target_": "recorded.only", "_partial_": True}


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads; on a shared CPU they get much slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _decoder(family: str) -> Teacher:
    torch.manual_seed(0)
    if family == "llama":
        return Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, pad_token_id=0)))
    if family == "qwen2":
        return Teacher(Qwen2ForCausalLM(Qwen2Config(**SIZES, num_key_value_heads=2, pad_token_id=0)))
    return Teacher(MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=4, sliding_window=4, pad_token_id=0)))


def _encoder() -> Teacher:
    torch.manual_seed(0)
    return Teacher(BertModel(BertConfig(**SIZES, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)))


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def decoder(request: pytest.FixtureRequest) -> Teacher:
    return _decoder(request.param)


def _replacements(teacher: Teacher, kind: str) -> dict[int, torch.nn.Module]:
    """``kind`` at layers 1 and 2 (mixed: linear attention, teacher layer, mlp), off their init."""
    if kind == "mixed":
        built = {0: LinearAttentionLayer(teacher, 0, chunk_size=4), 2: ResidualMLP(teacher, 2, hidden_mult=1.0)}
    else:
        cls, options = KINDS[kind]
        if kind == "pruned" and teacher.family == "llama":
            options = {**options, "num_key_value_heads": 1}
        built = {idx: cls(teacher, idx, **options) for idx in (1, 2)}
    with torch.no_grad():
        for module in built.values():
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    return built


def _export(teacher: Teacher, kind: str, tmp_path: Path) -> tuple[Path, dict]:
    replacements = _replacements(teacher, kind)
    out = tmp_path / f"{teacher.family}-{kind}"
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
    return out, replacements


def _ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def _greedy(model: torch.nn.Module, ids_BT: torch.Tensor, use_cache: bool, mask_BT: torch.Tensor | None = None):
    return model.generate(ids_BT, attention_mask=mask_BT, max_new_tokens=NEW, do_sample=False, use_cache=use_cache,
                          pad_token_id=0)


def _left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of different lengths as one left-padded batch (pad id 0) and its mask."""
    width = max(len(s) for s in seqs)
    ids_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    mask_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids_BT[row, width - len(seq):], mask_BT[row, width - len(seq):] = seq, 1
    return ids_BT, mask_BT


# ---------------------------------------------------------------------- cache


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_greedy_generation_with_cache_equals_without(decoder: Teacher, kind: str, tmp_path: Path) -> None:
    """Every kind keeps its decode state in the cache (KV for the teacher's attention, a fixed
    state for linear attention, a position count for token-wise layers): same tokens either way,
    and the exported student is the spliced one it came from."""
    out, replacements = _export(decoder, kind, tmp_path)
    student = load_student(str(out))
    ids_BT = _ids()
    with torch.no_grad():
        expected_BTV = splice(decoder, replacements)(ids_BT).logits
        torch.testing.assert_close(student(ids_BT).logits, expected_BTV, rtol=0, atol=0)
    with_cache = _greedy(student, ids_BT, use_cache=True)
    assert torch.equal(with_cache, _greedy(student, ids_BT, use_cache=False))
    assert with_cache.shape == (2, T + NEW)


def test_cache_layers_follow_the_replacement_kinds(tmp_path: Path) -> None:
    """KV layers where the teacher's attention runs (a sliding window for Mistral), a recurrent
    state of fixed size for linear attention, only a position count for a token-wise layer."""
    teacher = _decoder("mistral")
    out, _ = _export(teacher, "mixed", tmp_path)
    student = load_student(str(out))
    sizes = {}
    for length in (6, 24):
        cache = DynamicCache(config=student.config)
        with torch.no_grad():
            student(_ids(seed=2).repeat(1, 3)[:, :length], cache=cache, use_cache=True)
        assert cache.get_seq_length() == length
        assert [type(layer).__name__ for layer in cache.layers] == [
            "LinearAttentionLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer"]
        sizes[length] = (cache.layers[0].recurrent_states[0].shape, cache.layers[1].keys.shape[-2],
                         cache.layers[2].recurrent_states[0], int(cache.layers[2].cumulative_length_linear))
    head_dim = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    assert sizes[6][0] == sizes[24][0] == (2, 4, 2 * head_dim, head_dim + 1)  # hedgehog: 2F features
    assert sizes[24][1] <= 4  # the window, not the context
    assert sizes[6][2] is None and sizes[24][2] is None  # token-wise: positions counted, nothing kept
    assert (sizes[6][3], sizes[24][3]) == (6, 24)


def test_window_and_gated_kinds_decode_from_a_ring_and_fixed_states(tmp_path: Path) -> None:
    """Mistral (window 4) keeps layer 0: the window kind's ring is the teacher's (3 positions) and
    it reads only its own window (2 past positions) of it; the gated kind keeps a fixed state.
    Decoding position by position gives the full forward's logits to 1e-5."""
    teacher = _decoder("mistral")
    replacements = {1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                    2: GatedLinearAttentionLayer(teacher, 2, gate_init=0.9, chunk_size=4)}
    with torch.no_grad():
        for module in replacements.values():
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    out = tmp_path / "student"
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
    student = load_student(str(out))
    assert student.config.layer_types == ["sliding_attention", "hybrid_sliding", "linear_attention"]
    ids_BT = _ids(seed=3).repeat(1, 2)
    cache = DynamicCache(config=student.config)
    with torch.no_grad():
        full_BTV = student(ids_BT).logits
        steps = [student(ids_BT[:, :5], cache=cache, use_cache=True).logits]
        steps += [student(ids_BT[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(5, 2 * T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full_BTV, atol=1e-5, rtol=1e-5)
    ring, gated = cache.layers[1], cache.layers[2]
    assert type(ring).__name__ == "LinearAttentionAndSlidingWindowAttentionLayer"
    assert ring.keys.shape[-2] == 3 and ring.get_seq_length() == 2 * T
    head_dim = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    assert ring.recurrent_states[0].shape == gated.recurrent_states[0].shape == (2, 4, 2 * head_dim, head_dim + 1)


def test_a_window_wider_than_the_teachers_ring_is_refused(tmp_path: Path) -> None:
    teacher = _decoder("mistral")
    with pytest.raises(ValueError, match=r"replacement\.window <= 4"):
        SlidingWindowLinearLayer(teacher, 1, window=8)


def test_a_cache_of_another_shape_is_refused(tmp_path: Path) -> None:
    out, _ = _export(_decoder("llama"), "linear_attention", tmp_path)
    student = load_student(str(out))
    with torch.no_grad(), pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        student(_ids(), cache=DynamicCache(), use_cache=True)


# ---------------------------------------------------------------------- padding


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_left_padded_generation_equals_one_by_one(kind: str, tmp_path: Path) -> None:
    """Batched generate pads on the left: padded positions must change nothing, with or
    without the cache (positions come from the mask, as generate computes them)."""
    teacher = _decoder("qwen2")
    out, _ = _export(teacher, kind, tmp_path)
    student = load_student(str(out))
    seqs = [_ids(1, seed=5)[0], _ids(1, seed=6)[0, :6]]
    ids_BT, mask_BT = _left_padded(seqs)
    for use_cache in (True, False):
        batch = _greedy(student, ids_BT, use_cache, mask_BT)
        for row, seq in enumerate(seqs):
            alone = _greedy(student, seq[None], use_cache)
            assert torch.equal(batch[row, ids_BT.shape[1]:], alone[0, len(seq):]), (kind, use_cache, row)


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_right_padded_batch_equals_one_by_one(kind: str, tmp_path: Path) -> None:
    """Right padding (training-style batches) leaves every real position's logits unchanged."""
    teacher = _decoder("llama")
    out, _ = _export(teacher, kind, tmp_path)
    student = load_student(str(out))
    short = _ids(1, seed=7)[0, :6]
    ids_BT = torch.stack([_ids(1, seed=8)[0], torch.cat([short, torch.zeros(T - 6, dtype=torch.long)])])
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[1, 6:] = 0
    with torch.no_grad():
        batch_BTV = student(ids_BT, attention_mask=mask_BT).logits
        alone_BTV = student(short[None]).logits
    torch.testing.assert_close(batch_BTV[1, :6], alone_BTV[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_left_padded_forward_without_positions_equals_one_by_one(kind: str, tmp_path: Path) -> None:
    """A left-padded batch scored with a plain forward (tokenizer output, no ``position_ids``),
    as a user scoring prompts does: each row's logits are those of the row alone. The teacher
    gets this for free (rotary softmax attention does not care where a sequence starts); a
    linear-attention feature map of rotated queries and keys does, so the student derives the
    positions from the mask, as ``generate`` does (it differed by 0.6 in the logits before)."""
    teacher = _decoder("llama")
    out, _ = _export(teacher, kind, tmp_path)
    student = load_student(str(out))
    seqs = [_ids(1, seed=9)[0], _ids(1, seed=10)[0, :5]]
    ids_BT, mask_BT = _left_padded(seqs)
    with torch.no_grad():
        batch_BTV = student(ids_BT, attention_mask=mask_BT).logits
        for row, seq in enumerate(seqs):
            alone_BTV = student(seq[None]).logits
            torch.testing.assert_close(batch_BTV[row, -len(seq):], alone_BTV[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_encoder_padded_batch_equals_one_by_one(kind: str, padding: str, tmp_path: Path) -> None:
    """Encoders are batched with padding: real tokens' final hidden states must not see it
    (left padding passes the positions, as for any BERT). The delta rule is causal only: refused."""
    if kind == "gated_delta_rule":
        pytest.skip("encoders refuse the delta rule (test_replacements::test_the_delta_rule_is_refused_for_encoders...)")
    teacher = _encoder()
    out, _ = _export(teacher, kind, tmp_path)
    student = load_student(str(out))
    short = _ids(1, seed=9)[0, :6]
    pad = torch.zeros(T - 6, dtype=torch.long)
    row = torch.cat([short, pad]) if padding == "right" else torch.cat([pad, short])
    ids_BT = torch.stack([_ids(1, seed=10)[0], row])
    mask_BT = (torch.arange(T) < 6) if padding == "right" else (torch.arange(T) >= T - 6)
    mask_BT = torch.stack([torch.ones(T, dtype=torch.bool), mask_BT]).long()
    positions_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    real = slice(0, 6) if padding == "right" else slice(T - 6, T)
    with torch.no_grad():
        batch_BTD = student(ids_BT, attention_mask=mask_BT, position_ids=positions_BT).last_hidden_state
        alone_BTD = student(short[None]).last_hidden_state
    torch.testing.assert_close(batch_BTD[1, real], alone_BTD[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- files


def test_save_pretrained_round_trips_bit_for_bit(tmp_path: Path) -> None:
    """save_pretrained writes the modeling code and auto_map again; weights come back exactly."""
    out, _ = _export(_decoder("mistral"), "mixed", tmp_path)
    student = load_student(str(out))
    again = tmp_path / "again"
    student.save_pretrained(again)
    config = json.loads((again / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_distill_llama.DistillLlamaForCausalLM"
    assert (again / "modeling_distill_llama.py").read_text() == (out / "modeling_distill_llama.py").read_text()
    first = safetensors.torch.load_file(out / "model.safetensors")
    second = safetensors.torch.load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    reloaded = type(student).from_pretrained(again)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, student(_ids()).logits, rtol=0, atol=0)


@pytest.mark.parametrize("auto_class", [AutoModelForCausalLM, AutoModel])
def test_auto_classes_refuse_the_student_without_trust_remote_code(auto_class: type, tmp_path: Path) -> None:
    """Never a teacher-shaped model with dropped weights: the model type is ours, so the Auto
    classes need its code and say so."""
    out, _ = _export(_decoder("llama"), "linear_attention", tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code"):
        auto_class.from_pretrained(out)


ALLOWED_IMPORTS = {"__future__", "copy", "importlib", "typing", "torch", "transformers"}


@pytest.mark.parametrize("path", sorted(MODELING_DIR.glob("*_distill_*.py")), ids=lambda p: p.name)
def test_modeling_files_import_only_torch_and_transformers(path: Path) -> None:
    """They ship inside every export, where distill is not installed."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.module.startswith("configuration_distill_"), node.module
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            assert name.split(".")[0] in ALLOWED_IMPORTS, f"{path.name} imports {name}"


def _copied_from(module) -> list[tuple[str, str]]:
    """(name in modeling_distill_llama, name here) of every object marked as copied."""
    marker = "# Copied from modeling_distill_llama."
    return [(line.split(marker)[1].strip(), line) for line in inspect.getsource(module).splitlines() if marker in line]


def _source(module, dotted: str) -> str:
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    lines = [line for line in inspect.getsource(obj).splitlines() if "# Copied from" not in line]
    return "\n".join(lines)


def test_copied_code_is_identical_in_both_modeling_files() -> None:
    """transformers' single-file policy copies shared code; the copies must not drift apart
    (the family's own class names aside)."""
    copies = _copied_from(modeling_distill_bert)
    assert len(copies) >= 8
    for name, _ in copies:
        copied = _source(modeling_distill_bert, name).replace("DistillBert", "DistillLlama")
        assert copied == _source(modeling_distill_llama, name), name
