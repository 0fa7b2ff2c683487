"""Checkpoints: safetensors for tensors, JSON for everything else. No pickle.

The same files whether a stage trained on one rank, with DDP or with FSDP2 (whose state is
gathered to whole tensors for saving and cut back into shards on load, through
``torch.distributed.checkpoint.state_dict``).

Layout of ``<checkpoint_dir>``::

    run.lock                      pid of the mode=local run using it (flock held while it runs)
    progress.json                 finished stages, and the stage in progress
    stage_<s>/replacement.safetensors   final weights of a finished stage
    current/model.safetensors     replacement weights of the stage in progress
    current/optimizer.safetensors optimizer tensors (flattened: state.<param>.<key>, param an
                                  index, or the parameter's name after FSDP2)
    current/best.safetensors      trainable weights at the stage's best validation so far
    current/state.json            stage, step, scheduler, optimizer param groups,
                                  RNG states, resolved config, best validation

Writes go to a temporary directory that is renamed into place, so a kill -9 at
any moment leaves either the previous checkpoint or the new one, never half.

A run's checkpoint directory is named by what shapes its result
(:func:`config_fingerprint`), so rerunning the same command finds and resumes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from distill.config import CONF_DIR, Config, plain
from distill.errors import ConfigError

PROGRESS_FILE = "progress.json"
LOCK_FILE = "run.lock"
"""Holds the pid of the run using the directory, under an flock while it runs (:func:`hold_checkpoint_dir`)."""
BEST_FILE = "best.safetensors"
GATHERED_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""A sharded module's state as one file holds it: whole tensors, on rank 0's CPU."""
FULL_STATE = StateDictOptions(full_state_dict=True)
"""Setting a sharded module's state from whole tensors that every rank has read."""

FINGERPRINT_KEYS = ("teacher", "replacement", "data", "student")
UNFINGERPRINTED_STUDENT_KEYS = ("loader_workers", "prefetch_batches", "log_every_steps", "checkpoint_every_steps")
"""How batches are fetched and how often progress is logged or saved: changing them
must resume a run, not start a new one (they do not decide the trained weights)."""
UNFINGERPRINTED_TEACHER_KEYS = ("sleep_per_batch_s",)
"""The synthetic slow teacher's pace decides how fast samples come, not which: a run
resumes across it, and fingerprints stay those of the runs before the key existed."""


def config_fingerprint(cfg: Config, source: str) -> str:
    """``<replacement option>-<hash>`` of the settings that decide the trained weights (``source``:
    the teacher's directory or hub name), e.g. ``linear_attention-0123456789``."""
    return f"{replacement_option(cfg)}-{_settings_hash(cfg, source)}"


def _settings_hash(cfg: Config, source: str) -> str:
    keep = {key: plain(getattr(cfg, key)) for key in FINGERPRINT_KEYS}
    for key in UNFINGERPRINTED_STUDENT_KEYS:
        keep["student"].pop(key, None)
    for key in UNFINGERPRINTED_TEACHER_KEYS:
        keep["teacher"].pop(key, None)
    keep["teacher_source"] = source
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:10]


def replacement_option(cfg: Config) -> str:
    """The ``replacement=<option>`` that gives this config's replacement class (the option file in
    ``conf/replacement/`` with its ``_target_``), else the class name (a class the user named)."""
    target = str(cfg.replacement.get("_target_", "replacement"))
    for path in sorted((CONF_DIR / "replacement").glob("*.yaml")):
        if (yaml.safe_load(path.read_text()) or {}).get("_target_") == target:
            return path.stem
    return target.rsplit(".", 1)[-1]


def checkpoint_dir(cfg: Config, source: str) -> Path:
    """Where this run's checkpoints live: ``checkpoint_dir``, else the same directory for a
    rerun of the same command (``source``: the teacher as resolved once for the process):
    ``<replacement option>-<hash>``, or the ``<class>-<hash>`` name
    of the runs before the option name, when only that one exists (so they resume)."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    root = Path("outputs") / "checkpoints"
    named = root / config_fingerprint(cfg, source)
    old = root / f"{str(cfg.replacement.get('_target_', 'replacement')).rsplit('.', 1)[-1]}-{_settings_hash(cfg, source)}"
    return old if old.is_dir() and not named.exists() else named


def hold_checkpoint_dir(directory: Path) -> IO[str]:
    """Claim ``directory`` for this process's run: an exclusive ``flock`` on its ``run.lock``, which
    holds our pid. Keep the returned file open for the run; the kernel releases the lock when the
    process ends however it ends, so a crashed run leaves no stale claim.

    Why: two runs with the same settings share one checkpoint directory, and both would resume and
    overwrite the same stage files. The second is refused in one line (ConfigError, exit 2) before
    it starts any process."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "?"
        handle.close()
        raise ConfigError(f"another run (pid {pid}) is using the checkpoint directory {directory}: wait for it, "
                          "stop it, or give this run its own checkpoint_dir=...") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


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


