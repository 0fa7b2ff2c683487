"""Checkpoints: a stage resumed from its checkpoint trains on exactly as if never stopped;
writes are atomic; the checkpoint directory is named by what decides the weights."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from distill.train import checkpoint as ckpt
from tests.unit.test_config import _config


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return module, optimizer, scheduler


def _step(module: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """One step on data drawn from both RNGs, so a resume that loses either diverges."""
    x = torch.randn(4, 6) * random.uniform(0.5, 1.5)
    loss = (module(x) - x).pow(2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_resumed_stage_matches_an_uninterrupted_one_exactly(tmp_path: Path) -> None:
    random.seed(1)
    module, optimizer, scheduler = _setup()
    for _ in range(3):
        _step(module, optimizer, scheduler)
    ckpt.save_training_state(tmp_path, stage=2, step=3, module=module, optimizer=optimizer,
                             scheduler=scheduler, extra={"config": {"lr": 1e-2}})
    for _ in range(4):
        _step(module, optimizer, scheduler)
    uninterrupted = {k: v.clone() for k, v in module.state_dict().items()}

    torch.manual_seed(123)  # a fresh process: other weights, other RNG state
    random.seed(99)
    resumed, resumed_opt, resumed_sched = _setup(seed=7)
    state = ckpt.load_training_state(tmp_path, module=resumed, optimizer=resumed_opt, scheduler=resumed_sched)
    assert (state["stage"], state["step"], state["config"]) == (2, 3, {"lr": 1e-2})
    for _ in range(4):
        _step(resumed, resumed_opt, resumed_sched)
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name
    assert resumed_sched.last_epoch == scheduler.last_epoch


def test_training_state_belongs_to_its_stage(tmp_path: Path) -> None:
    module, optimizer, scheduler = _setup()
    assert not ckpt.has_training_state(tmp_path, 0)
    ckpt.save_training_state(tmp_path, stage=1, step=5, module=module, optimizer=optimizer,
                             scheduler=scheduler, extra={})
    assert ckpt.has_training_state(tmp_path, 1) and not ckpt.has_training_state(tmp_path, 0)


def test_an_optimizer_without_state_round_trips(tmp_path: Path) -> None:
    """Saved before the first step (no moments yet): safetensors gets a placeholder, not nothing."""
    module, optimizer, scheduler = _setup()
    ckpt.save_training_state(tmp_path, stage=0, step=0, module=module, optimizer=optimizer,
                             scheduler=scheduler, extra={})
    fresh, fresh_opt, fresh_sched = _setup(seed=3)
    ckpt.load_training_state(tmp_path, module=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert fresh_opt.state_dict()["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), module.parameters(), strict=True))


def test_a_new_checkpoint_replaces_the_old_one_whole(tmp_path: Path) -> None:
    module, optimizer, scheduler = _setup()
    for step in (1, 2):
        ckpt.save_training_state(tmp_path, stage=0, step=step, module=module, optimizer=optimizer,
                                 scheduler=scheduler, extra={})
    assert json.loads((tmp_path / "current" / "state.json").read_text())["step"] == 2
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "current")
    assert leftovers == [], f"temporary checkpoint directories left behind: {leftovers}"


def test_stage_weights_and_progress_round_trip(tmp_path: Path) -> None:
    module, _, _ = _setup()
    ckpt.save_stage_weights(tmp_path, 3, module)
    other, _, _ = _setup(seed=5)
    ckpt.load_stage_weights(tmp_path, 3, other)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), module.parameters(), strict=True))
    assert ckpt.read_progress(tmp_path) == {"finished": [], "current": None}
    ckpt.write_json_atomic(tmp_path / ckpt.PROGRESS_FILE, {"finished": [0, 3], "current": None})
    assert ckpt.read_progress(tmp_path)["finished"] == [0, 3]
    assert not list(tmp_path.glob("*.tmp"))


def test_loading_weights_of_another_architecture_fails_loudly(tmp_path: Path) -> None:
    ckpt.save_stage_weights(tmp_path, 0, nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="size mismatch|Missing key|Unexpected key"):
        ckpt.load_stage_weights(tmp_path, 0, nn.Linear(4, 5))


def test_checkpoint_fingerprint_ignores_how_batches_are_fetched_and_logged() -> None:
    """A rerun with other loader/logging settings (or teacher pace) resumes; other weights start afresh."""
    base = ckpt.config_fingerprint(_config([]), "tiny")
    assert base.startswith("linear_attention-")  # the option typed, as the README says
    same = ["student.loader_workers=2", "student.prefetch_batches=0", "student.log_every_steps=1",
            "student.checkpoint_every_steps=7", "teacher.sleep_per_batch_s=0.05"]
    assert ckpt.config_fingerprint(_config(same), "tiny") == base
    assert ckpt.config_fingerprint(_config(["student.lr=0.01"]), "tiny") != base
    assert ckpt.config_fingerprint(_config(["student.loss=cosine"]), "tiny") != base
    assert ckpt.config_fingerprint(_config([]), "other teacher") != base


def test_checkpoint_dir_is_the_setting_or_the_fingerprint(tmp_path: Path) -> None:
    assert ckpt.checkpoint_dir(_config([f"checkpoint_dir={tmp_path}"]), "tiny") == tmp_path
    cfg = _config(["teacher=hf", f"teacher.name_or_path={tmp_path}"])
    assert ckpt.checkpoint_dir(cfg, str(tmp_path)) == Path("outputs/checkpoints") / ckpt.config_fingerprint(cfg, str(tmp_path))


def test_checkpoint_folders_are_named_by_the_replacement_option_and_old_folders_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``<replacement>-<hash>`` with the option name (``replacement=mlp``: ``mlp-...``); a run
    checkpointed under the class name before (``ResidualMLP-<same hash>``) is found and resumed."""
    monkeypatch.chdir(tmp_path)
    cfg = _config(["replacement=mlp", "teacher=hf", f"teacher.name_or_path={tmp_path}"])
    named = ckpt.checkpoint_dir(cfg, str(tmp_path))
    digest = named.name.split("-", 1)[1]
    assert named == Path("outputs/checkpoints") / f"mlp-{digest}"
    old = Path("outputs/checkpoints") / f"ResidualMLP-{digest}"
    old.mkdir(parents=True)
    assert ckpt.checkpoint_dir(cfg, str(tmp_path)) == old
    named.mkdir()
    assert ckpt.checkpoint_dir(cfg, str(tmp_path)) == named  # once the new name exists, it wins
