"""mode=worker: a teacher that fills students' slots with per-layer targets until STOP.

The batch function is :class:`distill.teacher.targets.TeacherTargets`; this entry point
loads the teacher and the data, builds the :class:`~distill.pipeline.Worker` from the
config and keeps the teacher's busy time on record for the run's time split.
"""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig

from distill.config import Config, typed_config
from distill.model.location import teacher_source
from distill.model.sources import load_chunks, load_tokenizer, load_worker_teacher
from distill.modes.process import configure_logging, exit_on_sigterm, run_dir
from distill.pipeline import Worker
from distill.profiling import PROFILE_DIR, ProfiledBatchFn, StepProfiler, step_profiler
from distill.stages import stage_layout
from distill.teacher.targets import SleepingTeacher, TeacherTargets, sample_seed
from distill.teacher.timing import TimedBatchFn, TimingWriter
from distill.transport import worker_kwargs

log = logging.getLogger(__name__)


def build_worker(cfg: Config, profiler: StepProfiler | None = None) -> Worker:
    """The teacher, its data and the Worker that serves them, as configured (its batches
    the steps of ``profiler``, when given)."""
    source = teacher_source(cfg)
    teacher = load_worker_teacher(source, cfg.teacher.dtype, cfg.device)
    chunks = load_chunks(cfg.data, load_tokenizer(source))
    _, batch_config = stage_layout(cfg, teacher.num_layers, teacher.hidden_size)
    targets = TeacherTargets(teacher, chunks.train_NT, sample_seed(cfg))
    sleep_s = cfg.teacher.sleep_per_batch_s
    if sleep_s > 0:
        log.info("synthetic slow teacher: every batch takes at least %g s (teacher.sleep_per_batch_s)", sleep_s)
    batch_fn = SleepingTeacher(targets, sleep_s) if sleep_s > 0 else targets
    if profiler is not None:
        batch_fn = ProfiledBatchFn(batch_fn, profiler)
    timed = TimedBatchFn(batch_fn, copy_s=lambda: targets.to_slots.copy_s)
    return Worker(batch_fn=timed, batch_config=batch_config, **worker_kwargs(cfg))


def run_worker(cfg: DictConfig) -> None:
    """Serve teacher targets until the broker publishes STOP."""
    configure_logging(cfg)
    exit_on_sigterm()
    config = typed_config(cfg)
    profiler = step_profiler(config.profile, run_dir() / PROFILE_DIR, f"worker_{os.getpid()}")
    worker = build_worker(config, profiler)
    log.info("teacher worker ready (%d-byte samples, batches of up to %d); waiting for work from the broker at %s",
             worker.slot_size, worker.max_batch, worker.backend_endpoint)
    writer = TimingWriter(worker.batch_fn.snapshot, run_dir() / f"teacher_time.{os.getpid()}.json").start()
    try:
        worker.run()
    finally:
        writer.stop()
        if profiler is not None:  # a run of fewer batches than the schedule: what was recorded
            profiler.close()
