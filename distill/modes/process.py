"""What every mode's process sets up for itself: log levels, SIGTERM, its parent, its run dir.

These are process-level concerns of an entry point, not of the libraries under it
(``distill.train`` and ``distill.pipeline`` never install handlers or signals).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from distill.pipeline import setup_logging

log = logging.getLogger(__name__)

QUIET_LIBRARIES = ("transformers", "datasets", "urllib3", "filelock", "matplotlib")
CONFIG_FILE = "config.yaml"


def configure_logging(cfg: DictConfig) -> None:
    """Hydra already installed handlers; set our level and quiet chatty libraries."""
    setup_logging(cfg.log_level)
    for name in QUIET_LIBRARIES:
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
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def run_dir() -> Path:
    """The Hydra run directory of this job (cwd is not changed: hydra.job.chdir=False)."""
    return Path(HydraConfig.get().runtime.output_dir)


def record_config(cfg: DictConfig) -> Path | None:
    """Log the composed config (resolved YAML) and save it as ``config.yaml`` in the run dir.

    Only the process that owns its run directory does, once per directory: mode=local's
    children share the supervisor's and are started with ``hydra.output_subdir=null``, and of
    torchrun ranks sharing one directory rank 0 writes. Returns the file written, if any.
    """
    if HydraConfig.get().output_subdir is None or os.environ.get("RANK", "0") != "0":
        return None
    text = OmegaConf.to_yaml(cfg, resolve=True)
    log.info("config:\n%s", text.rstrip())
    path = run_dir() / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
