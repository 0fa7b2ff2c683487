"""mode=student: one DDP rank (under torchrun) that trains every stage, then (rank 0)
exports, evaluates and reports. Rank 0 leads the stage switches (see distill.train.trainer)."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from distill.config import typed_config
from distill.modes.process import configure_logging, exit_on_sigterm, run_dir
from distill.results.finish import finish_run
from distill.train.context import barrier, close_context, setup_context
from distill.train.run import train_all
from distill.train.timing import process_age_s

log = logging.getLogger(__name__)


def run_student(cfg: DictConfig) -> None:
    """Train every stage not yet finished, then (rank 0) assemble, export, evaluate, report."""
    configure_logging(cfg)
    exit_on_sigterm()
    ctx = setup_context(typed_config(cfg), run_dir())
    ctx.timings["student_start_s"] = process_age_s()
    failed = True
    try:
        train_all(ctx)
        if ctx.leader:
            finish_run(ctx)
        barrier(ctx)
        failed = False
    finally:
        close_context(ctx, failed)
