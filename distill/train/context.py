"""What every stage of a student rank shares, and the distributed plumbing around it.

A rank's run has one context: its rank and device, the frozen teacher, the control
connection to the broker, the sample layout, the held-out chunks (leader only), where
checkpoints and results go, and the stages to train. The collective helpers
(:func:`barrier`, :func:`broadcast_int`) and the one wrap of a trained module for data
parallelism (:func:`wrap_for_training`: DDP, or FSDP2 for the end-to-end stage) live here,
next to the process group they use.

Shape legend: N chunks, T tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel as DDP

from distill.config import Config, Parallel
from distill.model.location import teacher_source
from distill.model.sources import load_chunks, load_teacher, load_tokenizer
from distill.model.teacher import Teacher
from distill.pipeline import BatchConfig, StudentClient
from distill.stages import Stage, stage_layout
from distill.train.checkpoint import checkpoint_dir
from distill.train.tracking import NoTracker, Tracker, open_tracker
from distill.transport import control_client

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
FSDP_FORWARD_METHODS = ("final_hidden", "logits")
"""Methods besides ``forward`` through which ranks run a sharded module (validation)."""


@dataclass
class StudentContext:
    """What every stage of this rank shares."""

    cfg: Config
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
    """The layer stages (with an automatic hybrid: its scoring pass until it has chosen)."""
    teacher_source: str
    """Where the teacher was loaded from (a directory or hub name; a GGUF teacher's converted
    directory): what the exported student names as its base."""
    timings: dict[str, float] = field(default_factory=dict)
    tracker: Tracker = field(default_factory=NoTracker)
    """The run's experiment tracker (``tracking``), fed the records of metrics.jsonl; the leader's alone."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def log_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line to ``metrics.jsonl`` and hand it to the tracker (leader only: one
        writer per run)."""
        if self.leader:
            with open(self.out_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.tracker.log(record)


def setup_context(cfg: Config, out_dir: Path) -> StudentContext:
    """Join the process group, (leader) open the experiment tracker, load the teacher and (leader)
    the held-out data, say hello. The tracker opens first: a tracker that cannot start (no W&B
    login, a store refused) fails the run before minutes of loading a teacher."""
    rank, world_size, device = setup_distributed(cfg)
    tracker = open_tracker(cfg, out_dir) if rank == 0 else NoTracker()
    try:
        return _setup_parts(cfg, out_dir, rank, world_size, device, tracker)
    except BaseException:
        tracker.close(failed=True)
        raise


def _setup_parts(cfg: Config, out_dir: Path, rank: int, world_size: int, device: torch.device,
                 tracker: Tracker) -> StudentContext:
    source = teacher_source(cfg)
    teacher = load_teacher(source, cfg.teacher.dtype, device)
    stages, batch_config = stage_layout(cfg, teacher.num_layers, teacher.hidden_size)
    chunks = load_chunks(cfg.data, load_tokenizer(source)) if rank == 0 else None
    heldout = chunks.heldout_NT if chunks is not None else torch.zeros(0, cfg.data.seq_len, dtype=torch.long)
    client = control_client(cfg, rank, batch_config)
    client.hello()
    if rank != 0:
        client.start_sub_listener()
    directory = checkpoint_dir(cfg, source)
    if rank == 0:
        log.info("run dir %s; checkpoints in %s; %d stage(s) of %s", out_dir, directory, len(stages),
                 [list(s.layers) for s in stages])
    return StudentContext(cfg, rank, world_size, device, teacher, client, batch_config, heldout,
                          directory, out_dir, stages, source, tracker=tracker)


def setup_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; NCCL on CUDA, else gloo."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.device.student_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not torch.cuda.is_available():
            raise ValueError("device.student_gpu=true but CUDA is not available; set device=cpu")
        device = torch.device("cuda", _student_gpu(cfg, local_rank))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend)
    return rank, world_size, device


def _student_gpu(cfg: Config, local_rank: int) -> int:
    """``device.student_gpus[local_rank]`` (mode=local sets it to GPUs no teacher uses), else
    ``local_rank``."""
    gpus = cfg.device.get("student_gpus")
    if not gpus:
        return local_rank
    if local_rank >= len(gpus):
        raise ValueError(f"device.student_gpus={list(gpus)} has no GPU for local rank {local_rank}: "
                         "list one per rank of this machine")
    return int(gpus[local_rank])


def close_context(ctx: StudentContext, failed: bool = False) -> None:
    """End the run in the tracker (``failed``: on an error), close the control connection and
    leave the process group."""
    ctx.tracker.close(failed)
    ctx.client.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_for_training(module: nn.Module, ctx: StudentContext, parallel: str = Parallel.ddp) -> nn.Module:
    """``module`` as the ranks train it together: DDP or FSDP2 across ranks, itself on one rank.

    ``fsdp`` shards (``fully_shard``) each of ``module.shard_units()`` and then the root, so
    each rank keeps 1/world of the trained parameters, their gradients and optimizer state,
    and all-gathers one unit at a time for compute. Frozen parameters are left out
    (``ignored_params``): they are the rank's teacher, shared and never updated, so there
    is nothing to shard or reduce (and sharding them would copy them). The module is
    sharded in place: build its optimizer after this call. Forward methods other than
    ``forward`` that ranks call (``final_hidden``, ``logits``) are registered with FSDP.
    """
    if ctx.world_size == 1:
        return module
    if parallel == Parallel.fsdp:
        return _fully_shard(module, ctx)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids)


def _fully_shard(module: nn.Module, ctx: StudentContext) -> nn.Module:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    frozen = {p for p in module.parameters() if not p.requires_grad}
    for unit in getattr(module, "shard_units", list)():
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=mesh, ignored_params=frozen)
    fully_shard(module, mesh=mesh, ignored_params=frozen)
    for method in FSDP_FORWARD_METHODS:
        if hasattr(module, method):
            register_fsdp_forward_method(module, method)
    return module


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 manages ``module``: its state is then gathered and set collectively."""
    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Inside: backward reduces gradients across ranks only if ``sync`` (gradient accumulation
    runs its first micro-batches without: DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``)."""
    if sync:
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def broadcast_chunks(chunks_NT: torch.Tensor, ctx: StudentContext) -> torch.Tensor:
    """Rank 0's token chunks on every rank (held-out data that only the leader loads)."""
    if ctx.world_size == 1:
        return chunks_NT
    rows = broadcast_int(len(chunks_NT), ctx)
    device = ctx.device if ctx.device.type == "cuda" else "cpu"
    tensor = chunks_NT.to(device) if ctx.leader else torch.empty(rows, ctx.cfg.data.seq_len, dtype=torch.long,
                                                                  device=device)
    dist.broadcast(tensor, src=0)
    return tensor.cpu()


