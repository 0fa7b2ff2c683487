"""Opt-in profiling: a few steps traced on torchtitan's schedule, written once, then off."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distill.config import ProfileConfig
from distill.profiling import ProfiledBatchFn, StepProfiler, step_profiler


def _steps_in(trace: Path) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


def test_the_active_steps_are_recorded_then_the_profiler_stops(tmp_path: Path) -> None:
    profiler = StepProfiler(ProfileConfig(enabled=True, wait=1, warmup=1, active=2), tmp_path, "loop")
    for _ in range(6):
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.step()
    profiler.close()
    assert _steps_in(tmp_path / "loop.trace.json") == ["ProfilerStep#2", "ProfilerStep#3"]  # after wait + warmup
    assert "aten::mm" in (tmp_path / "loop.ops.txt").read_text()
    assert profiler.steps_left <= 0 and not profiler._running


def test_a_loop_shorter_than_the_schedule_still_writes_what_it_recorded(tmp_path: Path) -> None:
    profiler = StepProfiler(ProfileConfig(enabled=True, wait=0, warmup=0, active=5), tmp_path, "short")
    torch.randn(8, 8) @ torch.randn(8, 8)
    profiler.step()
    profiler.close()
    assert (tmp_path / "short.trace.json").exists()


def test_off_by_default_and_each_batch_is_a_step(tmp_path: Path) -> None:
    assert step_profiler(ProfileConfig(), tmp_path, "x") is None
    profiler = StepProfiler(ProfileConfig(enabled=True, wait=0, warmup=0, active=1), tmp_path, "worker")
    seen = []
    batch_fn = ProfiledBatchFn(lambda model_id, cfg, targets: seen.append(len(targets)), profiler)
    batch_fn("m", None, [1, 2])
    batch_fn("m", None, [3])
    assert seen == [2, 1] and (tmp_path / "worker.trace.json").exists()
