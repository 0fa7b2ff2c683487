"""Start-up checks: settings that cannot work fail before any process starts, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distill.modes.checks import check_config
from distill.pipeline.auth import create_keys
from tests.unit.test_config import _compose
from tests.unit.train.test_sizing import LLAMA_70B


@pytest.mark.parametrize(("overrides", "message"), [
    (["teacher=hf", "teacher.name_or_path=/nonexistent/model"], "teacher.name_or_path"),
    (["student.layers=[0,7]"], "student.layers"),
    (["pipeline.slot_count=0"], "pipeline.slot_count"),
    (["pipeline.slot_count=100000000", "student.micro_batch_size=1"], "slot_count"),
    (["teacher.sleep_per_batch_s=-0.05"], "teacher.sleep_per_batch_s"),
    (["teacher.sleep_per_batch_s=50000"], "teacher.sleep_per_batch_s"),
    (["teacher.sleep_per_batch_s=nan"], "teacher.sleep_per_batch_s"),
])
def test_bad_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_compose(overrides))


def test_default_config_passes_the_checks() -> None:
    check_config(_compose([]))
    check_config(_compose(["teacher.sleep_per_batch_s=0.05"]))


@pytest.mark.parametrize(("overrides", "message"), [
    (["student.patience=2", "student.val_every_steps=0"], "student.val_every_steps"),
    (["student.max_tokens_per_stage=0"], "student.max_tokens_per_stage"),
    (["student.e2e.steps=5", "student.e2e.temperature=0"], "student.e2e.temperature"),
    (["student.e2e.steps=5", "student.e2e.parallel=fsdp", "student.e2e.trainable=lora"], "student.e2e.parallel"),
    (["student.e2e.steps=5", "student.e2e.loss_chunk_tokens=0"], "student.e2e.loss_chunk_tokens"),
])
def test_bad_quality_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_compose(overrides))


def test_quality_settings_pass_the_checks() -> None:
    check_config(_compose(["student=e2e", "student.inputs=mix", "student.patience=2", "student.val_every_steps=10",
                           "student.max_tokens_per_stage=100000"]))
    check_config(_compose(["student=e2e", "teacher=tiny_bert"]))  # an encoder's end-to-end stage


@pytest.mark.parametrize(("overrides", "message"), [
    (["student.hybrid.keep_softmax=1", "student.hybrid.max_gap=0.02"], "student.hybrid.keep_softmax"),
    (["student.hybrid.keep_softmax=4"], "student.hybrid.keep_softmax"),
    (["student.hybrid.keep_softmax=2", "student.layers=[0,1]"], "student.hybrid.keep_softmax"),
    (["student.hybrid.max_gap=0"], "student.hybrid.max_gap"),
    (["student.hybrid.keep_softmax=1", "student.hybrid.steps=0"], "student.hybrid.steps"),
])
def test_bad_hybrid_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_compose(overrides))


def test_auth_settings_are_checked_per_mode(tmp_path: Path) -> None:
    missing = str(tmp_path / "nokeys")
    with pytest.raises(ValueError, match=r"pipeline\.auth_keys_dir=.*does not exist.*mode=keys"):
        check_config(_compose(["mode=worker", f"pipeline.auth_keys_dir={missing}"]))
    create_keys(tmp_path / "keys", ["w0"])
    keys = f"pipeline.auth_keys_dir={tmp_path / 'keys'}"
    for mode in ("broker", "worker", "local"):  # ipc endpoints with authentication: fine
        check_config(_compose([f"mode={mode}", keys, "pipeline.auth_client=w0"]))
    with pytest.raises(ValueError, match=r"pipeline\.auth_client='w9'.*w9\.key_secret does not exist"):
        check_config(_compose(["mode=student", keys, "pipeline.auth_client=w9"]))
    check_config(_compose(["mode=broker", keys, "pipeline.auth_client=w9"]))  # the broker needs no client key


def test_start_up_check_refuses_a_gpu_run_without_gpus() -> None:
    """On this CPU machine, device=gpu cannot start; the check says why before any process does."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="set device=cpu"):
        check_config(_compose(["mode=local", "device=gpu"]))
    with pytest.raises(ValueError, match="device.worker_gpu names GPU"):
        check_config(_compose(["mode=worker", "device.worker_gpu=0"]))


def test_start_up_check_names_the_memory_a_run_needs(tmp_path: Path) -> None:
    """A 70B teacher's student rank cannot hold it on this machine: refused before any process
    starts, with the number; a small teacher passes the same check."""
    big, small = tmp_path / "big", tmp_path / "small"
    for path, config in ((big, LLAMA_70B), (small, {**LLAMA_70B, "hidden_size": 64, "num_hidden_layers": 2,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "intermediate_size": 128, "vocab_size": 256})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    overrides = ["mode=student", "teacher=hf", "student.e2e.steps=5", "student.e2e.trainable=all"]
    with pytest.raises(ValueError, match=r"each student rank needs at least 1184\.7 GiB \(teacher 131\.4 GiB"):
        check_config(_compose([*overrides, f"teacher.name_or_path={big}"]))
    check_config(_compose([*overrides, f"teacher.name_or_path={small}"]))


def _teacher_dir(tmp_path: Path, model_type: str) -> Path:
    """A directory with only the config.json of a small ``model_type`` teacher (the checks read nothing else)."""
    path = tmp_path / model_type
    path.mkdir()
    config = {"model_type": model_type, "num_hidden_layers": 4, "hidden_size": 64, "architectures": ["X"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("model_type", "overrides", "message"), [
    ("gptj", [], "model_type='gptj'.*parallel residual"),
    ("gpt2", ["replacement=lowrank"], "replacement=lowrank cannot reproduce the gpt2.*Conv1D"),
    ("gpt_neox", [], "replacement=linear_attention cannot reproduce the gpt_neox.*parallel residual"),
    ("modernbert", ["replacement=mlp"], "model_type='modernbert'"),
    ("some_new_family", [], "no adapter"),
    ("olmo2", ["replacement=linear_attention"], "replacement=linear_attention cannot reproduce the olmo2.*post|norms"),
    ("phi3", ["replacement=pruned"], "replacement=pruned cannot reproduce the phi3.*fused"),
    ("granite", ["replacement=sliding_window_linear"], "residual_multiplier"),
    ("olmo2", ["replacement=pruned", "replacement.num_key_value_heads=1"], "replacement.num_key_value_heads"),
])
def test_a_family_or_kind_distill_cannot_reproduce_is_refused_before_any_process_starts(
        tmp_path: Path, model_type: str, overrides: list[str], message: str) -> None:
    teacher = _teacher_dir(tmp_path, model_type)
    with pytest.raises(ValueError, match=message):
        check_config(_compose(["teacher=hf", f"teacher.name_or_path={teacher}", *overrides]))


@pytest.mark.parametrize(("model_type", "replacement"), [
    ("gemma2", "copy"), ("granite", "mlp"), ("phi3", "lowrank"), ("olmo2", "pruned"), ("mistral", "linear_attention"),
])
def test_a_family_and_kind_distill_reproduces_passes_the_family_check(
        tmp_path: Path, model_type: str, replacement: str) -> None:
    teacher = _teacher_dir(tmp_path, model_type)
    check_config(_compose(["teacher=hf", f"teacher.name_or_path={teacher}", f"replacement={replacement}"]))
