"""Start-up checks that a schema cannot express, each naming the key and the fix.

The allowed values of every choice are enums in ``distill.config`` (OmegaConf refuses
anything else when the config is composed); what is left here needs more than one key
or the world outside the config: the teacher's shape, the stage layout, /dev/shm, keys.
Every mode runs them before it starts, so this module stays light (no transformers):
the broker's start must not pay for importing models.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from distill.config import Mode
from distill.model.location import model_shape
from distill.pipeline.auth import AuthError
from distill.pipeline.mediums.shm import check_shm_space
from distill.pipeline.slot import slot_stride
from distill.train.stages import max_positions, stage_layout
from distill.train.transport import curve_config


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any process starts, on settings that cannot work."""
    _check_numbers(cfg)
    _check_quality_settings(cfg)
    num_layers, hidden = _teacher_shape(cfg)
    stages, batch_config = stage_layout(cfg, num_layers, hidden)
    if cfg.mode in (Mode.student, Mode.local):
        _check_shm(cfg, batch_config.nbytes(), max_positions(stages))
    _check_auth(cfg)


def _check_numbers(cfg: DictConfig) -> None:
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


def _check_quality_settings(cfg: DictConfig) -> None:
    """Closed-loop inputs, early stopping and the end-to-end stage."""
    student = cfg.student
    if student.patience and not student.val_every_steps:
        raise ValueError(f"student.patience={student.patience} needs periodic validation: "
                         "set student.val_every_steps > 0, or patience=0")
    if student.max_tokens_per_stage is not None and student.max_tokens_per_stage < 1:
        raise ValueError(f"student.max_tokens_per_stage={student.max_tokens_per_stage} must be >= 1, or null")
    _check_hybrid(cfg)
    e2e = student.e2e
    if e2e.steps <= 0:
        return
    if e2e.top_k < 1 or e2e.temperature <= 0:
        raise ValueError(f"student.e2e.top_k={e2e.top_k} must be >= 1 and student.e2e.temperature="
                         f"{e2e.temperature} > 0")


def _check_hybrid(cfg: DictConfig) -> None:
    """An automatic hybrid needs one budget, a scoring pass, and a layer left to convert."""
    hybrid = cfg.student.hybrid
    if hybrid.keep_softmax is not None and hybrid.max_gap is not None:
        raise ValueError(f"student.hybrid.keep_softmax={hybrid.keep_softmax} and student.hybrid.max_gap="
                         f"{hybrid.max_gap} are both set: choose one (the other null)")
    if hybrid.keep_softmax is None and hybrid.max_gap is None:
        return
    if hybrid.steps < 1:
        raise ValueError(f"student.hybrid.steps={hybrid.steps} must be >= 1 (the scoring pass trains each layer)")
    if hybrid.max_gap is not None and hybrid.max_gap <= 0:
        raise ValueError(f"student.hybrid.max_gap={hybrid.max_gap} must be > 0 (0.02 = within 2%)")
    if hybrid.keep_softmax is not None:
        candidates = len(set(cfg.student.layers)) if cfg.student.layers is not None else _teacher_shape(cfg)[0]
        if not 0 <= hybrid.keep_softmax < candidates:
            raise ValueError(f"student.hybrid.keep_softmax={hybrid.keep_softmax} must be in 0..{candidates - 1}: "
                             f"there are {candidates} candidate layers (student.layers) and at least one "
                             "must be converted")


def _teacher_shape(cfg: DictConfig) -> tuple[int, int]:
    """(num_layers, hidden_size) without loading weights."""
    if not cfg.teacher.name_or_path:
        return cfg.teacher.tiny.num_layers, cfg.teacher.tiny.hidden_size
    return model_shape(str(cfg.teacher.name_or_path))


def _check_shm(cfg: DictConfig, sample_bytes: int, positions: int) -> None:
    pools_per_rank = max(1, cfg.student.loader_workers)
    ranks = cfg.local.num_students if cfg.mode == Mode.local else 1
    need = slot_stride(sample_bytes) * cfg.pipeline.slot_count * pools_per_rank * ranks
    check_shm_space(need, what=f"{ranks} rank(s) x {pools_per_rank} loader(s) x pipeline.slot_count="
                               f"{cfg.pipeline.slot_count} slots of {sample_bytes / 2**20:.1f} MiB "
                               f"({positions} hidden states per sample)")


def _check_auth(cfg: DictConfig) -> None:
    """With ``pipeline.auth_keys_dir`` set, the keys this mode needs are there and private.

    Authentication works over ipc as over tcp, so ipc-only endpoints are no reason to
    refuse it; mode=keys makes the keys and needs none.
    """
    keys_dir = cfg.pipeline.auth_keys_dir
    if not keys_dir or cfg.mode == Mode.keys:
        return
    if not os.path.isdir(os.path.expanduser(str(keys_dir))):
        raise ValueError(f"pipeline.auth_keys_dir={keys_dir!r} does not exist; create it with "
                         f"`python -m distill mode=keys keys_dir={keys_dir}` (or set pipeline.auth_keys_dir=null "
                         "to turn authentication off)")
    curve = curve_config(cfg)
    try:
        if cfg.mode in (Mode.broker, Mode.local):
            curve.server_keys()
        if cfg.mode != Mode.broker:
            curve.client_keys()
    except AuthError as exc:
        raise ValueError(f"pipeline.auth_keys_dir={keys_dir!r}, pipeline.auth_client="
                         f"{cfg.pipeline.auth_client!r}: {exc}") from exc
