"""A sweep against a shared broker and worker pool started once: the jobs of
``python -m distill -m mode=student ... hydra/launcher=joblib`` run in parallel, each
as its own run (own run id, leader, model, generation), and end in one summary table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install -e .[sweep]")

from tests.integration.test_app import shared_tiny_cache  # noqa: E402

SWEEP_TIMEOUT_S = 300


def _tiny(tmp_path: Path, sock_dir: Path) -> list[str]:
    return [
        "teacher.tiny.num_layers=2", "teacher.tiny.hidden_size=32", "teacher.tiny.num_heads=2",
        "teacher.tiny.vocab_size=300", "teacher.tiny.train_steps=30", f"teacher.cache_dir={shared_tiny_cache(tmp_path)}",
        "data.seq_len=32", "data.max_heldout_chunks=8", "student.micro_batch_size=4",
        "student.steps_per_stage=6", "student.loader_workers=0", "pipeline.slot_count=8",
        "pipeline.heartbeat_interval_s=0.5", f"pipeline.socket_dir={sock_dir}", "log_level=INFO",
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _serve(mode: str, overrides: list[str], tmp_path: Path) -> subprocess.Popen:
    log = open(tmp_path / f"{mode}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "distill", f"mode={mode}", *overrides,
                             f"hydra.run.dir={tmp_path / mode}"], cwd=tmp_path, env=_env(),
                            stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow  # about 90 s on a busy 2-core machine
@pytest.mark.timeout(SWEEP_TIMEOUT_S + 60)
def test_parallel_sweep_jobs_share_one_broker_and_worker(tmp_path: Path) -> None:
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o700)
    overrides = _tiny(tmp_path, sock_dir)
    servers = [_serve("broker", overrides, tmp_path), _serve("worker", overrides, tmp_path)]
    try:
        cmd = [sys.executable, "-m", "distill", "-m", "mode=student", "replacement=mlp,lowrank",
               "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *overrides,
               f"hydra.sweep.dir={tmp_path / 'sweep'}"]
        started = time.monotonic()
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S,
                                env=_env())
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert all(s.poll() is None for s in servers), "the shared broker or worker died during the sweep"
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    assert len(sorted((tmp_path / "sweep").glob("*/result.json"))) == 2
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "| mlp |" in summary and "| lowrank |" in summary and "val loss by layer" in summary
    runs = set(re.findall(r"run (\S+): model", (tmp_path / "broker.out").read_text()))
    assert len(runs) == 2, f"each job must be its own run on the broker, got {runs}"
    print(f"sweep of 2 jobs took {time.monotonic() - started:.0f}s")
