"""Start-up checks: settings that cannot work fail before any process starts, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill.modes.checks import check_config
from distill.pipeline.auth import create_keys
from tests.unit.test_config import _compose


@pytest.mark.parametrize(("overrides", "message"), [
    (["teacher=hf", "teacher.name_or_path=/nonexistent/model"], "teacher.name_or_path"),
    (["student.layers=[0,7]"], "student.layers"),
    (["pipeline.slot_count=0"], "pipeline.slot_count"),
    (["pipeline.slot_count=100000000", "student.micro_batch_size=1"], "slot_count"),
])
def test_bad_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_compose(overrides))


def test_default_config_passes_the_checks() -> None:
    check_config(_compose([]))


@pytest.mark.parametrize(("overrides", "message"), [
    (["student.patience=2", "student.val_every_steps=0"], "student.val_every_steps"),
    (["student.max_tokens_per_stage=0"], "student.max_tokens_per_stage"),
    (["student.e2e.steps=5", "student.e2e.temperature=0"], "student.e2e.temperature"),
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
