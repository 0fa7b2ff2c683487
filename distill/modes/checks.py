"""Start-up checks that a schema cannot express, each naming the key and the fix.

The allowed values of every choice are enums in ``distill.config`` (OmegaConf refuses
anything else when the config is composed); what is left here needs more than one key
or the world outside the config: the teacher's shape, the stage layout, /dev/shm, GPU placement, memory, keys.
Every mode runs them before it starts, so this module stays light (no transformers):
the broker's start must not pay for importing models.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from distill.config import Config, Mode, Parallel, Source, typed_config
from distill.errors import ConfigError
from distill.model import family as families
from distill.model.data import text_files
from distill.model.location import model_shape, read_config, teacher_model
from distill.modes.placement import plan_local, worker_gpus
from distill.pipeline.auth import AuthError
from distill.pipeline.mediums.shm import check_shm_space
from distill.stages import max_positions, stage_layout
from distill.train.sizing import DTYPE_BYTES, ModelShape, e2e_rank_floor, shm_bytes
from distill.train.tracking import check_tracking
from distill.transport import curve_config


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any process starts, on settings that cannot work.

    Raises ``ConfigError`` (a ``ValueError``) naming the key and the fix; the ``ValueError`` of a
    check owned elsewhere (the family's rules, the stage layout, /dev/shm, placement) becomes one.
    """
    try:
        _check_all(cfg)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _check_all(cfg: DictConfig) -> None:
    _check_missing(cfg)
    # What every mode passes on; each schema dataclass checks its own keys as it is made
    # (``distill.config``), the checks below those that need more than one group or the machine.
    config = typed_config(cfg)
    _check_data(config)
    _check_hybrid(config)
    _check_family(config)
    num_layers, hidden = _teacher_shape(config)
    stages, batch_config = stage_layout(config, num_layers, hidden)
    if config.mode in (Mode.student, Mode.local):
        _check_shm(config, batch_config.nbytes(), max_positions(stages))
    _check_devices(config)
    _check_memory(config)
    if config.mode == Mode.eval:
        _check_eval(config)
    if config.mode in (Mode.student, Mode.local):
        check_tracking(config)  # the library of tracking=X is installed (its rank 0 student logs)
    _check_auth(config)


