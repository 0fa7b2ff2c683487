"""What every mode needs from the config: endpoints, run id, logging, signals."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig

from distill.pipeline import setup_logging
from distill.pipeline.auth import CurveConfig
from distill.pipeline.endpoints import SOCKET_NAMES, default_endpoint, runtime_dir

log = logging.getLogger(__name__)

DEFAULT_RUN_ID = "default"


def endpoints(cfg: DictConfig) -> dict[str, str]:
    """The four broker endpoints: TCP at ``pipeline.broker_host`` (several machines), or
    ipc in ``pipeline.socket_dir`` (one machine)."""
    host = cfg.pipeline.get("broker_host")
    if host:
        port = cfg.pipeline.broker_port
        return {name: f"tcp://{host}:{port + i}" for i, name in enumerate(SOCKET_NAMES)}
    directory = cfg.pipeline.socket_dir or runtime_dir()
    return {name: default_endpoint(name, directory) for name in SOCKET_NAMES}


def endpoint_kwargs(cfg: DictConfig) -> dict[str, str]:
    return {f"{name}_endpoint": ep for name, ep in endpoints(cfg).items()}


def curve_config(cfg: DictConfig) -> CurveConfig | None:
    """The CurveZMQ keys of ``pipeline.auth_keys_dir`` (None: authentication off)."""
    if not cfg.pipeline.auth_keys_dir:
        return None
    return CurveConfig.from_keys_dir(cfg.pipeline.auth_keys_dir, cfg.pipeline.auth_client)


def run_id(cfg: DictConfig) -> str:
    """``run_id``, or else one per sweep job (so the jobs of a multirun sharing a broker
    never share a run), or else ``default``."""
    return cfg.run_id or sweep_job_run_id() or DEFAULT_RUN_ID


def sweep_job_run_id() -> str | None:
    """``<sweep dir name>-<job number>`` in a Hydra multirun job, None elsewhere."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep = "".join(c for c in Path(hydra_cfg.sweep.dir).name if c.isalnum())[-8:]
    return f"{sweep}j{hydra_cfg.job.num}"


def configure_logging(cfg: DictConfig) -> None:
    """Hydra already installed handlers; set our level and quiet chatty libraries."""
    setup_logging(cfg.log_level)
    for name in ("transformers", "datasets", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so context managers and finalizers clean up (shm, sockets)."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGTERM us when our parent dies (no orphans after kill -9)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def is_leader() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_dir() -> Path:
    """The Hydra run directory of this job (cwd is not changed: hydra.job.chdir=False)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
