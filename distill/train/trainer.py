"""The stage trainer: one stage's replacements trained across the DDP ranks.

Rank 0 leads: it switches the stage on the broker (``set_model``) and broadcasts the
new generation; the other ranks wait until their PUB/SUB listener has seen it, so
all ranks start each stage at the same step on samples of that stage only. Each
stage builds its replacements, optimizer, schedule and DDP wrapper afresh
(:class:`StageTrainer`: ``setup``, ``train``, ``validate``, ``save_checkpoint``,
``finish``, ``cleanup``, the verbs of torchtune's recipes).

Shape legend: B batch, P boundary positions of a stage, T tokens, D hidden size.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from distill.config import StudentConfig, plain
from distill.stages import Stage
from distill.train import checkpoint as ckpt
from distill.train.closed_loop import ClosedLoopInputs, build_closed_loop
from distill.train.context import (
    StudentContext,
    average_gradients,
    barrier,
    broadcast_int,
    gradient_sync,
    is_sharded,
    wrap_for_training,
)
from distill.train.joint import JointTraining, JointValidation
from distill.train.losses import layer_loss
from distill.train.modules import build_stage_module, load_stage_replacements
from distill.train.stopping import STOP_PATIENCE, Patience, stop_reason, with_budget
from distill.train.supply import (
    STARVED_FRACTION,
    Slots,
    WorkersSeen,
    data_supply,
    teacher_bound_advice,
)
from distill.train.timing import timed
from distill.train.transfer import BackgroundBatches, DevicePrefetcher, loader_batches
from distill.train.validation import BestWeights, LayerValidation, Validation
from distill.transport import ADD_WORKER_SCRIPT, stage_dataset

log = logging.getLogger(__name__)

def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------- a stage
class StageTrainer:
    """Trains the replacements of one stage: setup, train, save_checkpoint, cleanup."""

    validate_at_start = False
    """Validate before the first step, so that the weights the stage starts from count among its
    best (a stage that starts from a trained student must never end worse than it started)."""

    def __init__(self, ctx: StudentContext, stage: Stage, student_cfg: StudentConfig | None = None) -> None:
        """``student_cfg``: the settings of this stage when not ``ctx.cfg.student`` (the
        end-to-end stage and the hybrid's scoring pass have their own)."""
        self.ctx = ctx
        self.stage = stage
        self._planned_cfg = student_cfg or ctx.cfg.student
        self.scfg = with_budget(self._planned_cfg, ctx.world_size, ctx.cfg.data.seq_len)
        self.start_step = 0
        self._loader_iter = None
        self._background: BackgroundBatches | None = None
        self.closed_loop: ClosedLoopInputs | None = None
        self.joint: JointTraining | None = None
        self.validation: LayerValidation | None = None
        self.patience = Patience(self.scfg.patience, self.scfg.min_delta)
        self.best = BestWeights()

    # -- setup
    def setup(self) -> None:
        self._setup_model()
        self._setup_optimizer()
        self._maybe_resume()
        frozen = self._earlier_replacements()
        self._setup_validation(frozen)
        self._setup_inputs(frozen)
        self._setup_data()

    def _earlier_replacements(self) -> dict[int, nn.Module]:
        """The trained replacements of the stages before this one (frozen), which build the
        student's own inputs of this stage; loaded only where closed-loop inputs or the
        leader's validation need them."""
        if not (self.stage.closed_loop or self.ctx.leader):
            return {}
        return load_stage_replacements(self.ctx, [s for s in self.ctx.stages if s.index < self.stage.index])

    def _setup_inputs(self, frozen: dict[int, nn.Module]) -> None:
        """Closed-loop input builder (``student.inputs``); None for teacher inputs. A joint
        stage builds every input itself (:mod:`distill.train.joint`)."""
        if self.stage.joint:
            scfg = self.scfg
            self.joint = JointTraining(self.ctx.teacher, self.stage, scfg.inputs, scfg.loss, scfg.steps_per_stage,
                                       scfg.grad_accum_steps, self.start_step, scfg.seed)
            log.info("stage %d: layers %s trained jointly (%s inputs), one teacher pass per token",
                     self.stage.index, _span(self.stage.layers), scfg.inputs)
            return
        self.closed_loop = build_closed_loop(self.ctx, self.stage, frozen, self.scfg.steps_per_stage,
                                             self.start_step)

    def _setup_model(self) -> None:
        torch.manual_seed(self.scfg.seed + self.stage.index)
        self.module: nn.Module = build_stage_module(self.ctx.cfg, self.ctx.teacher, self.stage).to(self.ctx.device)
        # a joint stage backpropagates layer by layer and averages its gradients itself
        self.model: nn.Module = self.module if self.stage.joint else wrap_for_training(self.module, self.ctx)

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
            self.loader = None  # the dataset's own iterator, in a thread that gathers ahead
            self._background = BackgroundBatches(dataset.__iter__, self.scfg.prefetch_batches,
                                                 name=f"batches-stage{self.stage.index}")
            self._loader_iter = DevicePrefetcher(self._background, ctx.device)
            return
        self.loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                                 pin_memory=cuda and workers > 0,
                                 prefetch_factor=2 if workers else None,
                                 persistent_workers=False)
        self._loader_iter = DevicePrefetcher(loader_batches(self.loader), ctx.device)

    def _setup_validation(self, frozen: dict[int, nn.Module]) -> None:
        """Held-out inputs and teacher targets of the stage's layers, computed here once (leader)."""
        ctx = self.ctx
        if ctx.leader and len(ctx.heldout_NT) and self.stage.joint:
            self.validation = JointValidation(ctx.teacher, self.stage, ctx.heldout_NT, self.scfg.micro_batch_size,
                                              ctx.device, self.scfg.loss)
        elif ctx.leader and len(ctx.heldout_NT):
            self.validation = LayerValidation(ctx.teacher, self.stage, ctx.heldout_NT, frozen,
                                              self.scfg.micro_batch_size, ctx.device, self.scfg.loss)

    # -- train
    def train(self) -> Validation:
        total = self.scfg.steps_per_stage
        accum = self.scfg.grad_accum_steps
        bar = tqdm(total=total, initial=self.start_step, disable=not self.ctx.leader, leave=True,
                   desc=_progress_name(self.stage))
        started = time.monotonic()
        wait_s = compute_s = startup_wait_s = 0.0
        samples = 0
        losses: dict[int, float] = {}
        self.model.train()
        steps_done, stopped = self.start_step, stop_reason(self._planned_cfg, total)
        val, validated_at = Validation(), None
        workers = WorkersSeen()
        workers.note(self.ctx.client.live_workers)
        if self.validate_at_start and self.start_step == 0:
            val, validated_at = self._timed_validate(0), 0
        for step in range(self.start_step, total):
            step_started = time.monotonic()
            for micro in range(accum):
                t0 = time.monotonic()
                batch = next(self._loader_iter)
                if step == self.start_step and micro == 0:  # the teachers switch to this stage
                    startup_wait_s = time.monotonic() - t0
                    step_started = time.monotonic()
                else:
                    wait_s += time.monotonic() - t0
                with gradient_sync(self.model, sync=micro == accum - 1):
                    losses = self._micro_step(batch, accum)
                samples += batch["input_ids"].shape[0]
            if self.joint is not None:
                average_gradients(self.module, self.ctx)
            grad_norm = self._clip_gradients()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            compute_s += time.monotonic() - step_started
            workers.note(self.ctx.client.live_workers)
            bar.update(1)
            done = steps_done = step + 1
            if done % self.scfg.log_every_steps == 0 or done == total:
                self._log_train(done, losses, float(grad_norm), samples, started, wait_s, compute_s, bar)
            if self.scfg.val_every_steps and done % self.scfg.val_every_steps == 0 and done < total:
                val, validated_at = self._timed_validate(done), done
                if self._out_of_patience(val):
                    stopped = STOP_PATIENCE
                    break
            if self.scfg.checkpoint_every_steps and done % self.scfg.checkpoint_every_steps == 0 \
                    and done < total:
                with timed(self.ctx.timings, "checkpoint_s"):
                    self.save_checkpoint(done)
        bar.close()
        supply = {**data_supply(wait_s, compute_s, samples * self.ctx.world_size, startup_wait_s),
                  **workers.record()}
        self._report_starvation(supply)
        if validated_at != steps_done:
            val = self._timed_validate(steps_done)
        val, best_step = self._keep_best(val, steps_done)
        timings = self.ctx.timings
        timings["student_compute_s"] = timings.get("student_compute_s", 0.0) + compute_s - wait_s
        timings["student_wait_s"] = timings.get("student_wait_s", 0.0) + wait_s
        timings["student_startup_wait_s"] = timings.get("student_startup_wait_s", 0.0) + startup_wait_s
        self.ctx.log_metrics({"event": "stage_end", "stage": self.stage.index, "kind": self.stage.kind,
                              "layers": list(self.stage.layers),
                              "steps": steps_done, "tokens": samples * self.ctx.cfg.data.seq_len * self.ctx.world_size,
                              "wall_s": time.monotonic() - started, **_json_record(val.record),
                              "best_step": best_step, "stopped": stopped, **supply})
        return val

    def _timed_validate(self, step: int) -> Validation:
        """Validate, and keep the weights if they are the best so far (the leader decides,
        every rank keeps its own copy)."""
        with timed(self.ctx.timings, "validation_s"):
            val = self.validate(step)
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

    def _micro_step(self, batch: dict[str, torch.Tensor], accum: int) -> dict[int, float]:
        """Forward and backward of one micro-batch (gradients scaled by 1/accum); per-layer losses."""
        if self.joint is not None:
            embed_BTD = batch["hidden"][:, 0].to(self.ctx.device, non_blocking=True)
            return self.joint(embed_BTD, self.module.blocks)
        loss, losses = self._loss(batch)
        (loss / accum).backward()
        return losses

    def _clip_gradients(self) -> float:
        """Clip each replacement's gradients on their own (the layers' losses are independent,
        so a layer's step does not shrink because other layers share its stage); the largest
        norm before clipping."""
        norms = [torch.nn.utils.clip_grad_norm_(block.parameters(), self.scfg.grad_clip)
                 for block in self.module.blocks.values()]
        return max(float(norm) for norm in norms)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[int, float]]:
        hidden_BPTD = batch["hidden"].to(self.ctx.device, non_blocking=True)
        inputs, targets = {}, {}
        for layer in self.stage.layers:
            i, o = self.stage.io_index(layer)
            inputs[layer] = hidden_BPTD[:, i].float()
            targets[layer] = hidden_BPTD[:, o]
        if self.closed_loop is not None:
            inputs = self.closed_loop(hidden_BPTD, inputs, self.module.blocks)
        preds = self.model(inputs)
        per_layer = {layer: layer_loss(preds[layer], targets[layer], self.scfg.loss) for layer in preds}
        loss = torch.stack(list(per_layer.values())).sum()  # each layer's gradient is its own loss's
        return loss, {layer: float(v.detach()) for layer, v in per_layer.items()}

    def _log_train(self, step: int, losses: dict[int, float], grad_norm: float, samples: int,
                   started: float, wait_s: float, compute_s: float, bar: tqdm) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        mean = sum(losses.values()) / max(1, len(losses))
        rate = samples * self.ctx.world_size / elapsed
        wait_fraction = wait_s / max(compute_s, 1e-9)
        bar.set_postfix(loss=f"{mean:.4f}", samples_s=f"{rate:.3g}", wait=f"{wait_fraction:.0%}")
        self.ctx.log_metrics({"event": "train", "stage": self.stage.index, "kind": self.stage.kind,
                              "layers": list(self.stage.layers),
                              "step": step, "loss": mean, "layer_losses": {str(k): v for k, v in losses.items()},
                              "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                              "samples_per_s": rate, "wait_fraction": wait_fraction, "time_s": elapsed})

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

    @torch.no_grad()
    def validate(self, step: int) -> Validation:
        """Per-layer losses on the fixed held-out set, teacher-forced and on the student's own
        inputs (leader only; others wait at the barrier and get an empty Validation)."""
        result = Validation()
        if self.validation is not None:
            self.module.eval()
            result = self.validation(self.module.blocks)
            self.module.train()
            self.ctx.log_metrics({"event": "val", "stage": self.stage.index, "kind": self.stage.kind, "step": step,
                                  "layer_losses": _by_str(result.record["val"]),
                                  "student_losses": _by_str(result.record["val_student"])})
            log.info("stage %d step %d validation (teacher inputs / student inputs): %s", self.stage.index, step,
                     ", ".join(f"layer {k}: {v:.4f} / {result.record['val_student'][k]:.4f}"
                               for k, v in result.record["val"].items()))
        barrier(self.ctx)
        return result

    # -- checkpoint
    def save_checkpoint(self, step: int) -> None:
        """The leader writes; every rank takes part (a sharded module's state is gathered)."""
        ckpt.save_training_state(self.ctx.checkpoint_dir, stage=self.stage.index, step=step,
                                 module=self.module, optimizer=self.optimizer,
                                 scheduler=self.scheduler,
                                 best=None if is_sharded(self.module) else self.best.tensors,
                                 extra={"config": plain(self.ctx.cfg),
                                        "best": _json_record(self.best.meta())},
                                 write=self.ctx.leader)
        barrier(self.ctx)

    def finish(self) -> None:
        """Record the stage as done: its weights, and progress (never retrained)."""
        directory = self.ctx.checkpoint_dir
        ckpt.save_stage_weights(directory, self.stage.index, self.module, write=self.ctx.leader)
        if self.ctx.leader:
            progress = ckpt.read_progress(directory)
            progress["finished"] = sorted(set(progress["finished"]) | {self.stage.index})
            progress["layers"] = {str(s.index): list(s.layers) for s in self.ctx.stages}
            ckpt.write_json_atomic(directory / ckpt.PROGRESS_FILE, progress)
        barrier(self.ctx)

    def cleanup(self) -> None:
        if self._background is not None:
            self._background.close()  # its thread closes the dataset: the pool unlinks
            self._background = None
        self._loader_iter = None  # shuts DataLoader workers down; their pools unlink
        self.loader = None


def _progress_name(stage: Stage) -> str:
    """The stage as its progress bar names it."""
    if stage.kind == "e2e":
        return f"stage {stage.index} end-to-end"
    if stage.joint:
        return f"stage {stage.index} layers {_span(stage.layers)} jointly"
    what = "scoring layers" if stage.kind == "score" else "layers"
    return f"stage {stage.index} {what} {','.join(map(str, stage.layers))}"


def _span(layers: tuple[int, ...]) -> str:
    """``0-29`` for a run of consecutive layers, else the list."""
    if len(layers) > 2 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def _by_str(values: dict[int, float]) -> dict[str, float]:
    """JSON keys for per-layer values."""
    return {str(k): v for k, v in values.items()}


def _json_record(record: dict) -> dict:
    """A validation record with JSON keys (per-layer dicts keyed by str)."""
    return {key: _by_str(value) if isinstance(value, dict) else value for key, value in record.items()}


def train_stage(trainer: StageTrainer) -> None:
    """Set up, train and record one stage; its setup and its record are timed as phases
    of the run (``distill.train.timing``), its steps by ``train`` itself. A stage that fails
    still closes its loader first (its thread, its DataLoader workers, their slot pools):
    left to process exit, a caller that goes on (the supervisor's error report, a test)
    would run beside a thread still asking the broker for the stage's samples. An
    interrupt or SIGTERM is not waited on: closing waits for the batch thread, which may be
    waiting on a broker that is stopping too, and the supervisor kills what outlives its
    grace period; the process's exit unlinks the pools."""
    try:
        with timed(trainer.ctx.timings, "stage_setup_s"):
            trainer.setup()
        trainer.train()
        with timed(trainer.ctx.timings, "checkpoint_s"):
            trainer.finish()
    except Exception:
        trainer.cleanup()
        raise
    trainer.cleanup()
