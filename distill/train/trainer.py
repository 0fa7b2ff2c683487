"""The stage trainer: one stage's task trained across the DDP ranks.

What a stage trains is a *task* (:class:`StageTask`): the layer stage and an automatic
hybrid's scoring pass (:class:`~distill.train.layer_stage.LayerTask`), the end-to-end stage
(:class:`~distill.train.e2e.E2ETask`). A task builds its module, runs a micro-batch's forward
and backward, clips, validates and finishes; :class:`StageTrainer` owns everything they share:
the optimizer and schedule, resume, the data, the steps and their counters
(:class:`~distill.train.counters.StageCounters`), patience, the best weights, checkpoints and
the stage's record (torchtune's recipe verbs: ``setup``, ``train``, ``save_checkpoint``,
``finish``, ``cleanup``).

Rank 0 leads: it switches the stage on the broker (``set_model``) and broadcasts the
new generation; the other ranks wait until their PUB/SUB listener has seen it, so
all ranks start each stage at the same step on samples of that stage only.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from distill.config import StudentConfig, plain
from distill.profiling import PROFILE_DIR, StepProfiler, step_profiler
from distill.stages import Stage
from distill.train import checkpoint as ckpt
from distill.train.context import StudentContext, barrier, broadcast_int, gradient_sync, is_sharded
from distill.train.counters import StageCounters
from distill.train.stopping import STOP_PATIENCE, Patience, stop_reason
from distill.train.supply import STARVED_FRACTION, Slots, WorkersSeen, teacher_bound_advice
from distill.train.timing import timed
from distill.train.transfer import BackgroundBatches, DevicePrefetcher, loader_batches
from distill.train.validation import BestWeights, Validation, json_record
from distill.transport import ADD_WORKER_SCRIPT, stage_dataset

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0
"""How long closing a stage's loader waits for its batch thread after the stage ended or failed."""

INTERRUPTED_CLOSE_WAIT_S = 2.0
"""The same after an interrupt or SIGTERM: the batch thread may be waiting on a broker that is
stopping too, and the supervisor kills what outlives its grace period; exit unlinks the pools."""


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class StageTask(Protocol):
    """What one kind of stage brings to :class:`StageTrainer`."""

    stage: Stage
    planned: StudentConfig
    """The stage's settings as configured (its stop reason compares against them)."""
    cfg: StudentConfig
    """The settings it trains by: ``planned`` with the token budget applied."""
    validate_at_start: bool
    """Validate before the first step, so that the weights the stage starts from count among its
    best (a stage that starts from a trained student must never end worse than it started)."""

    def build(self) -> tuple[nn.Module, nn.Module]:
        """The trained module (saved, checkpointed) and what the steps run (it, DDP- or FSDP-wrapped)."""
        ...

    def prepare(self, start_step: int) -> None:
        """Held-out targets and input builders, after a resume has set ``start_step``."""
        ...

    def micro_step(self, batch: dict[str, torch.Tensor], accum: int) -> dict[int, float]:
        """Forward and backward of one micro-batch, gradients scaled by 1/accum; the losses to log."""
        ...

    def gradients(self) -> float:
        """Make the step's gradients final (averaged where no wrapper did, clipped); the norm to log."""
        ...

    def train_record(self, step: int, losses: dict[int, float], grad_norm: float, lr: float,
                     counters: StageCounters) -> tuple[dict, dict[str, str]]:
        """The step's metrics.jsonl record and its progress bar figures."""
        ...

    def validate(self, step: int) -> Validation:
        """Validate on the held-out set (every rank calls it; the leader's result counts)."""
        ...

    def finish(self) -> None:
        """Fold what must be folded into the module before its weights are saved."""
        ...

    def progress_name(self) -> str:
        ...


