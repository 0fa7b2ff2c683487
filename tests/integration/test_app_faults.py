"""Faults in a real distillation run, each part started by hand as a user would:
``python -m distill mode=broker``, ``mode=worker`` and the students (``torchrun ...
mode=student``) as separate processes on one socket directory.

- the broker SIGKILLed and started again mid-stage: the run finishes with every stage
  and every step of the config;
- one DDP rank SIGKILLed: the run stops (no hang on a gloo collective), the broker drops
  the dead peers' requests, the dead rank's shared memory is swept, and rerunning the
  student command resumes from the last checkpoint;
- a DataLoader worker of a rank SIGKILLed: the student stops with a clear error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from distill.pipeline.endpoints import default_endpoint, runtime_dir
from distill.pipeline.mediums.shm import list_segments, sweep_orphans
from distill.pipeline.observe import fetch_stats

LAYERS = 2
TEACHER = {"hidden_size": 32, "num_layers": LAYERS, "num_heads": 2, "vocab_size": 300, "train_steps": 2}
SEQ_LEN = 32
HEARTBEAT_S = 0.5
START_TIMEOUT_S = 120
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def teacher_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny teacher, built once here so that no child process waits on its training."""
    from distill.model.tiny_cache import tiny_teacher_dir

    cache = tmp_path_factory.mktemp("teacher")
    tiny_teacher_dir(str(cache), seq_len=SEQ_LEN, **TEACHER)
    return cache


class App:
    """One run's processes, each in its own session so a test can clean up whole trees."""

    def __init__(self, tmp_path: Path, run_id: str, teacher_cache: Path) -> None:
        self.tmp_path = tmp_path
        self.run_id = run_id
        self.socket_dir = tempfile.mkdtemp(prefix=f"{run_id}-", dir=_private_runtime_dir())
        self.run_dir = tmp_path / "run"
        self.checkpoint_dir = tmp_path / "ckpt"
        self.teacher_cache = teacher_cache
        self.procs: list[subprocess.Popen] = []

    def overrides(self, *extra: str) -> list[str]:
        tiny = [f"teacher.tiny.{key}={value}" for key, value in TEACHER.items()]
        return [*tiny, f"teacher.cache_dir={self.teacher_cache}", f"data.seq_len={SEQ_LEN}",
                "data.max_heldout_chunks=4", "student.micro_batch_size=4", "student.log_every_steps=1",
                "pipeline.slot_count=8", "pipeline.worker_max_batch=4",
                f"pipeline.heartbeat_interval_s={HEARTBEAT_S}", "evaluate=false", "log_level=INFO",
                "student.e2e.steps=0",
                f"run_id={self.run_id}", f"pipeline.socket_dir={self.socket_dir}",
                f"checkpoint_dir={self.checkpoint_dir}", f"hydra.run.dir={self.run_dir}",
                "hydra.output_subdir=null", *extra]

    def start(self, name: str, mode: str, *extra: str, ranks: int | None = None) -> subprocess.Popen:
        """``python -m distill mode=<mode>`` (under torchrun when ``ranks``); output in <name>.out."""
        launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--standalone",
                                             f"--nproc_per_node={ranks}"]
        cmd = [sys.executable, *launcher, "-m", "distill", f"mode={mode}",
               *self.overrides(f"hydra.job.name={name}", *extra)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.tmp_path / f"{name}.out", "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.tmp_path,
                                    start_new_session=True)
        proc.name = name
        self.procs.append(proc)
        return proc

    def start_broker(self, name: str = "broker") -> subprocess.Popen:
        proc = self.start(name, "broker")
        frontend = default_endpoint("frontend", self.socket_dir)
        _wait_for(lambda: fetch_stats(frontend, timeout_ms=500) is not None, START_TIMEOUT_S,
                  f"{name} to answer STATS", [proc], self)
        return proc

    def stats(self) -> dict | None:
        return fetch_stats(default_endpoint("frontend", self.socket_dir), timeout_ms=2000)

    def output(self, name: str) -> str:
        return (self.tmp_path / f"{name}.out").read_text(errors="replace")

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait(self, proc: subprocess.Popen, timeout_s: float) -> int:
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.name} did not exit in {timeout_s}s:\n{self.output(proc.name)[-4000:]}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        _wait_gone(self.run_id)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _private_runtime_dir() -> Path:
    base = runtime_dir()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


@pytest.fixture
def app_factory(tmp_path: Path, teacher_cache: Path) -> Iterator[Callable[[str], App]]:
    apps: list[App] = []

    def make(prefix: str) -> App:
        # The pid keeps runs of this test in other checkouts on the machine apart
        # (processes are told apart by the run id on their command line).
        apps.append(App(tmp_path, f"{prefix}{os.getpid()}", teacher_cache))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


