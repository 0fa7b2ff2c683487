"""distill.model.tiny (and its cache, tiny_cache): the offline teacher is built once, cached
atomically, and has learned."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BertModel, LlamaForCausalLM

from distill.model import tiny, tiny_cache, tiny_recipe
from distill.model.data import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SPLIT_SEED,
    build_chunks,
    load_documents,
)
from distill.model.teacher import Teacher

SMALL = {
    "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 32,
    "vocab_size": 300, "train_steps": 30, "batch_size": 8,
}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_cache")


@pytest.fixture(scope="module")
def teacher_dir(cache_root: Path) -> str:
    return tiny_cache.tiny_teacher_dir(str(cache_root), **SMALL)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_loads_back_offline(teacher_dir: str, cache_root: Path, offline: None) -> None:
    assert Path(teacher_dir).parent == cache_root
    assert Path(teacher_dir).name.startswith("tiny-")
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 2)
    assert len(tokenizer) == model.config.vocab_size == 300
    assert tokenizer.eos_token == tiny_recipe.EOS_TOKEN and tokenizer.pad_token == tiny_recipe.PAD_TOKEN
    assert model.config.eos_token_id == tokenizer.eos_token_id
    text = "def f(x):\n    return x ** 2  # ünïcode"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: lossless
    assert Teacher.from_pretrained(teacher_dir).family == "llama"


def test_second_call_hits_the_cache(
    teacher_dir: str, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*_args) -> None:
        raise AssertionError("rebuilt a cached teacher")

    monkeypatch.setattr(tiny, "build_teacher", fail)
    start_s = time.perf_counter()
    assert tiny_cache.tiny_teacher_dir(str(cache_root), **SMALL) == teacher_dir
    assert time.perf_counter() - start_s < 0.5
    assert sorted(p.name for p in cache_root.iterdir() if p.is_dir()) == [Path(teacher_dir).name]


def test_heldout_loss_drops(teacher_dir: str) -> None:
    metrics = json.loads((Path(teacher_dir) / tiny_recipe.METRICS_FILE).read_text())
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"] - 0.5
    assert metrics["recipe"]["train_steps"] == SMALL["train_steps"]
    # recompute independently: the saved model against a fresh init of the same config
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    chunks = build_chunks(
        tokenizer, load_documents("pydoc"), SMALL["seq_len"], DEFAULT_HELDOUT_FRACTION,
        DEFAULT_SPLIT_SEED, max_heldout_chunks=32,
    )
    trained = AutoModelForCausalLM.from_pretrained(teacher_dir)
    torch.manual_seed(0)
    untrained = LlamaForCausalLM(trained.config)
    assert tiny.heldout_loss(trained, chunks.heldout_NT) < tiny.heldout_loss(untrained, chunks.heldout_NT)


def test_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(_recipe, out_dir: str) -> None:
        Path(out_dir, "partial").write_text("half-written")
        raise RuntimeError("crash mid-build")

    monkeypatch.setattr(tiny, "build_teacher", crash)
    with pytest.raises(RuntimeError, match="crash mid-build"):
        tiny_cache.tiny_teacher_dir(str(tmp_path), **SMALL)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_pre_training_shows_a_bar_with_its_steps_and_time_left(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    tiny_cache.tiny_teacher_dir(str(tmp_path), **{**SMALL, "train_steps": 7, "seed": 2})
    err = capfd.readouterr().err
    assert "pre-training the tiny LlamaForCausalLM" in err
    assert "7/7" in err and ("step/s" in err or "s/step" in err)
    assert "train loss" in err  # the bar's postfix


def _build_in_child(cache_dir: str, result_file: str) -> None:
    """Child process: build the teacher, counting how often it was really built."""
    torch.set_num_threads(1)  # two children share the cores
    built = []
    real_build = tiny.build_teacher

    def counting_build(recipe, out_dir: str) -> None:
        built.append(out_dir)
        real_build(recipe, out_dir)

    tiny.build_teacher = counting_build
    path = tiny_cache.tiny_teacher_dir(cache_dir, **{**SMALL, "train_steps": 5, "seed": 1})
    Path(result_file).write_text(json.dumps({"path": path, "built": len(built)}))


def test_concurrent_first_calls_build_once(tmp_path: Path, procs) -> None:
    results = [tmp_path / f"result{i}.json" for i in range(2)]
    children = [procs.start(_build_in_child, str(tmp_path / "cache"), str(r)) for r in results]
    for child in children:
        procs.join(child, timeout_s=120)
    outcomes = [json.loads(r.read_text()) for r in results]
    assert outcomes[0]["path"] == outcomes[1]["path"]
    assert sum(o["built"] for o in outcomes) == 1
    assert (Path(outcomes[0]["path"]) / "model.safetensors").exists()


BERT_SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 32, "vocab_size": 300,
              "train_steps": 40, "batch_size": 8}


@pytest.fixture(scope="module")
def bert_dir(cache_root: Path) -> str:
    return tiny_cache.tiny_bert_dir(str(cache_root), **BERT_SMALL)


def test_tiny_bert_is_pre_trained_and_its_layers_do_work(bert_dir: str, cache_root: Path, offline: None) -> None:
    """Masked-LM pre-training lowers the held-out loss; the saved encoder loads as a BertModel
    teacher, and skipping its layers changes its output (a random BERT's barely do)."""
    assert Path(bert_dir).parent == cache_root and Path(bert_dir).name.startswith("tiny-bert-")
    metrics = json.loads((Path(bert_dir) / tiny_recipe.METRICS_FILE).read_text())
    assert metrics["heldout_mlm_loss_after"] < metrics["heldout_mlm_loss_before"] - 0.5
    teacher = Teacher.from_pretrained(bert_dir)
    assert (teacher.family, teacher.num_layers, type(teacher.model).__name__) == ("bert", 2, "BertModel")
    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    assert tokenizer.mask_token == tiny_recipe.MASK_TOKEN and len(tokenizer) == teacher.model.config.vocab_size
    chunks = build_chunks(tokenizer, load_documents("pydoc"), BERT_SMALL["seq_len"], DEFAULT_HELDOUT_FRACTION,
                          DEFAULT_SPLIT_SEED, max_heldout_chunks=16)
    torch.manual_seed(0)
    untrained = BertModel(teacher.model.config).eval()
    trained = tiny.identity_cosine(teacher.model, chunks.heldout_NT)
    assert trained == pytest.approx(metrics["identity_cosine"], abs=0.05)
    assert trained < tiny.identity_cosine(untrained, chunks.heldout_NT) - 0.05
    assert tiny_cache.tiny_bert_dir(str(cache_root), **BERT_SMALL) == bert_dir  # cached
    assert tiny_recipe.TinyBertRecipe(**BERT_SMALL, lr=1e-3, seed=0).digest() != \
        tiny_recipe.TinyBertRecipe(**{**BERT_SMALL, "train_steps": 41}, lr=1e-3, seed=0).digest()


def test_masking_picks_about_the_share_asked_and_labels_only_those() -> None:
    batch_BT = torch.randint(3, 300, (64, 32))
    inputs_BT, labels_BT = tiny.mask_tokens(batch_BT, 2, 300, 0.15, torch.Generator().manual_seed(0))
    picked_BT = labels_BT != -100
    assert 0.12 < picked_BT.float().mean() < 0.18
    assert torch.equal(labels_BT[picked_BT], batch_BT[picked_BT])
    assert torch.equal(inputs_BT[~picked_BT], batch_BT[~picked_BT])
    assert 0.7 < (inputs_BT[picked_BT] == 2).float().mean() < 0.9  # most picked tokens are masked
