"""Checkpoints: safetensors for tensors, JSON for everything else. No pickle.

Layout of ``<checkpoint_dir>``::

    progress.json                 finished stages, and the stage in progress
    stage_<s>/replacement.safetensors   final weights of a finished stage
    current/model.safetensors     replacement weights of the stage in progress
    current/optimizer.safetensors optimizer tensors (flattened: state.<param>.<key>)
    current/best.safetensors      trainable weights at the stage's best validation so far
    current/state.json            stage, step, scheduler, optimizer param groups,
                                  RNG states, resolved config, best validation

Writes go to a temporary directory that is renamed into place, so a kill -9 at
any moment leaves either the previous checkpoint or the new one, never half.

A run's checkpoint directory is named by what shapes its result
(:func:`config_fingerprint`), so rerunning the same command finds and resumes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file
from torch import nn

from distill.model.sources import teacher_source

PROGRESS_FILE = "progress.json"
BEST_FILE = "best.safetensors"

FINGERPRINT_KEYS = ("teacher", "replacement", "data", "student")
UNFINGERPRINTED_STUDENT_KEYS = ("loader_workers", "prefetch_batches", "log_every_steps", "checkpoint_every_steps")
"""How batches are fetched and how often progress is logged or saved: changing them
must resume a run, not start a new one (they do not decide the trained weights)."""


def config_fingerprint(cfg: DictConfig, source: str) -> str:
    """``<replacement>-<hash>`` of the settings that decide the trained weights (``source``:
    the teacher's directory or hub name)."""
    keep = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in FINGERPRINT_KEYS}
    for key in UNFINGERPRINTED_STUDENT_KEYS:
        keep["student"].pop(key, None)
    keep["teacher_source"] = source
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:10]
    target = str(cfg.replacement.get("_target_", "replacement")).rsplit(".", 1)[-1]
    return f"{target}-{digest}"


def checkpoint_dir(cfg: DictConfig) -> Path:
    """Where this run's checkpoints live: ``checkpoint_dir``, else the same directory for a
    rerun of the same command."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    return Path("outputs") / "checkpoints" / config_fingerprint(cfg, teacher_source(cfg))


def read_progress(directory: Path) -> dict[str, Any]:
    path = directory / PROGRESS_FILE
    if not path.exists():
        return {"finished": [], "current": None}
    return json.loads(path.read_text())


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def save_stage_weights(directory: Path, stage: int, module: nn.Module) -> Path:
    path = directory / f"stage_{stage}" / "replacement.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(_contiguous(module.state_dict()), str(tmp))
    os.replace(tmp, path)
    return path


def load_stage_weights(directory: Path, stage: int, module: nn.Module) -> None:
    module.load_state_dict(load_file(str(directory / f"stage_{stage}" / "replacement.safetensors")))


def save_training_state(directory: Path, *, stage: int, step: int, module: nn.Module,
                        optimizer: torch.optim.Optimizer, scheduler: Any,
                        extra: dict[str, Any], best: dict[str, torch.Tensor] | None = None) -> None:
    """Everything needed to continue a stage at ``step`` exactly (``best``: the trainable
    weights of its best validation so far, see distill.train.validation.BestWeights)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".current-", dir=directory))
    save_file(_contiguous(module.state_dict()), str(tmp / "model.safetensors"))
    if best:
        save_file(_contiguous(best), str(tmp / BEST_FILE))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / "rng.safetensors"))
    state = {"stage": stage, "step": step, "scheduler": scheduler.state_dict(), "optimizer": opt_meta,
             "python_rng": _python_rng_state(), **extra}
    (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str))
    final = directory / "current"
    old = directory / ".current-old"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_training_state(directory: Path, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: Any) -> dict[str, Any]:
    """Restore what :func:`save_training_state` wrote; returns the state dict (stage, step, ...)."""
    current = directory / "current"
    state = json.loads((current / "state.json").read_text())
    module.load_state_dict(load_file(str(current / "model.safetensors")))
    _restore_optimizer(optimizer, load_file(str(current / "optimizer.safetensors")), state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = load_file(str(current / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    random.setstate(_python_rng_from_json(state["python_rng"]))
    return state


def load_best_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The best-validation weights saved with the training state; empty if none were."""
    path = directory / "current" / BEST_FILE
    return load_file(str(path)) if path.exists() else {}


def has_training_state(directory: Path, stage: int) -> bool:
    path = directory / "current" / "state.json"
    return path.exists() and json.loads(path.read_text()).get("stage") == stage


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors wants contiguous, unshared storage."""
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for param_id, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{param_id}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars[f"{param_id}.{key}"] = value
    if not tensors:
        tensors["_empty"] = torch.zeros(0)
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                       meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name == "_empty":
            continue
        _, param_id, key = name.split(".", 2)
        state.setdefault(int(param_id), {})[key] = value
    for name, value in meta["scalars"].items():
        param_id, key = name.split(".", 1)
        state.setdefault(int(param_id), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _python_rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