def save_stage_weights(directory: Path, stage: int, module: nn.Module, write: bool = True) -> Path:
    """The final weights of a stage. Collective for a sharded (FSDP2) module: every rank
    calls it, the one with ``write`` writes."""
    path = directory / f"stage_{stage}" / "replacement.safetensors"
    state = model_state(module)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(_contiguous(state), str(tmp))
        os.replace(tmp, path)
    return path


def load_stage_weights(directory: Path, stage: int, module: nn.Module) -> None:
    module.load_state_dict(load_file(str(directory / f"stage_{stage}" / "replacement.safetensors")))


def save_training_state(directory: Path, *, stage: int, step: int, module: nn.Module,
                        optimizer: torch.optim.Optimizer, scheduler: Any,
                        extra: dict[str, Any], write: bool = True,
                        best: dict[str, torch.Tensor] | None = None) -> None:
    """Everything needed to continue a stage at ``step`` exactly (``best``: the trainable
    weights of its best validation so far, see distill.train.validation.BestWeights).
    Collective for a sharded (FSDP2) module: every rank calls it, the one with ``write`` writes."""
    model_sd, optimizer_sd = model_state(module), optimizer_state(module, optimizer)
    if not write:
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".current-", dir=directory))
    save_file(_contiguous(model_sd), str(tmp / "model.safetensors"))
    if best:
        save_file(_contiguous(best), str(tmp / BEST_FILE))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer_sd)
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
    model_sd = load_file(str(current / "model.safetensors"))
    optimizer_sd = _unflatten_optimizer(load_file(str(current / "optimizer.safetensors")), state["optimizer"])
    if isinstance(module, FSDPModule):  # every rank read the full state; each keeps its shard
        set_model_state_dict(module, model_sd, options=FULL_STATE)
        set_optimizer_state_dict(module, optimizer, optimizer_sd, options=FULL_STATE)
    else:
        module.load_state_dict(model_sd)
        optimizer.load_state_dict(optimizer_sd)
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


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s whole state dict; for a sharded (FSDP2) module gathered from every rank
    (collective) onto rank 0's CPU, the others get ``{}``. Its names are the unwrapped
    module's, so the files read the same whichever way the stage was trained."""
    if isinstance(module, FSDPModule):
        return get_model_state_dict(module, options=GATHERED_STATE)
    return module.state_dict()


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict; for a sharded module gathered like :func:`model_state`
    (then keyed by parameter name instead of index)."""
    if isinstance(module, FSDPModule):
        return get_optimizer_state_dict(module, optimizer, options=GATHERED_STATE)
    return optimizer.state_dict()


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors wants contiguous, unshared storage: a tensor whose memory another entry
    shares (tied embeddings) is cloned; the others are written as they are, so saving the
    end-to-end stage does not make a second copy of the teacher it shares."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()  # views of one storage count as shared too
        shared = tensor.numel() > 0 and storage in seen
        seen.add(storage)
        out[name] = tensor.clone() if shared or not tensor.is_contiguous() else tensor
    return out


def _flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """``state.<param>.<key>`` tensors (param: an index, or a name for a sharded module) and
    the rest as JSON."""
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


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, Any]:
    """The optimizer state dict :func:`_flatten_optimizer` wrote (the key is the last dotted
    part: parameter names have dots, keys such as ``exp_avg`` have none)."""
    state: dict[int | str, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name == "_empty":
            continue
        param_id, key = name.removeprefix("state.").rsplit(".", 1)
        state.setdefault(_param_key(param_id), {})[key] = value
    for name, value in meta["scalars"].items():
        param_id, key = name.rsplit(".", 1)
        state.setdefault(_param_key(param_id), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _param_key(text: str) -> int | str:
    """An optimizer's parameter key: an index (plain state dicts) or a parameter name (FSDP2)."""
    return int(text) if text.isdigit() else text


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _python_rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
