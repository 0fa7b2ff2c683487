"""More teachers, more samples, through the application: a ``mode=worker`` added to a running
``mode=local`` job (its run directory's ``add_worker.sh``) gets work, the next stage's figures
in metrics.jsonl show the students fed about twice as fast, the teacher-bound advice that said
so names the script and its figures, and the worker can leave again mid-run.

Real processes (the CLI's supervisor, broker, worker, torchrun student, and the added worker),
real shared memory. The teachers sleep (``teacher.sleep_per_batch_s``): one worker delivers at
most 8 samples per 0.1 s, 80/s, a fifth of what the student takes on 2 loaded cores, so the
run is teacher-bound with one worker and with two, and two deliver twice what one does."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_app import (
    RUN_TIMEOUT_S,
    _cmd,
    _env,
    _run_id,
    _tiny,
    _wait_for,
    _wait_gone,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.alone]

SLEEP_S = 0.1
"""Per batch of up to 8 (``pipeline.worker_max_batch``): 80 samples/s a worker. Each of the 5
stages takes 320 samples (40 steps of 8), 4 s with one worker. The worker is added when stage 0
ends; it starts (imports, teacher, data) in 5-10 s on 2 busy cores, while stages 1-3 train, so
at least the last stage trains with both."""


def _stage_ends(run: Path) -> list[dict]:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [record for line in metrics.read_text().splitlines()
            if (record := json.loads(line))["event"] == "stage_end"]


def test_a_worker_added_to_a_running_job_gets_work_and_the_next_stage_is_fed_faster(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_id = _run_id("appscale")
    overrides = [*_tiny(tmp_path, layers=5), f"run_id={run_id}",
                 "teacher.tiny.train_steps=2",  # its quality does not matter here: built in ~1 s
                 "local.num_workers=1", "local.num_students=1",
                 f"teacher.sleep_per_batch_s={SLEEP_S}", "student.micro_batch_size=8", "pipeline.slot_count=32",
                 "student.steps_per_stage=40", "student.val_every_steps=0", "evaluate=false",
                 f"checkpoint_dir={tmp_path / 'ckpt'}"]
    job = subprocess.Popen(_cmd(overrides, run), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    added = None
    try:
        _wait_for(lambda: len(_stage_ends(run)) >= 1, RUN_TIMEOUT_S, "stage 0's end", job)
        script = run / "add_worker.sh"
        assert script.exists(), "the running job has no add_worker.sh"
        added = subprocess.Popen(["sh", str(script)], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT)

        def fed_by_two() -> bool:
            return any((end["workers_min"] or 0) >= 2 for end in _stage_ends(run)) or added.poll() is not None

        _wait_for(fed_by_two, RUN_TIMEOUT_S, "a stage trained by two workers", job)
        added.send_signal(signal.SIGTERM)  # it leaves mid-run (as Ctrl-C would): the job goes on
        added.wait(timeout=30)
        log, _ = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        for proc in (job, added):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert job.returncode == 0, log[-4000:]
    assert not (run / "add_worker.sh").exists(), "the script outlived the job it joins"
    _wait_gone(run_id)

    ends = _stage_ends(run)
    assert [end["stage"] for end in ends] == [0, 1, 2, 3, 4]
    before, after = ends[0], next(end for end in ends if (end["workers_min"] or 0) >= 2)
    assert before["workers_max"] == 1, before
    assert after["delivered_samples_per_s"] >= 1.6 * before["delivered_samples_per_s"], (before, after)
    mine = json.loads((run / f"teacher_time.{added.pid}.json").read_text())
    assert mine["samples"] >= 80, mine  # the added worker made its share of every stage it fed
    advice = next(line for line in log.splitlines() if "stage 0 was teacher-bound" in line)
    assert "by 1 worker(s)" in advice and "workers_max" in advice, advice
    assert f"sh {run / 'add_worker.sh'} adds one to this running job" in advice, advice
