"""record_config: the resolved config is logged and saved as config.yaml, once per run directory."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from distill.config import CONF_DIR, register_configs
from distill.modes import process


def _compose(run: Path, overrides: list[str]) -> DictConfig:
    register_configs()
    user = ["mode=local", "replacement=mlp", "student.lr=0.01", *overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        full = compose(config_name="config", overrides=[*user, f"hydra.run.dir={run}"], return_hydra_config=True)
        cfg = compose(config_name="config", overrides=user)
    full.hydra.runtime.output_dir = str(run)
    HydraConfig.instance().set_config(full)
    return cfg


@pytest.fixture(autouse=True)
def _no_hydra_config_left() -> Iterator[None]:
    yield
    HydraConfig.instance().cfg = None


def test_config_is_saved_resolved_and_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("RANK", raising=False)
    cfg = _compose(tmp_path / "run", [])
    with caplog.at_level(logging.INFO, logger="distill"):
        path = process.record_config(cfg)
    assert path == tmp_path / "run" / "config.yaml"
    saved = OmegaConf.load(path)
    assert saved.student.lr == 0.01 and saved.replacement._target_.endswith("ResidualMLP")
    assert "hydra" not in saved
    assert "config:\nmode: local\n" in caplog.text and "lr: 0.01" in caplog.text


@pytest.mark.parametrize("who", ["local_child", "rank1"])
def test_processes_sharing_a_run_dir_do_not_write_it(who: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1" if who == "rank1" else "0")
    extra = ["hydra.output_subdir=null"] if who == "local_child" else []  # as mode=local starts its children
    cfg = _compose(tmp_path / "run", extra)
    assert process.record_config(cfg) is None
    assert not (tmp_path / "run" / "config.yaml").exists()
