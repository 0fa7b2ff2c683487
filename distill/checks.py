"""Start-up checks that a schema cannot express, each naming the key and the fix."""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from distill.pipeline.auth import AuthError
from distill.pipeline.mediums.shm import check_shm_space
from distill.pipeline.slot import slot_stride
from distill.runtime import curve_config
from distill.stages import closed_loop, e2e_top_k, max_positions, plan_stages, sample_batch_config

DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOSSES = ("nmse", "cosine")
SOURCES = ("pydoc", "text", "hf_dataset")
MEDIUMS = ("shm", "tcp")
INPUT_MODES = ("teacher", "student", "mix")
"""Values of student.inputs (see distill.closed_loop)."""
E2E_TRAINABLE = ("replacements", "lora", "all")
"""Values of student.e2e.trainable (see distill.e2e). Both live here, not in their modules:
every mode runs these checks at start-up, and the broker must not pay for importing
torch models to do so."""


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any process starts, on settings that cannot work."""
    _check_choices(cfg)
    num_layers, hidden = _teacher_shape(cfg)
    stages = plan_stages(num_layers, cfg.student.layers, cfg.student.layers_per_stage, closed_loop(cfg.student))
    if cfg.mode in ("student", "local"):
        _check_shm(cfg, max_positions(stages), hidden)
    _check_auth(cfg)


def _check_choices(cfg: DictConfig) -> None:
    if cfg.teacher.dtype not in DTYPE_NAMES:
        raise ValueError(f"teacher.dtype={cfg.teacher.dtype!r}: choose one of {DTYPE_NAMES}")
    if cfg.student.loss not in LOSSES:
        raise ValueError(f"student.loss={cfg.student.loss!r}: choose one of {LOSSES}")
    if cfg.pipeline.medium not in MEDIUMS:
        raise ValueError(f"pipeline.medium={cfg.pipeline.medium!r}: choose one of {MEDIUMS} "
                         "(pipeline=ipc or pipeline=tcp)")
    if cfg.data.source not in SOURCES:
        raise ValueError(f"data.source={cfg.data.source!r}: choose one of {SOURCES}")
    if cfg.pipeline.slot_count < 1:
        raise ValueError(f"pipeline.slot_count={cfg.pipeline.slot_count} must be >= 1 (a batch may be larger: "
                         "its slots are refilled while it is gathered)")
    if cfg.pipeline.slot_count > cfg.pipeline.max_queued_per_student:
        raise ValueError(f"pipeline.slot_count={cfg.pipeline.slot_count} > pipeline.max_queued_per_student="
                         f"{cfg.pipeline.max_queued_per_student}: the broker would refuse the requests; "
                         "raise pipeline.max_queued_per_student (on the broker too) or lower slot_count")
    for key in ("steps_per_stage", "micro_batch_size", "grad_accum_steps"):
        if cfg.student[key] < 1:
            raise ValueError(f"student.{key}={cfg.student[key]} must be >= 1")
    _check_quality_choices(cfg)


def _check_quality_choices(cfg: DictConfig) -> None:
    """Closed-loop inputs, early stopping and the end-to-end stage."""
    student = cfg.student
    if student.inputs not in INPUT_MODES:
        raise ValueError(f"student.inputs={student.inputs!r}: choose one of {INPUT_MODES}")
    if student.patience and not student.val_every_steps:
        raise ValueError(f"student.patience={student.patience} needs periodic validation: "
                         "set student.val_every_steps > 0, or patience=0")
    if student.max_tokens_per_stage is not None and student.max_tokens_per_stage < 1:
        raise ValueError(f"student.max_tokens_per_stage={student.max_tokens_per_stage} must be >= 1, or null")
    e2e = student.e2e
    if e2e.steps <= 0:
        return
    if e2e.trainable not in E2E_TRAINABLE:
        raise ValueError(f"student.e2e.trainable={e2e.trainable!r}: choose one of {E2E_TRAINABLE}")
    if e2e.top_k < 1 or e2e.temperature <= 0:
        raise ValueError(f"student.e2e.top_k={e2e.top_k} must be >= 1 and student.e2e.temperature="
                         f"{e2e.temperature} > 0")
    if not cfg.teacher.name_or_path and cfg.teacher.tiny.family != "llama":
        raise ValueError("student.e2e.steps > 0 needs a teacher with an LM head; the tiny "
                         f"{cfg.teacher.tiny.family} teacher has none: set student.e2e.steps=0")


def _teacher_shape(cfg: DictConfig) -> tuple[int, int]:
    """(num_layers, hidden_size) without loading weights."""
    name = cfg.teacher.name_or_path
    if not name:
        return cfg.teacher.tiny.num_layers, cfg.teacher.tiny.hidden_size
    path = os.path.expanduser(str(name))
    looks_local = path.startswith(("/", ".", "~")) or os.sep in path and path.count("/") != 1
    if looks_local and not os.path.exists(path):
        raise ValueError(f"teacher.name_or_path={name!r} does not exist; give a model directory "
                         "(with config.json) or a hub name such as Qwen/Qwen2-0.5B")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(name)).to_dict()
    else:
        with open(config_file) as f:
            config = json.load(f)
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    hidden = config.get("hidden_size") or config.get("n_embd")
    if not layers or not hidden:
        raise ValueError(f"teacher.name_or_path={name!r}: config.json has no num_hidden_layers/hidden_size")
    return int(layers), int(hidden)


def _check_shm(cfg: DictConfig, positions: int, hidden: int) -> None:
    sample = sample_batch_config(positions, cfg.data.seq_len, hidden, cfg.teacher.dtype,
                                 top_k=e2e_top_k(cfg.student)).nbytes()
    pools_per_rank = max(1, cfg.student.loader_workers)
    ranks = cfg.local.num_students if cfg.mode == "local" else 1
    need = slot_stride(sample) * cfg.pipeline.slot_count * pools_per_rank * ranks
    check_shm_space(need, what=f"{ranks} rank(s) x {pools_per_rank} loader(s) x pipeline.slot_count="
                               f"{cfg.pipeline.slot_count} slots of {sample / 2**20:.1f} MiB")


def _check_auth(cfg: DictConfig) -> None:
    """With ``pipeline.auth_keys_dir`` set, the keys this mode needs are there and private.

    Authentication works over ipc as over tcp, so ipc-only endpoints are no reason to
    refuse it; mode=keys makes the keys and needs none.
    """
    keys_dir = cfg.pipeline.auth_keys_dir
    if not keys_dir or cfg.mode == "keys":
        return
    if not os.path.isdir(os.path.expanduser(str(keys_dir))):
        raise ValueError(f"pipeline.auth_keys_dir={keys_dir!r} does not exist; create it with "
                         f"`python -m distill mode=keys keys_dir={keys_dir}` (or set pipeline.auth_keys_dir=null "
                         "to turn authentication off)")
    curve = curve_config(cfg)
    try:
        if cfg.mode in ("broker", "local"):
            curve.server_keys()
        if cfg.mode != "broker":
            curve.client_keys()
    except AuthError as exc:
        raise ValueError(f"pipeline.auth_keys_dir={keys_dir!r}, pipeline.auth_client="
                         f"{cfg.pipeline.auth_client!r}: {exc}") from exc
