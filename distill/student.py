"""mode=student: DDP ranks that train the replacement modules, one stage at a time.

Rank 0 leads: it switches the stage on the broker (``set_model``) and broadcasts the
new generation; the other ranks wait until their PUB/SUB listener has seen it, so
all ranks start each stage at the same step on samples of that stage only. Each
stage builds its replacements, optimizer, schedule and DDP wrapper afresh
(:class:`StageTrainer`: ``setup``, ``train``, ``save_checkpoint``, ``cleanup``).

Shape legend: B batch, P boundary positions of a stage, T tokens, D hidden size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from tqdm import tqdm

from distill import checkpoint as ckpt
from distill.closed_loop import ClosedLoopInputs, build_closed_loop
from distill.pipeline import BatchConfig, DistillIterableDataset, StudentClient
from distill.runtime import (
    configure_logging,
    curve_config,
    endpoints,
    exit_on_sigterm,
    run_dir,
    run_id,
)
from distill.sources import load_chunks, load_teacher, load_tokenizer, teacher_source
from distill.stages import (
    Stage,
    closed_loop,
    e2e_top_k,
    max_positions,
    plan_stages,
    sample_batch_config,
)
from distill.stopping import STOP_PATIENCE, Patience, stop_reason, with_budget
from distill.teacher import Teacher
from distill.timing import process_age_s, timed
from distill.transfer import BackgroundBatches, DevicePrefetcher

log = logging.getLogger(__name__)

STARVED_FRACTION = 0.05
"""Warn when students spend more than this share of their steps waiting for samples
(the first batch of a stage, which waits for the teachers to switch, not counted)."""


@dataclass
class StudentContext:
    """What every stage of this rank shares."""

    cfg: DictConfig
    rank: int
    world_size: int
    device: torch.device
    teacher: Teacher
    client: StudentClient
    batch_config: BatchConfig
    heldout_NT: torch.Tensor
    checkpoint_dir: Path
    out_dir: Path
    stages: list[Stage]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def log_metrics(self, record: dict[str, Any]) -> None:
        if self.leader:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------- losses
def layer_loss(pred_BTD: torch.Tensor, target_BTD: torch.Tensor, kind: str) -> torch.Tensor:
    """``nmse``: MSE(s, t) / MSE(t, 0) in fp32 (scale-free across layers); ``cosine``: 1 - cos."""
    pred, target = pred_BTD.float(), target_BTD.float()
    if kind == "nmse":
        return (pred - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(pred, target, dim=-1).mean()
    raise ValueError(f"student.loss={kind!r}: choose nmse or cosine")


class StageModule(nn.Module):
    """The replacements of one stage, each fed the teacher's input of its layer."""

    def __init__(self, replacements: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layer_idxs = sorted(replacements)
        self.blocks = nn.ModuleDict({str(layer): replacements[layer] for layer in self.layer_idxs})

    def forward(self, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: self.blocks[str(layer)](inputs[layer]) for layer in self.layer_idxs}


def build_replacement(cfg: DictConfig, teacher: Teacher, layer: int) -> nn.Module:
    """Instantiate ``cfg.replacement`` for one teacher layer, trained in fp32."""
    try:
        factory = instantiate(cfg.replacement)
        return factory(teacher=teacher, layer_idx=layer).float()
    except TypeError as exc:  # an option the replacement does not take
        raise ValueError(f"replacement={cfg.replacement.get('_target_')}: {exc}; check the keys under "
                         "replacement (see conf/replacement/*.yaml for each option)") from exc


def data_supply(wait_s: float, step_s: float, samples: int, startup_wait_s: float = 0.0) -> dict[str, float]:
    """How well the teachers fed a stage, from the student's clock.

    ``step_s`` is the time of the training steps, waiting for data included;
    ``samples`` those the steps consumed (all ranks). Delivered is what arrived per
    second of steps; needed is what the students would have taken had they never
    waited. Their ratio is how many times more teacher throughput the stage lacked.
    The first batch of a stage (``startup_wait_s``: the teachers switching layers) is
    reported apart, not as starvation.
    """
    compute_s = max(step_s - wait_s, 1e-9)
    return {"wait_fraction": wait_s / step_s if step_s > 0 else 0.0,
            "delivered_samples_per_s": samples / step_s if step_s > 0 else 0.0,
            "needed_samples_per_s": samples / compute_s,
            "startup_wait_s": startup_wait_s}


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------- a stage
class StageTrainer:
    """Trains the replacements of one stage: setup, train, save_checkpoint, cleanup."""

    def __init__(self, ctx: StudentContext, stage: Stage) -> None:
        self.ctx = ctx
        self.stage = stage
        self.scfg = with_budget(ctx.cfg.student, ctx.world_size, ctx.cfg.data.seq_len)
        self.start_step = 0
        self._loader_iter = None
        self._background: BackgroundBatches | None = None
        self.closed_loop: ClosedLoopInputs | None = None
        self.patience = Patience(self.scfg.patience, self.scfg.min_delta)

    # -- setup
    def setup(self) -> None:
        self._setup_model()
        self._setup_optimizer()
        self._maybe_resume()
        self._setup_data()
        self._setup_validation()
        self._setup_inputs()

    def _setup_inputs(self) -> None:
        """Closed-loop input builder (``student.inputs``); None for teacher inputs."""
        self.closed_loop = build_closed_loop(self.ctx, self.stage, self.scfg.steps_per_stage, self.start_step)

    def _setup_model(self) -> None:
        torch.manual_seed(self.scfg.seed + self.stage.index)
        replacements = {layer: build_replacement(self.ctx.cfg, self.ctx.teacher, layer)
                        for layer in self.stage.layers}
        self.module = StageModule(replacements).to(self.ctx.device)
        if self.ctx.world_size > 1:
            device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
            self.model: nn.Module = DDP(self.module, device_ids=device_ids)
        else:
            self.model = self.module

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
            log.info("stage %d: resumed at step %d from %s", self.stage.index, self.start_step, directory)

    def _setup_data(self) -> None:
        ctx = self.ctx
        if ctx.leader:
            generation = ctx.client.set_model(self.stage.model_id, self.stage.model_cfg)
        else:
            generation = 0
        generation = _broadcast_int(generation, ctx)
        if not ctx.leader:
            ctx.client.wait_generation(generation, timeout_s=120)
        eps = endpoints(ctx.cfg)
        workers, cuda = self.scfg.loader_workers, ctx.device.type == "cuda"
        dataset = DistillIterableDataset(
            ctx.rank, ctx.client.generation_value, ctx.cfg.pipeline.slot_count, ctx.batch_config,
            eps["frontend"], run_id=run_id(ctx.cfg), batch_size=self.scfg.micro_batch_size,
            heartbeat_interval_s=ctx.cfg.pipeline.heartbeat_interval_s,
            heartbeat_liveness=ctx.cfg.pipeline.heartbeat_liveness, medium=ctx.cfg.pipeline.medium,
            tcp_host=ctx.cfg.pipeline.tcp_host, curve=curve_config(ctx.cfg), pin_memory=cuda and workers == 0,
            notices=ctx.cfg.pipeline.notices, notice_dir=ctx.cfg.pipeline.socket_dir,
            direct_requests=ctx.cfg.pipeline.direct_requests)
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
        self._loader_iter = DevicePrefetcher(iter(self.loader), ctx.device)

    def _setup_validation(self) -> None:
        """Teacher targets on the held-out chunks (the same in every run), computed here once."""
        self.val_pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        if not self.ctx.leader or len(self.ctx.heldout_NT) == 0:
            return
        bs = self.scfg.micro_batch_size
        for start in range(0, len(self.ctx.heldout_NT), bs):
            captured = self.ctx.teacher.capture(self.ctx.heldout_NT[start:start + bs], list(self.stage.layers))
            for layer in self.stage.layers:
                x, y = captured[layer]
                self.val_pairs.setdefault(layer, []).append((x.float(), y.float()))

    # -- train
    def train(self) -> dict[str, float]:
        total = self.scfg.steps_per_stage
        accum = self.scfg.grad_accum_steps
        bar = tqdm(total=total, initial=self.start_step, disable=not self.ctx.leader, leave=True,
                   desc=f"stage {self.stage.index} layers {','.join(map(str, self.stage.layers))}")
        started = time.monotonic()
        wait_s = compute_s = startup_wait_s = 0.0
        samples = 0
        losses: dict[int, float] = {}
        self.model.train()
        steps_done, stopped = self.start_step, stop_reason(self.ctx.cfg.student, total)
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
                sync = micro == accum - 1 or not isinstance(self.model, DDP)
                with contextlib.nullcontext() if sync else self.model.no_sync():
                    loss, losses = self._loss(batch)
                    (loss / accum).backward()
                samples += batch["input_ids"].shape[0]
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.scfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            compute_s += time.monotonic() - step_started
            bar.update(1)
            done = steps_done = step + 1
            if done % self.scfg.log_every_steps == 0 or done == total:
                self._log_train(done, losses, float(grad_norm), samples, started, wait_s, compute_s, bar)
            validate_now = self.scfg.val_every_steps and done % self.scfg.val_every_steps == 0 and done < total
            if validate_now and self._out_of_patience(self._timed_validate(done)):
                stopped = STOP_PATIENCE
                break
            if self.scfg.checkpoint_every_steps and done % self.scfg.checkpoint_every_steps == 0 \
                    and done < total:
                with timed(self.ctx.timings, "checkpoint_s"):
                    self.save_checkpoint(done)
        bar.close()
        supply = data_supply(wait_s, compute_s, samples * self.ctx.world_size, startup_wait_s)
        self._report_starvation(supply)
        val = self._timed_validate(steps_done)
        timings = self.ctx.timings
        timings["student_compute_s"] = timings.get("student_compute_s", 0.0) + compute_s - wait_s
        timings["student_wait_s"] = timings.get("student_wait_s", 0.0) + wait_s
        timings["student_startup_wait_s"] = timings.get("student_startup_wait_s", 0.0) + startup_wait_s
        self.ctx.log_metrics({"event": "stage_end", "stage": self.stage.index, "layers": list(self.stage.layers),
                              "steps": steps_done, "tokens": samples * self.ctx.cfg.data.seq_len * self.ctx.world_size,
                              "wall_s": time.monotonic() - started, "val": {str(k): v for k, v in val.items()},
                              "stopped": stopped, **supply})
        return val

    def _timed_validate(self, step: int) -> dict[int, float]:
        with timed(self.ctx.timings, "validation_s"):
            return self.validate(step)

    def _out_of_patience(self, val: dict[int, float]) -> bool:
        """Leader decides from its validation (others have none); every rank gets the verdict."""
        stop = bool(val) and self.patience.update(sum(val.values()) / len(val))
        stop = bool(_broadcast_int(int(stop), self.ctx))
        if stop and self.ctx.leader:
            log.info("stage %d: validation has not improved for %d validations: stopping early",
                     self.stage.index, self.scfg.patience)
        return stop

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
        loss = torch.stack(list(per_layer.values())).mean()
        return loss, {layer: float(v.detach()) for layer, v in per_layer.items()}

    def _log_train(self, step: int, losses: dict[int, float], grad_norm: float, samples: int,
                   started: float, wait_s: float, compute_s: float, bar: tqdm) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        mean = sum(losses.values()) / max(1, len(losses))
        rate = samples * self.ctx.world_size / elapsed
        wait_fraction = wait_s / max(compute_s, 1e-9)
        bar.set_postfix(loss=f"{mean:.4f}", samples_s=f"{rate:.0f}", wait=f"{wait_fraction:.0%}")
        self.ctx.log_metrics({"event": "train", "stage": self.stage.index, "layers": list(self.stage.layers),
                              "step": step, "loss": mean, "layer_losses": {str(k): v for k, v in losses.items()},
                              "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                              "samples_per_s": rate, "wait_fraction": wait_fraction, "time_s": elapsed})

    def _report_starvation(self, supply: dict[str, float]) -> None:
        """Tell the user when the teachers, not the students, set the pace, and by how much."""
        if not self.ctx.leader:
            return
        if supply["wait_fraction"] < STARVED_FRACTION:
            log.info("stage %d: students waited %.1f%% of their steps for data (%.0f samples/s)",
                     self.stage.index, 100 * supply["wait_fraction"], supply["delivered_samples_per_s"])
            return
        log.warning("stage %d was teacher-bound: students waited %.0f%% of their steps for data; "
                    "they needed %.0f samples/s, the teachers delivered %.0f (%.2fx short); add teacher "
                    "workers (local.num_workers / more mode=worker) or raise pipeline.worker_max_batch",
                    self.stage.index, 100 * supply["wait_fraction"], supply["needed_samples_per_s"],
                    supply["delivered_samples_per_s"], supply["needed_samples_per_s"]
                    / max(supply["delivered_samples_per_s"], 1e-9))

    @torch.no_grad()
    def validate(self, step: int) -> dict[int, float]:
        """Per-layer loss on the fixed held-out set (leader only; others wait at the barrier)."""
        result: dict[int, float] = {}
        if self.ctx.leader and self.val_pairs:
            self.module.eval()
            for layer, pairs in self.val_pairs.items():
                block = self.module.blocks[str(layer)]
                values = [layer_loss(block(x.to(self.ctx.device)), y.to(self.ctx.device), self.scfg.loss)
                          for x, y in pairs]
                result[layer] = float(torch.stack(values).mean())
            self.module.train()
            self.ctx.log_metrics({"event": "val", "stage": self.stage.index, "step": step,
                                  "layer_losses": {str(k): v for k, v in result.items()}})
            log.info("stage %d step %d validation: %s", self.stage.index, step,
                     ", ".join(f"layer {k}: {v:.4f}" for k, v in result.items()))
        _barrier(self.ctx)
        return result

    # -- checkpoint
    def save_checkpoint(self, step: int) -> None:
        if self.ctx.leader:
            ckpt.save_training_state(self.ctx.checkpoint_dir, stage=self.stage.index, step=step,
                                     module=self.module, optimizer=self.optimizer,
                                     scheduler=self.scheduler,
                                     extra={"config": OmegaConf.to_container(self.ctx.cfg, resolve=True)})
        _barrier(self.ctx)

    def finish(self) -> None:
        """Record the stage as done: its weights, and progress (never retrained)."""
        if self.ctx.leader:
            directory = self.ctx.checkpoint_dir
            ckpt.save_stage_weights(directory, self.stage.index, self.module)
            progress = ckpt.read_progress(directory)
            progress["finished"] = sorted(set(progress["finished"]) | {self.stage.index})
            progress["layers"] = {str(s.index): list(s.layers) for s in self.ctx.stages}
            ckpt.write_json_atomic(directory / ckpt.PROGRESS_FILE, progress)
        _barrier(self.ctx)

    def cleanup(self) -> None:
        if self._background is not None:
            self._background.close()  # its thread closes the dataset: the pool unlinks
            self._background = None
        self._loader_iter = None  # shuts DataLoader workers down; their pools unlink
        self.loader = None


# ---------------------------------------------------------------------- the run
def run_student(cfg: DictConfig) -> None:
    """Train every stage not yet finished, then (rank 0) assemble, export, evaluate, report."""
    configure_logging(cfg)
    exit_on_sigterm()
    ctx = _setup_context(cfg)
    ctx.timings["student_start_s"] = process_age_s()
    try:
        finished = set(ckpt.read_progress(ctx.checkpoint_dir)["finished"]) if cfg.resume else set()
        for stage in ctx.stages:
            if stage.index in finished:
                log.info("stage %d (layers %s) already trained: skipping", stage.index, list(stage.layers))
                continue
            train_stage(StageTrainer(ctx, stage))
        if cfg.student.e2e.steps > 0:
            from distill.e2e_stage import run_e2e_stage

            run_e2e_stage(ctx, finished)
        if ctx.leader:
            from distill.finish import finish_run

            finish_run(ctx)
        _barrier(ctx)
    finally:
        ctx.client.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def train_stage(trainer: StageTrainer) -> None:
    """Set up, train and record one stage; its setup and its record are timed as phases
    of the run (``distill.timing``), its steps by ``train`` itself."""
    with timed(trainer.ctx.timings, "stage_setup_s"):
        trainer.setup()
    trainer.train()
    with timed(trainer.ctx.timings, "checkpoint_s"):
        trainer.finish()
    trainer.cleanup()


def _setup_context(cfg: DictConfig) -> StudentContext:
    rank, world_size, device = _setup_distributed(cfg)
    teacher = load_teacher(cfg, device)
    stages = plan_stages(teacher.num_layers, cfg.student.layers, cfg.student.layers_per_stage,
                         closed_loop(cfg.student))
    batch_config = sample_batch_config(max_positions(stages), cfg.data.seq_len, teacher.hidden_size,
                                       cfg.teacher.dtype, top_k=e2e_top_k(cfg.student))
    chunks = load_chunks(cfg, load_tokenizer(cfg)) if rank == 0 else None
    heldout = chunks.heldout_NT if chunks is not None else torch.zeros(0, cfg.data.seq_len, dtype=torch.long)
    eps = endpoints(cfg)
    client = StudentClient(rank, 1, batch_config, eps["frontend"], eps["control"], eps["control_pub"],
                           run_id=run_id(cfg), heartbeat_interval_s=cfg.pipeline.heartbeat_interval_s,
                           heartbeat_liveness=cfg.pipeline.heartbeat_liveness, curve=curve_config(cfg),
                           share_model=cfg.pipeline.fan_out, notices=False)  # control only: no samples
    client.hello()
    if rank != 0:
        client.start_sub_listener()
    out_dir = run_dir()
    directory = checkpoint_dir(cfg)
    if rank == 0:
        log.info("run dir %s; checkpoints in %s; %d stage(s) of %s", out_dir, directory, len(stages),
                 [list(s.layers) for s in stages])
    return StudentContext(cfg, rank, world_size, device, teacher, client, batch_config, heldout,
                          directory, out_dir, stages)


def _setup_distributed(cfg: DictConfig) -> tuple[int, int, torch.device]:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.device.student_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not torch.cuda.is_available():
            raise ValueError("device.student_gpu=true but CUDA is not available; set device=cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend)
    return rank, world_size, device


def checkpoint_dir(cfg: DictConfig) -> Path:
    """Where this run's checkpoints live: the same for a rerun of the same command."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    from distill.finish import config_fingerprint

    return Path("outputs") / "checkpoints" / config_fingerprint(cfg, teacher_source(cfg))


def _broadcast_int(value: int, ctx: StudentContext) -> int:
    if ctx.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def _barrier(ctx: StudentContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()
