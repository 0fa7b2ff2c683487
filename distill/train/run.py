"""The order of a run's stages: an automatic hybrid's scoring pass (when configured), every
layer stage not yet finished, then the end-to-end stage.

A finished stage is never retrained (``progress.json``), so rerunning a command resumes
where it stopped: in the stage in progress, at its last checkpoint.
"""

from __future__ import annotations

import logging
import time

from distill.stages import e2e_stage, hybrid_on
from distill.train import checkpoint as ckpt
from distill.train.context import StudentContext
from distill.train.e2e import e2e_student_config, run_e2e_stage
from distill.train.hybrid import run_hybrid
from distill.train.layer_stage import LayerTask
from distill.train.progress import RunProgress, e2e_step_estimate_s
from distill.train.trainer import StageTrainer, train_stage

log = logging.getLogger(__name__)


def train_all(ctx: StudentContext) -> None:
    """Train the stages of ``ctx`` that a previous run did not finish. With an automatic
    hybrid, ``ctx.stages`` holds its scoring pass until it has chosen, then the layer stages."""
    finished = set(ckpt.read_progress(ctx.checkpoint_dir)["finished"]) if ctx.cfg.resume else set()
    if hybrid_on(ctx.cfg.student):
        ctx.stages = run_hybrid(ctx, finished)
    progress = _run_progress(ctx, finished)
    for stage in ctx.stages:
        if stage.index in finished:
            log.info("stage %d (layers %s) already trained: skipping", stage.index, list(stage.layers))
            continue
        train_stage(StageTrainer(ctx, LayerTask(ctx, stage)))
        if ctx.leader and progress.e2e_steps and progress.e2e_step_s is None:
            progress.e2e_step_s = planned_e2e_step_s(ctx)  # after a stage: the first bar starts at once
        line = progress.stage_done(ctx.cfg.student.steps_per_stage)
        if ctx.leader:
            log.info("%s", line)
    if ctx.cfg.student.e2e.steps > 0:
        run_e2e_stage(ctx, finished)
        if ctx.leader and progress.e2e_steps:
            log.info("%s", progress.e2e_stage_done())


def _run_progress(ctx: StudentContext, finished: set[int]) -> RunProgress:
    """The run's stages and steps, those an earlier run of this command finished counted as done."""
    steps = ctx.cfg.student.steps_per_stage
    todo = [stage for stage in ctx.stages if stage.index not in finished]
    e2e_steps = ctx.cfg.student.e2e.steps
    if e2e_steps > 0 and e2e_stage(ctx.stages).index in finished:
        e2e_steps = 0
    before = len(ctx.stages) - len(todo)
    return RunProgress(layer_steps=steps * len(todo), num_stages=len(todo), e2e_steps=max(0, e2e_steps),
                       stages_before=before, steps_before=steps * before)


def planned_e2e_step_s(ctx: StudentContext) -> float | None:
    """``mode=plan``'s model of an end-to-end step (``progress.e2e_step_estimate_s``), from one
    timed forward of the whole teacher over held-out chunks scaled to the stage's samples per
    step; None without held-out chunks."""
    e2e = e2e_student_config(ctx.cfg.student)
    chunks_NT = ctx.heldout_NT[: e2e.micro_batch_size]
    if len(chunks_NT) == 0:
        return None
    inputs_NT = chunks_NT.to(ctx.teacher.device)
    last = [ctx.teacher.num_layers - 1]
    ctx.teacher.capture(inputs_NT, last)  # warm-up: allocations, lazy initialisation
    started = time.perf_counter()
    ctx.teacher.capture(inputs_NT, last)
    forward_s = (time.perf_counter() - started) * e2e.micro_batch_size * e2e.grad_accum_steps / len(chunks_NT)
    workers = ctx.client.live_workers or int(ctx.cfg.local.num_workers)  # the broker's count, else the plan's
    return e2e_step_estimate_s(forward_s, workers)