# ---------------------------------------------------------------------- a stage
class StageTrainer:
    """Trains one stage's task: setup, train, save_checkpoint, finish, cleanup."""

    def __init__(self, ctx: StudentContext, task: StageTask) -> None:
        self.ctx = ctx
        self.task = task
        self.stage = task.stage
        self.scfg = task.cfg
        self.start_step = 0
        self._loader_iter = None
        self._background: BackgroundBatches | None = None
        self.loader: DataLoader | None = None
        self.patience = Patience(self.scfg.patience, self.scfg.min_delta)
        self.best = BestWeights()

    # -- setup
    def setup(self) -> None:
        torch.manual_seed(self.scfg.seed + self.stage.index)
        self.module, self.model = self.task.build()
        self._setup_optimizer()
        self._maybe_resume()
        self.task.prepare(self.start_step)
        self._setup_data()

    def _setup_optimizer(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.scfg.lr, weight_decay=self.scfg.weight_decay)
        total, warmup, floor = self.scfg.steps_per_stage, self.scfg.warmup_steps, self.scfg.min_lr_ratio
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: cosine_lr(step, total, warmup, floor))

    def _maybe_resume(self) -> None:
        directory = self.ctx.checkpoint_dir
        if self.ctx.cfg.resume and ckpt.has_training_state(directory, self.stage.index):
            state = ckpt.load_training_state(directory, module=self.module, optimizer=self.optimizer,
                                             scheduler=self.scheduler)
            self.start_step = int(state["step"])
            self.best.load(state.get("best"), ckpt.load_best_weights(directory))
            log.info("stage %d: resumed at step %d from %s", self.stage.index, self.start_step, directory)

    def _setup_data(self) -> None:
        ctx = self.ctx
        if ctx.leader:
            generation = ctx.client.set_model(self.stage.model_id, self.stage.model_cfg)
        else:
            generation = 0
        generation = broadcast_int(generation, ctx)
        if not ctx.leader:
            ctx.client.wait_generation(generation, timeout_s=120)
        workers, cuda = self.scfg.loader_workers, ctx.device.type == "cuda"
        dataset = stage_dataset(ctx.cfg, ctx.rank, ctx.client.generation_value, ctx.batch_config,
                                self.scfg.micro_batch_size, pin_memory=cuda and workers == 0)
        if workers == 0 and self.scfg.prefetch_batches > 0:
            self._background = BackgroundBatches(dataset.__iter__, self.scfg.prefetch_batches,
                                                 name=f"batches-stage{self.stage.index}")
            self._loader_iter = DevicePrefetcher(self._background, ctx.device)
            return
        self.loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                                 pin_memory=cuda and workers > 0,
                                 prefetch_factor=2 if workers else None,
                                 persistent_workers=False)
        self._loader_iter = DevicePrefetcher(loader_batches(self.loader), ctx.device)

    # -- train
    def train(self) -> Validation:
        total, accum = self.scfg.steps_per_stage, self.scfg.grad_accum_steps
        bar = tqdm(total=total, initial=self.start_step, disable=not self.ctx.leader, leave=True,
                   desc=self.task.progress_name())
        counters = StageCounters(self.ctx.world_size)
        losses: dict[int, float] = {}
        self.model.train()
        steps_done, stopped = self.start_step, stop_reason(self.task.planned, total)
        val, validated_at = Validation(), None
        workers = WorkersSeen()
        workers.note(self.ctx.client.live_workers)
        if self.task.validate_at_start and self.start_step == 0:
            val, validated_at = self._timed_validate(0), 0
        profiler = self._profiler()
        try:
            for step in range(self.start_step, total):
                losses, grad_norm = self._step(step == self.start_step, accum, counters)
                if profiler is not None:
                    profiler.step()
                workers.note(self.ctx.client.live_workers)
                bar.update(1)
                done = steps_done = step + 1
                if done % self.scfg.log_every_steps == 0 or done == total:
                    self._log_train(done, losses, grad_norm, counters, bar)
                if self.scfg.val_every_steps and done % self.scfg.val_every_steps == 0 and done < total:
                    val, validated_at = self._timed_validate(done), done
                    if self._out_of_patience(val):
                        stopped = STOP_PATIENCE
                        break
                if self.scfg.checkpoint_every_steps and done % self.scfg.checkpoint_every_steps == 0 \
                        and done < total:
                    with timed(self.ctx.timings, "checkpoint_s"):
                        self.save_checkpoint(done)
        finally:
            if profiler is not None:
                profiler.close()
        bar.close()
        return self._end(val, validated_at, steps_done, stopped, counters, workers)

    def _profiler(self) -> StepProfiler | None:
        """This rank's profiler of the stage ``profile.stage`` (``distill.profiling``), else None."""
        cfg = self.ctx.cfg.profile
        if cfg.stage != self.stage.index:
            return None
        return step_profiler(cfg, self.ctx.out_dir / PROFILE_DIR, f"student_rank{self.ctx.rank}_stage{self.stage.index}")

    def _step(self, first: bool, accum: int, counters: StageCounters) -> tuple[dict[int, float], float]:
        """One optimizer step over ``accum`` micro-batches, counted in ``counters``: the last
        micro-batch's losses and the gradient norm. The wait for the stage's first batch (the
        teachers switching to the stage) counts apart."""
        step_started = time.monotonic()
        losses: dict[int, float] = {}
        for micro in range(accum):
            t0 = time.monotonic()
            batch = next(self._loader_iter)
            if first and micro == 0:
                counters.startup_wait_s = time.monotonic() - t0
                step_started = time.monotonic()
            else:
                counters.wait_s += time.monotonic() - t0
            with gradient_sync(self.model, sync=micro == accum - 1):
                losses = self.task.micro_step(batch, accum)
            counters.samples += batch["input_ids"].shape[0]
        grad_norm = self.task.gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        counters.step_s += time.monotonic() - step_started
        return losses, grad_norm

    def _log_train(self, step: int, losses: dict[int, float], grad_norm: float, counters: StageCounters,
                   bar: tqdm) -> None:
        record, figures = self.task.train_record(step, losses, float(grad_norm),
                                                 self.scheduler.get_last_lr()[0], counters)
        bar.set_postfix(**figures)
        self.ctx.log_metrics(record)

    def _end(self, val: Validation, validated_at: int | None, steps_done: int, stopped: str,
             counters: StageCounters, workers: WorkersSeen) -> Validation:
        """The stage's last validation, its best weights, its time and its ``stage_end`` record."""
        supply = {**counters.supply(), **workers.record()}
        self._report_starvation(supply)
        if validated_at != steps_done:
            val = self._timed_validate(steps_done)
        val, best_step = self._keep_best(val, steps_done)
        counters.add_to(self.ctx.timings)
        ctx = self.ctx
        ctx.log_metrics({"event": "stage_end", "stage": self.stage.index, "kind": self.stage.kind,
                         "layers": list(self.stage.layers), "steps": steps_done,
                         "tokens": counters.samples * ctx.cfg.data.seq_len * ctx.world_size,
                         "wall_s": time.monotonic() - counters.started, **json_record(val.record),
                         "best_step": best_step, "stopped": stopped, **supply})
        return val

    def _timed_validate(self, step: int) -> Validation:
        """Validate, and keep the weights if they are the best so far (the leader decides,
        every rank keeps its own copy)."""
        with timed(self.ctx.timings, "validation_s"):
            val = self.task.validate(step)
        if broadcast_int(int(self.best.improves(val)), self.ctx):
            self.best.keep(self.module, val, step)
        return val

    def _keep_best(self, last: Validation, step: int) -> tuple[Validation, int]:
        """The stage's final weights are its best validated ones: restore them (every rank, as
        the leader decides) when the last validation is worse than an earlier one."""
        worse = last.score is not None and (math.isnan(last.score) or self.best.score < last.score)
        restore = self.best.step is not None and self.best.step != step and worse
        if not broadcast_int(int(restore), self.ctx):
            return last, step
        self.best.restore(self.module)
        log.info("stage %d: restored the weights of step %d (validation %.5g; step %d: %.5g)",
                 self.stage.index, self.best.step, self.best.score, step, last.score)
        return Validation(self.best.score, self.best.record), self.best.step

    def _out_of_patience(self, val: Validation) -> bool:
        """Leader decides from its validation (others have none); every rank gets the verdict."""
        stop = val.score is not None and self.patience.update(val.score)
        stop = bool(broadcast_int(int(stop), self.ctx))
        if stop and self.ctx.leader:
            log.info("stage %d: validation has not improved for %d validations: stopping early",
                     self.stage.index, self.scfg.patience)
        return stop

    def _report_starvation(self, supply: dict[str, float]) -> None:
        """Tell the user when the teachers, not the students, set the pace, and by how much."""
        if not self.ctx.leader:
            return
        if supply["wait_fraction"] < STARVED_FRACTION:
            log.info("stage %d: students waited %.1f%% of their steps for data (%.0f samples/s), after %.0fs "
                     "for the teachers' first batch of the stage (not counted: the teachers switch stages)",
                     self.stage.index, 100 * supply["wait_fraction"], supply["delivered_samples_per_s"],
                     supply["startup_wait_s"])
            return
        pipeline = self.ctx.cfg.pipeline
        slots = Slots(pipeline.slot_count, self.ctx.world_size * max(1, self.scfg.loader_workers),
                      pipeline.worker_max_batch)
        log.warning("%s", teacher_bound_advice(self.stage.index, supply, self.ctx.out_dir / ADD_WORKER_SCRIPT, slots))

    # -- checkpoint
    def save_checkpoint(self, step: int) -> None:
        """The leader writes; every rank takes part (a sharded module's state is gathered)."""
        ckpt.save_training_state(self.ctx.checkpoint_dir, stage=self.stage.index, step=step,
                                 module=self.module, optimizer=self.optimizer,
                                 scheduler=self.scheduler,
                                 best=None if is_sharded(self.module) else self.best.tensors,
                                 extra={"config": plain(self.ctx.cfg),
                                        "best": json_record(self.best.meta())},
                                 write=self.ctx.leader)
        barrier(self.ctx)

    def finish(self) -> None:
        """Record the stage as done: its weights, and progress (never retrained)."""
        self.task.finish()
        directory = self.ctx.checkpoint_dir
        ckpt.save_stage_weights(directory, self.stage.index, self.module, write=self.ctx.leader)
        if self.ctx.leader:
            progress = ckpt.read_progress(directory)
            progress["finished"] = sorted(set(progress["finished"]) | {self.stage.index})
            progress["layers"] = {str(s.index): list(s.layers) for s in self.ctx.stages}
            ckpt.write_json_atomic(directory / ckpt.PROGRESS_FILE, progress)
        barrier(self.ctx)

    def cleanup(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Close the stage's loader: its batch thread (which closes the dataset, so the pool
        unlinks), waited on for at most ``wait_s``, and its DataLoader workers."""
        if self._background is not None:
            self._background.close(wait_s)
            self._background = None
        self._loader_iter = None  # shuts DataLoader workers down; their pools unlink
        self.loader = None


def train_stage(trainer: StageTrainer) -> None:
    """Set up, train and record one stage; its setup and its record are timed as phases
    of the run (``distill.train.timing``), its steps by ``train`` itself. The stage's loader
    is closed however it ends (its thread, its DataLoader workers, their slot pools): left
    to process exit, a caller that goes on (the supervisor's error report, a test) would run
    beside a thread still asking the broker for the stage's samples. After an interrupt or
    SIGTERM the close waits only briefly (:data:`INTERRUPTED_CLOSE_WAIT_S`)."""
    wait_s = INTERRUPTED_CLOSE_WAIT_S
    try:
        with timed(trainer.ctx.timings, "stage_setup_s"):
            trainer.setup()
        trainer.train()
        with timed(trainer.ctx.timings, "checkpoint_s"):
            trainer.finish()
        wait_s = CLOSE_WAIT_S
    except Exception:
        wait_s = CLOSE_WAIT_S
        raise
    finally:
        trainer.cleanup(wait_s)