def _check_missing(cfg: DictConfig) -> None:
    """A key its option leaves to the user (``???`` in conf/, e.g. data=text's ``data.path``)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if _chosen("teacher") == "hf" and not cfg.teacher.name_or_path:  # its ``???`` merges onto the schema's null
        missing.insert(0, "teacher.name_or_path")
    if missing:
        raise ConfigError(f"{missing[0]} has no value and the chosen options need one: "
                          f"add {missing[0]}=<value> to the command")


def _chosen(group: str) -> str | None:
    """The option of ``group`` the command chose, where Hydra composed it (not in a bare ``compose()``)."""
    return HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None


def _check_data(cfg: Config) -> None:
    """data=text: the glob matches files now, not minutes later in a worker."""
    if cfg.mode in (Mode.local, Mode.student, Mode.worker) and cfg.data.source == Source.text:
        text_files(cfg.data.path)


def _check_eval(cfg: Config) -> None:
    """mode=eval needs an exported student and lm-evaluation-harness (an optional extra)."""
    student = cfg.lm_eval.student
    if not student or not os.path.isfile(os.path.join(str(student), "distill_student.json")):
        raise ConfigError(f"mode=eval needs lm_eval.student=<an exported student directory> (a run's student/); "
                         f"got {student!r}")
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("mode=eval needs lm-evaluation-harness: pip install -e '.[eval]' (or pip install lm-eval)")


def _check_hybrid(config: Config) -> None:
    """An automatic hybrid leaves a layer to convert (its other settings are checked by
    ``HybridConfig`` itself: this one needs the teacher's depth)."""
    hybrid, student = config.student.hybrid, config.student
    if hybrid.keep_softmax is None:
        return
    candidates = len(set(student.layers)) if student.layers is not None else _teacher_shape(config)[0]
    if not 0 <= hybrid.keep_softmax < candidates:
        raise ConfigError(f"student.hybrid.keep_softmax={hybrid.keep_softmax} must be in 0..{candidates - 1}: "
                          f"there are {candidates} candidate layers (student.layers) and at least one "
                          "must be converted")


def _check_family(cfg: Config) -> None:
    """An HF teacher's family is one distill reproduces, and the replacement kind fits its layers.

    Checked on the teacher's config.json alone (no weights, no transformers), so an unsupported
    family or kind fails here, naming the feature, instead of after minutes of loading or,
    worse, in an export that differs from the teacher.
    """
    model = teacher_model(cfg)
    if model is None:
        return
    options = dict(cfg.replacement or {})
    target = options.get("_target_")
    kind = families.KIND_OF_TARGET.get(str(target)) if target is not None else None
    families.check_teacher(read_config(model), kind, options)


def _teacher_shape(cfg: Config) -> tuple[int, int]:
    """(num_layers, hidden_size) without loading weights."""
    model = teacher_model(cfg)
    if model is None:
        return cfg.teacher.tiny.num_layers, cfg.teacher.tiny.hidden_size
    return model_shape(model)


def _check_shm(cfg: Config, sample_bytes: int, positions: int) -> None:
    pools_per_rank = max(1, cfg.student.loader_workers)
    ranks = cfg.local.num_students if cfg.mode == Mode.local else 1
    need = shm_bytes(sample_bytes, cfg.pipeline.slot_count, cfg.student.loader_workers, ranks)
    check_shm_space(need, what=f"{ranks} rank(s) x {pools_per_rank} loader(s) x pipeline.slot_count="
                               f"{cfg.pipeline.slot_count} slots of {sample_bytes / 2**20:.1f} MiB "
                               f"({positions} hidden states per sample)")


def _check_memory(cfg: Config) -> None:
    """Refuse a teacher that cannot fit the GPUs it is given, and a student rank whose memory
    floor (``distill.train.sizing.e2e_rank_floor``) exceeds its device, naming the numbers.
    Only for teachers with a config to read (the tiny demo teachers always fit)."""
    model = teacher_model(cfg)
    if model is None:
        return
    try:
        shape = ModelShape.from_config(read_config(model))
    except (KeyError, TypeError, ValueError):
        return  # a config we cannot size: nothing to estimate
    teacher = shape.params * DTYPE_BYTES[cfg.teacher.dtype]
    gpus = torch.cuda.device_count()
    if cfg.mode in (Mode.worker, Mode.local) and worker_gpus(cfg) and gpus:
        spread = worker_gpus(cfg)
        room = min(torch.cuda.get_device_properties(g).total_memory for g in spread if g < gpus)
        if teacher / len(spread) > room:
            raise ConfigError(
                f"the teacher {model} has {shape.params / 1e9:.1f}B parameters: "
                f"{_gib(teacher)} in {cfg.teacher.dtype}, {_gib(teacher / len(spread))} per GPU over {list(spread)}, "
                f"and a GPU there has {_gib(room)}: spread it over more GPUs (device.worker_gpus=[...], "
                f"at least {-(-teacher // room)}) or lower teacher.dtype")
    if cfg.mode in (Mode.student, Mode.local):
        _check_student_floor(cfg, shape, gpus)


def _check_student_floor(cfg: Config, shape: ModelShape, gpus: int) -> None:
    e2e = cfg.student.e2e
    ranks = cfg.local.num_students if cfg.mode == Mode.local else 1
    parts = e2e_rank_floor(shape, cfg.teacher.dtype, e2e.trainable, ranks, e2e.parallel == Parallel.fsdp,
                           e2e.loss_chunk_tokens)
    if e2e.steps <= 0:
        parts = {"teacher": parts["teacher"]}
    need = sum(parts.values())
    if cfg.device.student_gpu and gpus:
        gpu = int((cfg.device.student_gpus or [0])[0])
        room, where = torch.cuda.get_device_properties(min(gpu, gpus - 1)).total_memory, f"cuda:{gpu}"
    else:
        room, where = _available_ram() // ranks, f"this machine's free RAM / {ranks} rank(s)"
    if need > room:
        detail = " + ".join(f"{name} {_gib(value)}" for name, value in parts.items())
        raise ConfigError(f"each student rank needs at least {_gib(need)} ({detail}); {where} has {_gib(room)}: "
                         "use more ranks with student.e2e.parallel=fsdp, student.e2e.trainable=replacements, "
                         "a smaller student.e2e.loss_chunk_tokens, or bigger devices")


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _check_devices(cfg: Config) -> None:
    """GPUs that exist, a teacher spread over GPUs with accelerate installed, and (mode=local)
    no GPU shared by a teacher worker and a student rank unless asked (``modes/placement.py``)."""
    if cfg.device.worker_gpus and importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"device.worker_gpus={list(cfg.device.worker_gpus)} spreads the teacher with "
                         "transformers' device_map, which needs accelerate: pip install 'distill[sharded]'")
    if cfg.mode == Mode.local:
        plan_local(cfg, torch.cuda.device_count())
    elif cfg.mode == Mode.worker and worker_gpus(cfg):
        teacher_only = dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, student_gpu=False))
        plan_local(teacher_only, torch.cuda.device_count())


def _check_auth(cfg: Config) -> None:
    """With ``pipeline.auth_keys_dir`` set, the keys this mode needs are there and private.

    Authentication works over ipc as over tcp, so ipc-only endpoints are no reason to
    refuse it; mode=keys makes the keys and needs none.
    """
    keys_dir = cfg.pipeline.auth_keys_dir
    if not keys_dir or cfg.mode == Mode.keys:
        return
    if not os.path.isdir(os.path.expanduser(str(keys_dir))):
        raise ConfigError(f"pipeline.auth_keys_dir={keys_dir!r} does not exist; create it with "
                         f"`python -m distill mode=keys keys_dir={keys_dir}` (or set pipeline.auth_keys_dir=null "
                         "to turn authentication off)")
    curve = curve_config(cfg)
    try:
        if cfg.mode in (Mode.broker, Mode.local):
            curve.server_keys()
        if cfg.mode != Mode.broker:
            curve.client_keys()
    except AuthError as exc:
        raise ConfigError(f"pipeline.auth_keys_dir={keys_dir!r}, pipeline.auth_client="
                         f"{cfg.pipeline.auth_client!r}: {exc}") from exc
