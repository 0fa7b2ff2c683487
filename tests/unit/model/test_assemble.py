"""distill.model.assemble: spliced students against the teacher, and the export/load round trip.

Tiny models are built from configs with a fixed seed (no hub). A student made of
TeacherCopy replacements must be the teacher, bit for bit; a ResidualMLP student must
run the model's own forward and generate; a loaded (HF-native) student must equal the
spliced one it was exported from; a format-1 directory (the layout before the native
export) still loads, as the same native model.

Shape legend: B batch, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import distill
from distill.model.assemble import SplicedLayer, export_student, load_student, splice
from distill.model.modeling.modeling_distill_bert import DistillBertModel
from distill.model.modeling.modeling_distill_llama import DistillLlamaForCausalLM
from distill.model.teacher import Teacher
from distill.replacements.mlp import ResidualMLP
from distill.replacements.teacher_copy import TeacherCopy
from tests.tiny_teachers import tiny_bert, tiny_llama

B, T, VOCAB = 2, 10, 64
CONF_DIR = Path(distill.__file__).parent / "conf" / "replacement"
SMALL_OPTIONS = {"linear_attention": {"chunk_size": 4}, "sliding_window_linear": {"chunk_size": 4, "window": 3},
                 "gated_linear_attention": {"chunk_size": 4, "gate_init": 0.9},
                 "gated_delta_rule": {"chunk_size": 4, "gate_init": 0.9}}
"""Overrides so every option file builds on the tiny teachers (chunks and windows shorter than T)."""
COPY_CFG = {"_target_": "distill.replacements.teacher_copy.TeacherCopy", "_partial_": True}
MLP_CFG = {
    "_target_": "distill.replacements.mlp.ResidualMLP",
    "_partial_": True,
    "hidden_mult": 1.0,
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads; on a shared CPU they get much slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _llama(tie: bool = False) -> Teacher:
    return tiny_llama(VOCAB, num_layers=2, tie=tie)


def _bert() -> Teacher:
    return tiny_bert(VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def llama() -> Teacher:
    return _llama()


@pytest.fixture(scope="module")
def bert() -> Teacher:
    return _bert()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _trained_mlp(teacher: Teacher, idx: int) -> ResidualMLP:
    """A ResidualMLP with random (not near-identity) weights, so a wrong load would show."""
    mlp = ResidualMLP(teacher, idx, hidden_mult=1.0)
    with torch.no_grad():
        for param in mlp.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return mlp


# ---------------------------------------------------------------------- splice


def test_copy_student_is_the_teacher(llama: Teacher) -> None:
    student = splice(llama, {idx: TeacherCopy(llama, idx) for idx in range(llama.num_layers)})
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, llama.model(ids).logits, rtol=0, atol=0)
    assert all(isinstance(layer, SplicedLayer) for layer in student.model.layers)


def test_splice_leaves_the_teacher_untouched(llama: Teacher) -> None:
    before = {k: v.clone() for k, v in llama.model.state_dict().items()}
    student = splice(llama, {1: _trained_mlp(llama, 1)})
    assert not any(isinstance(layer, SplicedLayer) for layer in llama.layers)
    assert llama.model.config.use_cache is True
    assert student.config.use_cache is False and student.generation_config.use_cache is False
    after = llama.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hidden_states_count_spliced_layers(llama: Teacher) -> None:
    """output_hidden_states keeps one entry per layer, whatever sits inside the splice."""
    student = splice(llama, {0: TeacherCopy(llama, 0), 1: _trained_mlp(llama, 1)})
    ids = _ids()
    with torch.no_grad():
        got = student(ids, output_hidden_states=True).hidden_states
        ref = llama.model(ids, output_hidden_states=True).hidden_states
    assert len(got) == len(ref) == llama.num_layers + 1
    torch.testing.assert_close(got[1], ref[1])  # layer 0 is a copy
    assert not torch.allclose(got[2], ref[2])  # layer 1 is not


def test_mlp_student_runs_forward_and_generate(llama: Teacher) -> None:
    student = splice(llama, {1: ResidualMLP(llama, 1, hidden_mult=1.0)})
    ids = _ids()
    with torch.no_grad():
        logits_BTV = student(ids).logits
    assert logits_BTV.shape == (B, T, VOCAB) and torch.isfinite(logits_BTV).all()
    out = student.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, T + 3)
    assert torch.equal(out[:, :T], ids[:1])


def test_generate_of_copy_student_matches_teacher(llama: Teacher) -> None:
    student = splice(llama, {0: TeacherCopy(llama, 0)})
    ids = _ids()[:1]
    expected = llama.model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(student.generate(ids, max_new_tokens=3, do_sample=False), expected)


def test_spliced_layer_refuses_a_kv_cache(llama: Teacher) -> None:
    student = splice(llama, {0: TeacherCopy(llama, 0)})
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False"):
        student(_ids(), use_cache=True)


def test_splice_rejects_bad_layer_index(llama: Teacher) -> None:
    with pytest.raises(ValueError, match="out of range"):
        splice(llama, {5: TeacherCopy(llama, 0)})


# ---------------------------------------------------------------------- export / load


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_round_trip(tmp_path: Path, tie: bool) -> None:
    teacher = _llama(tie=tie)
    replacements = {0: TeacherCopy(teacher, 0), 1: _trained_mlp(teacher, 1)}
    out_dir = export_student(
        teacher, "tiny-llama", replacements, {0: COPY_CFG, 1: MLP_CFG}, str(tmp_path / "student")
    )
    student = load_student(out_dir)
    ids = _ids()
    with torch.no_grad():
        expected = splice(teacher, replacements)(ids).logits
        torch.testing.assert_close(student(ids).logits, expected, rtol=0, atol=0)
    assert student.generate(ids[:1], max_new_tokens=2, do_sample=False).shape == (1, T + 2)
    assert not student.training and not any(p.requires_grad for p in student.parameters())
    assert (student.lm_head.weight is student.model.embed_tokens.weight) == tie


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("name", sorted(p.stem for p in CONF_DIR.glob("*.yaml")))
def test_every_replacement_round_trips(family: str, name: str, tmp_path: Path) -> None:
    """Each option file, given as the DictConfig the app holds, reloads to the same outputs."""
    if name == "gated_delta_rule" and family == "bert":
        pytest.skip("the delta rule is causal only: encoders refuse it")
    teacher = _llama() if family == "llama" else _bert()
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / f"{name}.yaml"), SMALL_OPTIONS.get(name, {}))
    if name == "pruned" and family == "llama":
        cfg.num_key_value_heads = 1
    replacement = instantiate(cfg)(teacher=teacher, layer_idx=1)
    with torch.no_grad():  # move off the teacher-derived init, so a re-init would show
        for param in replacement.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    out_dir = export_student(teacher, "tiny", {1: replacement}, {1: cfg}, str(tmp_path / "s"))
    ids = _ids()
    with torch.no_grad():
        expected = splice(teacher, {1: replacement})(ids)[0]
        torch.testing.assert_close(load_student(out_dir)(ids)[0], expected, rtol=0, atol=0)


def test_manifest_and_files(llama: Teacher, tmp_path: Path) -> None:
    out_dir = tmp_path / "student"
    export_student(llama, "tiny-llama", {1: _trained_mlp(llama, 1)}, {1: MLP_CFG}, str(out_dir))
    manifest = json.loads((out_dir / "distill_student.json").read_text())
    assert manifest == {
        "format": 2,
        "family": "llama",
        "teacher_source": "tiny-llama",
        "layers": {"1": MLP_CFG},
    }
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "configuration_distill_llama.py", "modeling_distill_llama.py"):
        assert (out_dir / name).is_file()
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "distill_llama" and config["architectures"] == ["DistillLlamaForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_distill_llama.DistillLlamaForCausalLM"
    assert config["distill_layers"] == {"1": _trained_mlp(llama, 1).layer_spec()}
    assert json.loads((out_dir / "generation_config.json").read_text())["use_cache"] is True


def test_round_trip_with_tokenizer(llama: Teacher, tmp_path: Path) -> None:
    """Tokenizer files land next to the model so AutoTokenizer loads from the same dir."""
    from transformers import AutoTokenizer

    from distill.model.tiny import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 4, vocab_size=300, seq_len=T)
    out_dir = export_student(
        llama,
        "tiny-llama",
        {0: TeacherCopy(llama, 0)},
        {0: COPY_CFG},
        str(tmp_path / "s"),
        tokenizer,
    )
    assert AutoTokenizer.from_pretrained(out_dir)("return x").input_ids


def test_bert_round_trip(bert: Teacher, tmp_path: Path) -> None:
    replacements = {1: _trained_mlp(bert, 1)}
    out_dir = export_student(bert, "tiny-bert", replacements, {1: MLP_CFG}, str(tmp_path / "s"))
    student = load_student(out_dir)
    assert type(student) is DistillBertModel
    ids = _ids()
    with torch.no_grad():
        expected = splice(bert, replacements)(ids).last_hidden_state
        torch.testing.assert_close(student(ids).last_hidden_state, expected, rtol=0, atol=0)


def test_load_student_in_another_dtype(llama: Teacher, tmp_path: Path) -> None:
    out_dir = export_student(
        llama, "tiny-llama", {1: _trained_mlp(llama, 1)}, {1: MLP_CFG}, str(tmp_path / "s")
    )
    student = load_student(out_dir, dtype="bfloat16")
    assert {p.dtype for p in student.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(student(_ids()).logits).all()
    with pytest.raises(ValueError, match="dtype"):
        load_student(out_dir, dtype="float8")


def test_bf16_teacher_exports_a_bf16_student(tmp_path: Path) -> None:
    """Float32-trained replacements of a bfloat16 teacher ship in bfloat16, as config.json says,
    and the loaded student computes what the spliced one did (up to bfloat16 rounding)."""
    from safetensors import safe_open

    teacher = Teacher(_llama().model.to(torch.bfloat16))
    replacements = {1: _trained_mlp(teacher, 1).float()}
    out_dir = export_student(teacher, "tiny-llama", replacements, {1: MLP_CFG}, str(tmp_path / "s"))
    assert json.loads((tmp_path / "s" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "s" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118 - safe_open is no dict == {torch.bfloat16}
    student = load_student(out_dir)
    assert {p.dtype for p in student.parameters()} == {torch.bfloat16}
    ids = _ids()
    with torch.no_grad():
        spliced = splice(teacher, replacements)(ids).logits.float()
        torch.testing.assert_close(student(ids).logits.float(), spliced, rtol=0.05, atol=0.05)


def test_export_needs_one_cfg_per_replacement(llama: Teacher, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replacement_cfgs"):
        export_student(llama, "x", {0: TeacherCopy(llama, 0)}, {}, str(tmp_path))
    with pytest.raises(ValueError, match="_target_"):
        export_student(llama, "x", {0: TeacherCopy(llama, 0)}, {0: {"a": 1}}, str(tmp_path))


def test_load_student_rejects_other_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a student directory"):
        load_student(str(tmp_path))


def test_load_student_rejects_mismatched_weights(llama: Teacher, tmp_path: Path) -> None:
    """A config.json whose layers no longer fit the saved weights: a clear error, never a
    model with freshly initialised weights."""
    out_dir = tmp_path / "s"
    export_student(llama, "x", {1: _trained_mlp(llama, 1)}, {1: MLP_CFG}, str(out_dir))
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    spec = config["distill_layers"]["1"]
    for other in ({"kind": "copy"}, {**spec, "hidden_units": 2 * spec["hidden_units"]}):  # keys, shapes
        config["distill_layers"]["1"] = other
        config_path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match="does not match"):
            load_student(str(out_dir))


def _write_format_1(teacher: Teacher, replacements: dict, cfgs: dict, out_dir: Path) -> None:
    """The layout export_student wrote before the native export (distill_student.json format 1)."""
    model = splice(teacher, replacements)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    safetensors.torch.save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    manifest = {"format": 1, "family": teacher.family, "teacher_source": "x",
                "layers": {str(k): v for k, v in cfgs.items()}}
    (out_dir / "distill_student.json").write_text(json.dumps(manifest))


def test_format_1_student_loads_as_the_native_model(tmp_path: Path) -> None:
    """Students exported by earlier versions keep loading, with the same logits, and gain the cache."""
    teacher = _llama()
    replacements = {0: TeacherCopy(teacher, 0), 1: _trained_mlp(teacher, 1)}
    _write_format_1(teacher, replacements, {0: COPY_CFG, 1: MLP_CFG}, tmp_path)
    student = load_student(str(tmp_path))
    assert type(student) is DistillLlamaForCausalLM
    ids = _ids()
    with torch.no_grad():
        expected = splice(teacher, replacements)(ids).logits
        torch.testing.assert_close(student(ids).logits, expected, rtol=0, atol=0)
    with_cache = student.generate(ids[:1], max_new_tokens=3, do_sample=False, use_cache=True)
    assert torch.equal(with_cache, student.generate(ids[:1], max_new_tokens=3, do_sample=False, use_cache=False))
