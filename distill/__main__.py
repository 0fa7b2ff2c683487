"""``python -m distill mode=<mode>``: one entry point, one function per mode."""

from __future__ import annotations

from collections.abc import Callable

import hydra
from omegaconf import DictConfig

from distill.config import register_configs


def _broker(cfg: DictConfig) -> None:
    from distill.service import run_broker

    run_broker(cfg)


def _worker(cfg: DictConfig) -> None:
    from distill.teacher_worker import run_worker

    run_worker(cfg)


def _student(cfg: DictConfig) -> None:
    from distill.student import run_student

    run_student(cfg)


def _local(cfg: DictConfig) -> None:
    from distill.local import run_local

    run_local(cfg)


def _stats(cfg: DictConfig) -> None:
    from distill.service import run_stats

    run_stats(cfg)


def _keys(cfg: DictConfig) -> None:
    from distill.keys import run_keys

    run_keys(cfg)


MODES: dict[str, Callable[[DictConfig], None]] = {
    "broker": _broker,
    "worker": _worker,
    "student": _student,
    "local": _local,
    "stats": _stats,
    "keys": _keys,
}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from distill.checks import check_config

    check_config(cfg)
    MODES[cfg.mode](cfg)


def cli() -> None:
    register_configs()
    main()


if __name__ == "__main__":
    cli()
