"""mode=worker: a teacher that fills students' slots with per-layer targets.

For a stage (model_cfg ``{"layers": [...]}``) each request id picks a training
chunk; the worker runs ONE batched forward over all chunks of the WORK it holds,
stopping after the last target layer, and copies each sample's boundary hidden
states straight into its slot (one copy, no intermediate bytes). On CUDA the
device-to-host copies go through pinned staging buffers on a side stream and are
finished by the worker after it has started the next forward (``distill.transfer``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from omegaconf import DictConfig

from distill.data import sample_indices
from distill.e2e import write_e2e_targets
from distill.pipeline import SlotTarget, Worker
from distill.runtime import configure_logging, curve_config, endpoints, exit_on_sigterm, run_dir
from distill.sources import load_chunks, load_teacher, load_tokenizer
from distill.stages import Stage, closed_loop, e2e_top_k, plan_stages, sample_batch_config
from distill.teacher import Teacher
from distill.timing import TimedBatchFn, TimingWriter
from distill.transfer import DeviceToSlots

log = logging.getLogger(__name__)


class TeacherTargets:
    """The worker's batch function: chunks -> truncated teacher forward -> slots."""

    def __init__(self, teacher: Teacher, train_NT: torch.Tensor, seed: int) -> None:
        self.teacher = teacher
        self.train_NT = train_NT
        self.seed = seed
        self.samples = 0
        self.to_slots = DeviceToSlots(teacher.device)
        """On CUDA: pinned, side-stream copies that the worker finishes after the next forward."""

    def __call__(self, model_id: str, model_cfg: dict | None,
                 targets: list[SlotTarget]) -> Callable[[], None] | None:
        """Fill ``targets``; on CUDA return the callable that completes the device copies."""
        stage = Stage.from_model_cfg(model_cfg)
        rows = sample_indices(len(self.train_NT), [t.request_id for t in targets], self.seed)
        input_ids_BT = self.train_NT[rows]
        if stage.kind == "e2e":
            write_e2e_targets(self.teacher, input_ids_BT, targets)
            self.samples += len(targets)
            return None
        captured = self.teacher.capture(input_ids_BT, [*stage.layers, *([0] if stage.closed_loop else [])])
        states = [_state_at(captured, p) for p in stage.positions]
        for i, target in enumerate(targets):
            target.tensors["input_ids"].copy_(input_ids_BT[i])
        self.samples += len(targets)
        finish = self.to_slots.start(states, [target.tensors["hidden"] for target in targets])
        return finish if self.to_slots.cuda else None


def _state_at(captured: dict[int, tuple[torch.Tensor, torch.Tensor]], position: int) -> torch.Tensor:
    """Hidden state at a boundary: input of layer p, or else output of layer p-1."""
    if position in captured:
        return captured[position][0]
    return captured[position - 1][1]


def build_worker(cfg: DictConfig) -> Worker:
    device = f"cuda:{cfg.device.worker_gpu}" if cfg.device.worker_gpu is not None else "cpu"
    teacher = load_teacher(cfg, device)
    chunks = load_chunks(cfg, load_tokenizer(cfg))
    stages = plan_stages(teacher.num_layers, cfg.student.layers, cfg.student.layers_per_stage,
                         closed_loop(cfg.student))
    positions = max(len(s.positions) for s in stages)
    batch_config = sample_batch_config(positions, cfg.data.seq_len, teacher.hidden_size, cfg.teacher.dtype,
                                       top_k=e2e_top_k(cfg.student))
    eps = endpoints(cfg)
    targets = TeacherTargets(teacher, chunks.train_NT, cfg.data.seed)
    timed = TimedBatchFn(targets, copy_s=lambda: targets.to_slots.copy_s)
    return Worker(batch_fn=timed, batch_config=batch_config,
                  backend_endpoint=eps["backend"], control_pub_endpoint=eps["control_pub"],
                  max_batch=cfg.pipeline.worker_max_batch,
                  heartbeat_interval_s=cfg.pipeline.heartbeat_interval_s,
                  heartbeat_liveness=cfg.pipeline.heartbeat_liveness,
                  local_shm=cfg.pipeline.local_shm, curve=curve_config(cfg),
                  notify_students=cfg.pipeline.notices, notice_dir=cfg.pipeline.socket_dir,
                  direct_requests=cfg.pipeline.direct_requests)


def run_worker(cfg: DictConfig) -> None:
    """Serve teacher targets until the broker publishes STOP."""
    configure_logging(cfg)
    exit_on_sigterm()
    worker = build_worker(cfg)
    log.info("teacher worker ready (%d-byte samples, batches of up to %d)", worker.slot_size,
             worker.max_batch)
    writer = TimingWriter(worker.batch_fn.snapshot, run_dir() / f"teacher_time.{os.getpid()}.json").start()
    try:
        worker.run()
    finally:
        writer.stop()
