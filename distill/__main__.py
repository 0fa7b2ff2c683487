"""``python -m distill mode=<mode>``: one entry point, one function per mode.

``MODES`` maps each mode to the module and function that run it. The modules are
imported when their mode is chosen, not here: a broker or ``--help`` must not pay for
importing torch models (the only imports inside a function in distill, besides the lazy
top-level ``load_student`` and a hub config read in ``distill.model.location``).
"""

from __future__ import annotations

import importlib

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


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    checks = importlib.import_module("distill.modes.checks")
    checks.check_config(cfg)
    module, function = MODES[cfg.mode]
    getattr(importlib.import_module(module), function)(cfg)


def cli() -> None:
    register_configs()
    main()


if __name__ == "__main__":
    cli()
