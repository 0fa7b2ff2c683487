"""The order of a run's stages: an automatic hybrid's scoring pass (when configured), every
layer stage not yet finished, then the end-to-end stage.

A finished stage is never retrained (``progress.json``), so rerunning a command resumes
where it stopped: in the stage in progress, at its last checkpoint.
"""

from __future__ import annotations

import logging

from distill.train import checkpoint as ckpt
from distill.train.context import StudentContext
from distill.train.e2e import run_e2e_stage
from distill.train.hybrid import run_hybrid
from distill.train.progress import RunProgress
from distill.train.stages import hybrid_on
from distill.train.trainer import StageTrainer, train_stage

log = logging.getLogger(__name__)


def train_all(ctx: StudentContext) -> None:
    """Train the stages of ``ctx`` that a previous run did not finish. With an automatic
    hybrid, ``ctx.stages`` holds its scoring pass until it has chosen, then the layer stages."""
    finished = set(ckpt.read_progress(ctx.checkpoint_dir)["finished"]) if ctx.cfg.resume else set()
    if hybrid_on(ctx.cfg.student):
        ctx.stages = run_hybrid(ctx, finished)
    todo = [stage for stage in ctx.stages if stage.index not in finished]
    steps = ctx.cfg.student.steps_per_stage
    e2e_steps = ctx.cfg.student.e2e.steps if ctx.cfg.student.e2e.steps > 0 else 0
    progress = RunProgress(layer_steps=steps * len(todo), num_stages=len(todo), e2e_steps=e2e_steps)
    for stage in ctx.stages:
        if stage.index in finished:
            log.info("stage %d (layers %s) already trained: skipping", stage.index, list(stage.layers))
            continue
        train_stage(StageTrainer(ctx, stage))
        line = progress.stage_done(steps)
        if ctx.leader:
            log.info("%s", line)
    if ctx.cfg.student.e2e.steps > 0:
        run_e2e_stage(ctx, finished)
