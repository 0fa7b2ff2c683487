"""``python -m distill mode=<mode>``: one entry point, one function per mode.

``MODES`` maps each mode to the module and function that run it. The modules are
imported when their mode is chosen, not here: a broker or ``--help`` must not pay for
importing torch models (the only imports inside a function in distill, besides the lazy
top-level ``load_student`` and a hub config read in ``distill.model.location``). ``--help``
is answered before Hydra runs, by ``distill.help``.
"""

from __future__ import annotations

import importlib
import sys

import hydra
from omegaconf import DictConfig

from distill.config import register_configs

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

HELP_FLAGS = frozenset({"--help", "-h"})
"""Answered by ``distill.help`` (every group and key explained); ``--hydra-help`` stays Hydra's."""


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    checks = importlib.import_module("distill.modes.checks")
    checks.check_config(cfg)
    if cfg.mode not in NO_RUN_MODES:
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
    main()


if __name__ == "__main__":
    cli()
