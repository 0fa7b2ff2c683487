"""``python -m distill mode=<mode>``: one entry point, one function per mode.

``MODES`` maps each mode to the module and function that run it. The modules are
imported when their mode is chosen, not here: a broker or ``--help`` must not pay for
importing torch models (the only imports inside a function in distill, besides the lazy
top-level ``load_student`` and a hub config read in ``distill.model.location``). ``--help``
is answered before Hydra runs, by ``distill.help``.

A user's mistake is one line on stderr (``distill.errors``): a bad override is found by composing
the config before Hydra does (with a "did you mean" from the schema), a setting that cannot work
by ``distill.modes.checks`` (exit code 2); Ctrl-C ends in one line too (exit code 130).

Only invocations that do work keep a run directory: the modes that print (``NO_DIR_MODES``) run
with Hydra's directory switched off, and a config error found inside Hydra's job takes back the one
Hydra made (``_discard_run_dir``).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from distill.config import CONF_DIR, register_configs
from distill.errors import INTERRUPTED, INTERRUPTED_EXIT_CODE, ConfigError, UserError

MODES: dict[str, tuple[str, str]] = {
    "broker": ("distill.modes.broker", "run_broker"),
    "worker": ("distill.modes.worker", "run_worker"),
    "student": ("distill.modes.student", "run_student"),
    "local": ("distill.modes.local", "run_local"),
    "stats": ("distill.modes.stats", "run_stats"),
    "keys": ("distill.modes.keys", "run_keys"),
    "eval": ("distill.modes.eval", "run_eval"),
    "plan": ("distill.modes.plan", "run_plan"),
}
"""mode -> (module, entry point); a test keeps it equal to the files of ``conf/mode/``."""

NO_RUN_MODES = frozenset({"stats", "keys"})
"""Modes that run nothing to record: they neither log nor save the composed config."""

CLAIMING_MODES = frozenset({"local"})
"""Modes that record their config themselves, once they hold their checkpoint directory: a second run
of the same settings is refused in one line, not after the whole config is logged."""

NO_DIR_MODES = frozenset({"stats", "keys", "plan"})
"""Modes that print (or write where the user says) and leave no run directory behind."""
NO_DIR_OVERRIDES = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout")
"""What keeps Hydra from making ``outputs/<date>/<time>/`` (its ``.hydra`` and the job's log) for them."""
HYDRA_FILES = (".hydra", "config.yaml")
"""What Hydra and ``record_config`` put in a run directory before the mode runs (besides the job's log)."""

HELP_FLAGS = frozenset({"--help", "-h"})
"""Answered by ``distill.help`` (every group and key explained); ``--hydra-help`` stays Hydra's."""


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except UserError as exc:  # here, inside Hydra's job: outside it Hydra has printed a traceback already
        if _full_traces(cfg):
            raise
        if isinstance(exc, ConfigError):
            _discard_run_dir()
        _fail(str(exc), exc.exit_code)


def run(cfg: DictConfig) -> None:
    """Check the config, record it, run the mode."""
    checks = importlib.import_module("distill.modes.checks")
    checks.check_config(cfg)
    if cfg.mode not in NO_RUN_MODES | CLAIMING_MODES:
        process = importlib.import_module("distill.modes.process")
        process.configure_logging(cfg)  # log_level applies to the config it logs
        process.record_config(cfg)
    module, function = MODES[cfg.mode]
    getattr(importlib.import_module(module), function)(cfg)


def cli() -> None:
    if HELP_FLAGS & set(sys.argv[1:]):  # before Hydra: its stock page lists the *_schema groups, no meanings
        sys.stdout.write(importlib.import_module("distill.help").help_text())
        return
    register_configs()
    if not _full_traces(None):
        _check_overrides(sys.argv[1:])
    if _mode_of(sys.argv[1:]) in NO_DIR_MODES and not _sets_run_dir(sys.argv[1:]):
        sys.argv += NO_DIR_OVERRIDES
    try:
        main()
    except KeyboardInterrupt:  # mode=local has stopped its processes by now (run_local's finally)
        if _full_traces(None):
            raise
        _fail(INTERRUPTED, INTERRUPTED_EXIT_CODE)


def _mode_of(args: list[str]) -> str:
    """The mode the command line picks (Hydra takes the last ``mode=``); the default, ``local``, else."""
    modes = [arg.split("=", 1)[1] for arg in args if arg.startswith("mode=")]
    return modes[-1] if modes else "local"


def _sets_run_dir(args: list[str]) -> bool:
    return any(arg.startswith(("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging=")) for arg in args)


def _discard_run_dir() -> None:
    """A config error found inside Hydra's job ran nothing: take back the run directory Hydra made for
    it, when Hydra named it (``outputs/<date>/<time>``; a directory the user named is left alone) and
    it holds only what Hydra and ``record_config`` wrote, then the folders above it (under the working
    directory) that are now empty."""
    if _sets_run_dir(sys.argv[1:]) or not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    out = Path(hydra_cfg.runtime.output_dir)
    ours = {*HYDRA_FILES, f"{hydra_cfg.job.name}.log"}
    if not out.is_dir() or any(entry.name not in ours for entry in out.iterdir()):
        return
    logging.shutdown()  # Hydra's file handler holds the job's log open
    for entry in out.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    cwd = Path.cwd()
    for directory in (out, *out.parents):
        if directory == cwd or not directory.is_relative_to(cwd):
            break
        with contextlib.suppress(OSError):  # not empty: another run's, or checkpoints
            directory.rmdir()


def _check_overrides(args: list[str]) -> None:
    """Compose the config once before Hydra does, so a mistake in an override is one line.

    Hydra's own report of an unknown key is five lines and suggests ``+key=value``, which makes
    the typo run silently. Sweeps (``-m``) and Hydra's flags are left to Hydra.
    """
    if any(arg.startswith("-") for arg in args):
        return
    overrides = [arg for arg in args if not arg.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        _compose(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        _fail(_override_error(exc, overrides), CONFIG_ERROR_EXIT_CODE)


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _override_error(exc: Exception, overrides: list[str]) -> str:
    """One line for a failed composition: the key, and what to type instead."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    key = getattr(cause, "full_key", None)
    if key and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return f"unknown key {key}: {_suggest(key, overrides)}"
    if isinstance(exc, MissingConfigException) and exc.options:
        group, option = str(exc.missing_cfg_file).rsplit("/", 1)
        options = [o for o in exc.options if not o.endswith("_schema")]  # the schema nodes are not choices
        return f"{group}={option}: no such option; choose one of {', '.join(options)}"
    reasons = [line.strip() for text in (str(exc), str(cause) if cause is not exc else "")
               for line in text.splitlines() if line.strip() and not line.startswith(" ")]
    return "; ".join(dict.fromkeys(reasons)) or type(exc).__name__


def _suggest(key: str, overrides: list[str]) -> str:
    """The closest key of the config the group choices compose (the schema with its options)."""
    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0] and not o.startswith(key + "=")]
    try:
        known = _keys(OmegaConf.to_container(_compose(choices)))
    except (HydraException, OmegaConfBaseException):
        known = []
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {close[0]}?" if close else "python -m distill --help lists every key"


def _keys(node: object, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a composed config."""
    if not isinstance(node, dict):
        return [prefix] if prefix else []
    return [key for name, value in node.items() for key in _keys(value, f"{prefix}.{name}" if prefix else str(name))]


def _full_traces(cfg: DictConfig | None) -> bool:
    """``HYDRA_FULL_ERROR=1`` or ``log_level=DEBUG``: show the traceback behind a one-line error."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return True
    if cfg is not None:
        return str(cfg.get("log_level", "")).upper() == "DEBUG"
    return any(arg.replace(" ", "").upper() == "LOG_LEVEL=DEBUG" for arg in sys.argv[1:])


CONFIG_ERROR_EXIT_CODE = ConfigError.exit_code


def _fail(message: str, exit_code: int) -> None:
    """One line on stderr, then exit; after a run started, on a line of its own (a progress bar may
    have left the cursor mid-line)."""
    fresh_line = "" if exit_code == CONFIG_ERROR_EXIT_CODE else "\n"
    sys.stderr.write(fresh_line + message.replace("\n", " ") + "\n")
    sys.exit(exit_code)


if __name__ == "__main__":
    cli()