# ---------------------------------------------------------------------- helpers
def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, watched: list[subprocess.Popen],
              app: App) -> None:
    """Poll ``predicate``; fail early, with the log, when a watched process exits."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for proc in watched:
            if proc.poll() is not None:
                pytest.fail(f"{proc.name} exited ({proc.returncode}) before {what}:\n"
                            f"{app.output(proc.name)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ranks(torchrun: subprocess.Popen) -> dict[int, int]:
    """{local rank: pid} of the rank processes torchrun started."""
    ranks = {}
    for pid in _children(torchrun.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(b"LOCAL_RANK="):
                ranks[int(entry.split(b"=", 1)[1])] = pid
    return ranks


def _wait_gone(marker: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
                    and f"run_id={marker} " in _cmdline(int(p.name))]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of run {marker} still running: {left}"


def _train_steps(metrics: list[dict], stage: int) -> list[int]:
    return [m["step"] for m in metrics if m["event"] == "train" and m["stage"] == stage]


def _assert_every_stage_and_step(app: App, steps_per_stage: int, stages: range) -> None:
    """The run reached every stage's last step, each step logged once and in order."""
    metrics = app.metrics()
    ends = {m["stage"]: m["steps"] for m in metrics if m["event"] == "stage_end"}
    assert ends == dict.fromkeys(stages, steps_per_stage), ends
    for stage in stages:
        steps = _train_steps(metrics, stage)
        assert steps == sorted(set(steps)) and steps[-1] == steps_per_stage, (stage, steps)
    progress = json.loads((app.checkpoint_dir / "progress.json").read_text())
    assert progress["finished"] == list(range(LAYERS))


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
def test_broker_killed_and_restarted_mid_stage_the_run_finishes(app_factory) -> None:
    app = app_factory("afbroker")
    steps = 40
    broker = app.start_broker()
    for i in range(2):
        app.start(f"worker{i}", "worker")
    students = app.start("students", "student", f"student.steps_per_stage={steps}",
                         "student.checkpoint_every_steps=1000", ranks=2)
    _wait_for(lambda: _train_steps(app.metrics(), 0), START_TIMEOUT_S, "training in stage 0",
              [students, broker], app)
    os.kill(broker.pid, signal.SIGKILL)
    killed_at = app.metrics()
    app.wait(broker, 10)
    app.start_broker("broker2")
    code = app.wait(students, RUN_TIMEOUT_S)
    log = app.output("students")
    assert code == 0, log[-4000:]
    assert not any(m["event"] == "stage_end" and m["stage"] == LAYERS - 1 for m in killed_at), \
        "the run was over before the broker was killed"
    assert "restoring model" in log  # the leader put its stage back on the new broker
    _assert_every_stage_and_step(app, steps, range(LAYERS))


@pytest.mark.timeout(300)
def test_ddp_rank_killed_run_stops_then_resumes(app_factory) -> None:
    app = app_factory("afrank")
    steps = 60
    app.start_broker()
    app.start("worker0", "worker")
    extra = (f"student.steps_per_stage={steps}", "student.checkpoint_every_steps=10")
    students = app.start("students", "student", *extra, ranks=2)
    state = app.checkpoint_dir / "current" / "state.json"
    _wait_for(state.exists, START_TIMEOUT_S, "a checkpoint", [students], app)
    ranks = _ranks(students)
    assert set(ranks) == {0, 1}, ranks
    dead = [ranks[1], *_children(ranks[1])]  # the rank and its DataLoader worker: slots in both
    os.kill(ranks[1], signal.SIGKILL)
    code = app.wait(students, 120)  # torchrun tears rank 0 down; nobody hangs on a collective
    assert code != 0
    killed_at = json.loads(state.read_text())

    def dropped() -> bool:  # the broker forgot every peer of the dead run, and its requests
        stats = app.stats()
        return stats is not None and stats["students"] == 0 and stats["queued"] == 0

    _wait_for(dropped, 30, "the broker to drop the dead students", [], app)

    rerun = app.start("rerun", "student", *extra, ranks=2)
    assert app.wait(rerun, RUN_TIMEOUT_S) == 0, app.output("rerun")[-4000:]
    log = app.output("rerun")
    assert f"stage {killed_at['stage']}: resumed at step {killed_at['step']}" in log, log[-4000:]
    assert killed_at["step"] > 0
    left = [name for name in list_segments() if any(f"_{pid}_" in name for pid in dead)]
    assert not left, f"the dead rank's shared memory was not swept: {left}"
    metrics = app.metrics()
    ends = {m["stage"]: m["steps"] for m in metrics if m["event"] == "stage_end"}
    assert ends == dict.fromkeys(range(killed_at["stage"], LAYERS), steps), ends


@pytest.mark.timeout(240)
def test_dataloader_worker_killed_the_student_stops_with_a_clear_error(app_factory) -> None:
    app = app_factory("afloader")
    app.start_broker()
    app.start("worker0", "worker")
    student = app.start("student", "student", "student.steps_per_stage=100000",
                        "student.checkpoint_every_steps=100000", "student.loader_workers=1")
    _wait_for(lambda: _train_steps(app.metrics(), 0), START_TIMEOUT_S, "training", [student], app)
    loaders = _children(student.pid)
    assert len(loaders) == 1, f"expected one DataLoader worker under the student, found {loaders}"
    os.kill(loaders[0], signal.SIGKILL)
    code = app.wait(student, 60)
    log = app.output("student")
    assert code != 0
    assert f"DataLoader worker (pid {loaders[0]}) is killed by signal" in log \
        or f"DataLoader worker (pid(s) {loaders[0]}) exited unexpectedly" in log, log[-4000:]
    # The killed worker could not unlink its slots, but its lock died with it: the
    # owner-lock sweep of the next start (here called directly; any process of this
    # project starting on the machine may have run it already) removes them.
    sweep_orphans(min_age_s=0)
    left = [name for name in list_segments() if f"_{loaders[0]}_" in name]
    assert not left, f"the killed DataLoader worker's shared memory survived the sweep: {left}"
