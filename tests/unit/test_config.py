"""Every config file composes; the MODES table matches conf/mode; bad settings fail early."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from distill.__main__ import MODES
from distill.config import (
    CONF_DIR,
    Config,
    E2EConfig,
    HybridConfig,
    Mode,
    PipelineConfig,
    StudentConfig,
    TeacherConfig,
    register_configs,
    typed_config,
)
from distill.errors import ConfigError

GROUPS = ["mode", "teacher", "replacement", "data", "pipeline", "device", "student", "tracking"]
REQUIRED = {"teacher/hf": ["teacher.name_or_path=/tmp"], "data/text": ["data.path=/tmp/*.txt"],
            "data/hf_dataset": ["data.dataset_name=x"]}


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _config(overrides: list[str]) -> Config:
    """The composed config as every function below ``distill.modes`` receives it (typed)."""
    return typed_config(_compose(overrides))


def schema(cls: type, **tree) -> object:
    """A schema dataclass from its defaults and a partial tree: what a test of one function
    hands it (a ``Config`` needs ``mode`` and ``replacement``, which the schema leaves open)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), tree))


def _options() -> list[tuple[str, str]]:
    return [(group, path.stem) for group in GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), _options())
def test_every_option_file_composes(group: str, option: str) -> None:
    cfg = _compose([f"{group}={option}", *REQUIRED.get(f"{group}/{option}", [])])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_modes_table_matches_mode_files() -> None:
    assert set(MODES) == {p.stem for p in (CONF_DIR / "mode").glob("*.yaml")} == {m.value for m in Mode}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_names_an_entry_point_run_mode(mode: str) -> None:
    module, function = MODES[mode]
    assert module == f"distill.modes.{mode}" and function == f"run_{mode}"
    assert callable(getattr(importlib.import_module(module), function))


def test_top_level_conf_is_the_package_conf() -> None:
    assert (Path(__file__).parents[2] / "conf").resolve() == CONF_DIR.resolve()


def test_unknown_keys_fail_at_compose_time() -> None:
    with pytest.raises(ConfigCompositionException, match="lr_typo"):
        _compose(["student.lr_typo=1"])


@pytest.mark.parametrize(("override", "choices"), [
    ("student.loss=l1", "nmse, cosine"),
    ("teacher.dtype=int8", "float32, bfloat16, float16"),
    ("student.inputs=both", "teacher, student, mix"),
    ("student.e2e.trainable=head", "replacements, lora, all"),
    ("pipeline.medium=nfs", "shm, tcp"),
    ("data.source=web", "pydoc, text, hf_dataset"),
    ("teacher.tiny.family=gpt2", "llama, bert"),
])
def test_bad_choices_fail_at_compose_time_naming_the_key_and_the_choices(override: str, choices: str) -> None:
    """Every choice is an enum of distill.config: OmegaConf refuses other values when composing."""
    with pytest.raises(ConfigCompositionException, match=re.escape(override)) as caught:
        _compose([override])
    assert f"expected one of [{choices}]" in str(caught.value.__cause__)


def test_an_installed_wheel_carries_the_config(tmp_path: Path) -> None:
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(root)], check=True, timeout=300)
    wheel = next(tmp_path.glob("distill-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "distill/conf/config.yaml" in names
    for group, option in _options():
        assert f"distill/conf/{group}/{option}.yaml" in names


@pytest.mark.parametrize(("make", "key"), [
    (lambda: StudentConfig(steps_per_stage=0), "student.steps_per_stage"),
    (lambda: StudentConfig(patience=2, val_every_steps=0), "student.patience"),
    (lambda: PipelineConfig(slot_count=0), "pipeline.slot_count"),
    (lambda: TeacherConfig(sleep_per_batch_s=float("nan")), "teacher.sleep_per_batch_s"),
    (lambda: E2EConfig(steps=5, temperature=0.0), "student.e2e.temperature"),
    (lambda: HybridConfig(keep_softmax=1, max_gap=0.02), "student.hybrid.keep_softmax"),
])
def test_each_schema_refuses_its_own_bad_keys_when_made(make, key: str) -> None:
    """A typed config cannot hold a value its own schema refuses, however it was made (a
    composed command, ``dataclasses.replace`` in code, a test): the check sits with the field."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make()
    E2EConfig(steps=0, temperature=0.0)  # no end-to-end stage: its settings are not used


def test_typed_config_of_a_command_with_a_bad_key_names_it() -> None:
    with pytest.raises(ConfigError, match=r"student\.micro_batch_size=0"):
        typed_config(_compose(["student.micro_batch_size=0"]))
