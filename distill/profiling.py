"""Opt-in traces of where a run's time goes (``profile.enabled=true``, :class:`~distill.config.ProfileConfig`).

A real model's run is hours, and its report says how long each phase took, not why. With
profiling on, every student rank traces a few steps of one stage and every teacher worker a
few of its batches with ``torch.profiler``, on the schedule torchtitan uses (skip ``wait``
steps, warm up for ``warmup``, record ``active``, once), and writes to ``<run dir>/profile/``:

- ``<name>.trace.json``: a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev);
- ``<name>.ops.txt``: the operators that took the most time, as ``key_averages()`` tables them.

After the recorded steps the profiler stops, so the rest of the run runs at full speed.
CUDA kernels are traced too when CUDA is there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from distill.config import ProfileConfig

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"
"""Where in the run directory the traces go."""

OPS_ROWS = 30
"""Rows of the operator table (the costliest by own CPU time)."""


class StepProfiler:
    """``torch.profiler`` over a few steps of a loop: call :meth:`step` after each step and
    :meth:`close` when the loop ends (early or not)."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path, name: str) -> None:
        self.out_dir, self.name = out_dir, name
        self.steps_left = cfg.wait + cfg.warmup + cfg.active
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities, on_trace_ready=self._write,
                                schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1))
        self._profile.start()
        self._running = True

    def step(self) -> None:
        if not self._running:
            return
        self._profile.step()
        self.steps_left -= 1
        if self.steps_left <= 0:  # recorded (the trace is written): the rest runs unprofiled
            self.close()

    def close(self) -> None:
        if self._running:
            self._running = False
            self._profile.stop()

    def _write(self, prof: profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"{self.name}.trace.json"
        prof.export_chrome_trace(str(trace))
        (self.out_dir / f"{self.name}.ops.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=OPS_ROWS) + "\n")
        log.info("profile of %s written to %s (and %s.ops.txt)", self.name, trace, self.name)


def step_profiler(cfg: ProfileConfig, out_dir: Path, name: str) -> StepProfiler | None:
    """A profiler writing ``<out_dir>/<name>.*`` when ``profile.enabled``, else None."""
    return StepProfiler(cfg, out_dir, name) if cfg.enabled else None


class ProfiledBatchFn:
    """A worker's batch function whose calls are the profiler's steps (one step: one batch,
    the deferred copies of the one before included)."""

    def __init__(self, batch_fn: Callable, profiler: StepProfiler) -> None:
        self.batch_fn = batch_fn
        self.profiler = profiler

    def __call__(self, model_id: str, model_cfg: dict | None, targets: list) -> Callable[[], None] | None:
        self.profiler.step()
        return self.batch_fn(model_id, model_cfg, targets)