def broadcast_int(value: int, ctx: StudentContext) -> int:
    """Rank 0's ``value`` on every rank."""
    if ctx.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def broadcast_ints(values: list[int], ctx: StudentContext) -> list[int]:
    """Rank 0's list of ints on every rank (the others pass anything; its length travels first)."""
    if ctx.world_size == 1:
        return list(values)
    count = broadcast_int(len(values), ctx)
    device = ctx.device if ctx.device.type == "cuda" else "cpu"
    tensor = torch.tensor(values if ctx.leader else [0] * count, dtype=torch.long, device=device)
    dist.broadcast(tensor, src=0)
    return [int(v) for v in tensor.tolist()]


def barrier(ctx: StudentContext) -> None:
    """Wait for every rank (nothing to wait for on one rank)."""
    if ctx.world_size > 1:
        dist.barrier()


def average_gradients(module: nn.Module, ctx: StudentContext) -> None:
    """Average the gradients of ``module``'s trainable parameters over the ranks, in one
    flat all-reduce: for a module trained without DDP (a joint stage backpropagates each
    layer on its own, which DDP's one-backward-per-forward reducer does not allow)."""
    if ctx.world_size == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # a rank whose layer got no gradient still takes part
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= ctx.world_size
    offset = 0
    for p in params:
        count = p.grad.numel()
        p.grad.copy_(flat[offset:offset + count].view_as(p.grad))
        offset += count
