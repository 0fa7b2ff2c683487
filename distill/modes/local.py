"""mode=local: broker, teacher workers and DDP students on one machine, in one command.

The children are the same commands a user would start by hand (``python -m distill
mode=broker``, ``mode=worker``, ``torchrun ... mode=student``; a single student rank
runs ``mode=student`` with torchrun's environment but without the launcher) with this job's
overrides plus a run id, a private socket directory and this job's run directory,
so a sweep's jobs never share sockets or shared memory. While the job runs, its run
directory holds ``add_worker.sh``: the same worker command, so more teachers can join
the running job (``sh <run dir>/add_worker.sh device.worker_gpu=3``; they get work
within a heartbeat, and stop with the job), and its log prints the ``mode=stats`` command
that reaches the job's broker in that private directory. The children start together; the students
are told the broker's process (``pipeline.broker_pid``), so they wait for a broker that is
still starting (it may take minutes on a loaded machine) and fail at once if it exits.
The supervisor waits for the students; on success, Ctrl-C, SIGTERM, or any child
dying, it stops every child, and the kernel stops them too if the supervisor itself is
killed (PR_SET_PDEATHSIG). The children have their own process group, so a terminal's
Ctrl-C reaches the supervisor alone, which stops them in order; the students' stderr is
relayed to ours and kept in ``students.err``, and muted once they are being stopped. A
child that fails is reported in one line (``ChildFailed``): its name, its last error line, its log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from distill.config import typed_config
from distill.errors import ChildFailed
from distill.model.location import teacher_source
from distill.modes.placement import plan_local
from distill.modes.process import (
    configure_logging,
    die_with_parent,
    exit_on_sigterm,
    record_config,
    run_dir,
)
from distill.modes.stats import stats_command
from distill.pipeline.auth import CurveConfig
from distill.pipeline.endpoints import default_endpoint, runtime_dir
from distill.pipeline.leadership import run_secret
from distill.pipeline.mediums.shm import new_run_id, sweep_orphans
from distill.pipeline.observe import send_stop
from distill.results.record import add_time_split, read_result
from distill.results.report_file import TIME_HEADING, replace_section
from distill.train.checkpoint import checkpoint_dir, hold_checkpoint_dir
from distill.train.timing import cpu_seconds, format_time_split, read_teacher_times, time_split
from distill.transport import ADD_WORKER_SCRIPT, curve_config, endpoints

log = logging.getLogger(__name__)

POLL_S = 0.5
TERMINATE_GRACE_S = 10.0
RELAY_CHUNK_BYTES = 65536
RELAY_DRAIN_S = 5.0
"""How long the students' stderr may take to drain into its log once torchrun has exited."""
ERROR_LINE = re.compile(r"^\w+(\.\w+)*(Error|Exception|Exit)\b|\]\[(ERROR|CRITICAL)\]")
"""A traceback's last line (``ValueError: ...``) or an ERROR record of our log format."""
OWN_KEYS = ("mode=", "run_id=", "pipeline.socket_dir=", "hydra.run.dir=", "hydra.output_subdir=",
            "hydra.job.name=", "device.student_gpus=", "pipeline.broker_pid=")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path | None
    relay: StderrRelay | None = None


class StderrRelay(threading.Thread):
    """Copies a child's stderr to ours (its progress bars) and to its log; once muted, to the
    log only: torchrun's traceback when we stop it (SIGTERM) goes to the file, not the screen."""

    def __init__(self, pipe: IO[bytes], log_path: Path) -> None:
        super().__init__(name=f"relay {log_path.name}", daemon=True)
        self._pipe, self._log_path, self.muted = pipe, log_path, threading.Event()

    def run(self) -> None:
        with self._pipe, open(self._log_path, "wb") as log_file:
            while chunk := os.read(self._pipe.fileno(), RELAY_CHUNK_BYTES):
                log_file.write(chunk)
                log_file.flush()
                if not self.muted.is_set():
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()


def run_local(cfg: DictConfig) -> None:
    """Start everything, wait for the students, tear everything down."""
    configure_logging(cfg)
    exit_on_sigterm()
    run_id = cfg.run_id or new_run_id()
    config = typed_config(cfg)
    source = teacher_source(config)  # builds the tiny teacher (or converts a GGUF one) once, before any child needs it
    claim = hold_checkpoint_dir(checkpoint_dir(config, source))  # a second run with the same settings stops here
    record_config(cfg)  # once the run is ours (distill.__main__.CLAIMING_MODES)
    out = run_dir()
    out.mkdir(parents=True, exist_ok=True)
    log.info("run %s: teacher %s, %d worker(s), %d student rank(s); run dir %s", run_id, source,
             cfg.local.num_workers, cfg.local.num_students, out)
    placement = plan_local(config, torch.cuda.device_count())  # checked at start-up already
    if placement.worker_gpus or placement.student_gpus:
        log.info("placement: %s", placement.describe())
    socket_dir = _private_socket_dir(run_id)
    secret = run_secret(Path(socket_dir), run_id)  # the students' leader reads it (transport.py)
    common = _child_overrides(run_id, socket_dir, out)
    student_gpus = [f"device.student_gpus=[{','.join(map(str, placement.student_gpus))}]"] \
        if placement.student_gpus else []
    children: list[Child] = []
    started = time.monotonic()
    add_worker = out / ADD_WORKER_SCRIPT
    try:
        broker = _spawn("broker", ["mode=broker", *common, "hydra.job.name=broker"], out)
        children.append(broker)
        _write_add_worker(add_worker, common)
        log.info("this run's broker counters: %s", stats_command(cfg, socket_dir))
        for i in range(cfg.local.num_workers):
            children.append(_spawn(f"worker{i}", ["mode=worker", *common, f"hydra.job.name=worker{i}"], out))
        children.append(_spawn("students", ["mode=student", *common, *student_gpus, *_student_overrides(broker),
                                            "hydra.job.name=student"], out, torchrun_ranks=cfg.local.num_students))
        _wait_for_students(children)
        _report_time_split(out, children[0], time.monotonic() - started, cfg.local.num_workers)
        log.info("run %s finished in %.0fs; results in %s", run_id, time.monotonic() - started, out)
    finally:
        add_worker.unlink(missing_ok=True)  # the job's sockets go now
        control = (endpoints(config)["control"] if config.pipeline.broker_host
                   else default_endpoint("control", socket_dir))
        _stop_all(children, control, curve_config(config), secret)
        shutil.rmtree(socket_dir, ignore_errors=True)
        sweep_orphans(min_age_s=0)
        claim.close()  # the next run of these settings may start


def _write_add_worker(path: Path, common: list[str]) -> None:
    """Write the command that adds a teacher worker to this running job, and log it.

    Why a file: the job's sockets are in a private directory named at random, and a worker
    must compute the stages the students train from the same settings, so the one command
    that joins is this job's own worker command. Extra overrides (a GPU) are appended;
    Hydra takes the last value of a key. The worker writes its teacher time into the run
    directory like the job's own workers, so the run's time split counts it."""
    command = [sys.executable, "-m", "distill", "mode=worker", *common, "hydra.job.name=worker_added"]
    path.write_text("#!/bin/sh\n# Adds a teacher worker to this running job (it stops with the job):\n"
                    f"#   sh {shlex.quote(str(path))} [overrides, e.g. device.worker_gpu=1]\n"
                    f'OMP_NUM_THREADS="${{OMP_NUM_THREADS:-1}}" exec {shlex.join(command)} "$@"\n')
    path.chmod(0o700)
    log.info("add a teacher worker to this job: sh %s [overrides]", path)


def _report_time_split(out: Path, broker: Child, wall_s: float, num_workers: int) -> None:
    """Log where the run's time went and add it to the results (see distill.train.timing)."""
    student = (read_result(out) or {}).get("timings", {})
    teachers = read_teacher_times(out)  # the job's workers and any added to it
    rows = time_split(wall_s, student, teachers, cpu_seconds(broker.proc.pid))
    table = format_time_split(rows, wall_s, max(num_workers, len(teachers)))
    log.info("where the time went:\n%s", table)
    replace_section(str(out), TIME_HEADING, table)
    add_time_split(out, wall_s, rows)


def _private_socket_dir(run_id: str) -> str:
    base = runtime_dir()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{run_id}-", dir=base)  # 0700, short enough for ipc paths


def _child_overrides(run_id: str, socket_dir: str, out: Path) -> list[str]:
    task = [o for o in HydraConfig.get().overrides.task if not o.startswith(OWN_KEYS)]
    return [*task, f"run_id={run_id}", f"pipeline.socket_dir={socket_dir}", f"hydra.run.dir={out}",
            "hydra.output_subdir=null"]


def _student_overrides(broker: Child) -> list[str]:
    """What the students are told of their broker: its process. It starts beside them and may
    take minutes before it serves (it imports torch, on a machine every child is loading at
    once); the students wait for it while it runs, up to ``pipeline.broker_wait_s``, and
    fail at once if it exits (its log is tailed here, ``_wait_for_students``)."""
    return [f"pipeline.broker_pid={broker.proc.pid}"]


SINGLE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
"""What torchrun would tell a job's only student rank: started without it, the rank is spared
torchrun's own interpreter, its torch import and its rendezvous (about 2 s of CPU before the
rank itself starts), and ignores any RANK/WORLD_SIZE of the user's shell."""


def _spawn(name: str, overrides: list[str], out: Path, torchrun_ranks: int | None = None) -> Child:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if torchrun_ranks is None:
        cmd = [sys.executable, "-m", "distill", *overrides]
        log_path = out / f"{name}.out"
        stdout = open(log_path, "w")  # noqa: SIM115 - closed when the child is reaped
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_ranks}"]
        if torchrun_ranks == 1:  # one rank needs no launcher (nor a process group): its environment only
            launcher = []
            env.update(SINGLE_RANK_ENV)
        cmd = [sys.executable, *launcher, "-m", "distill", *overrides]
        log_path, stdout = out / f"{name}.err", None  # students print progress to our terminal, via a relay
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout else subprocess.PIPE, env=env,
                            preexec_fn=_child_setup)
    relay = None
    if stdout is None:
        relay = StderrRelay(proc.stderr, log_path)
        relay.start()
    log.info("started %s (pid %d)", name, proc.pid)
    return Child(name, proc, log_path, relay)


def _child_setup() -> None:
    """In the child before exec: die with us (the kernel sends SIGTERM), and leave the terminal's
    Ctrl-C to us (its own process group): we stop every child in order and print one line."""
    die_with_parent()
    os.setpgid(0, 0)


def _wait_for_students(children: list[Child]) -> None:
    students = children[-1]
    while True:
        for child in children:
            code = child.proc.poll()
            if code is None:
                continue
            if child is students and code == 0:
                return
            raise ChildFailed(_failure(child, code))
        with contextlib.suppress(subprocess.TimeoutExpired):  # back at once when the students end
            students.proc.wait(timeout=POLL_S)


def _failure(child: Child, code: int) -> str:
    """One line: which process, how it ended, its last error line and where its whole log is."""
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if child.relay is not None:
        child.relay.join(timeout=RELAY_DRAIN_S)  # its last words are in the log
    if child.log_path is None:
        return f"{child.name} {how}"
    return f"{child.name} {how}; last error line: {_last_error_line(child.log_path)!r}; full log: {child.log_path}"


def _last_error_line(log_path: Path) -> str:
    """The last line that reads like an error (a traceback's last line, an ERROR log), else the last line."""
    if not log_path.exists():
        return ""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return (errors or lines or [""])[-1]


def _stop_all(children: list[Child], control_endpoint: str, curve: CurveConfig | None = None,
              secret: str | None = None) -> None:
    """Ask workers to stop (STOP, with the run's leader ``secret``: the broker refuses a STOP
    of a led run without it), then SIGTERM what is left, then SIGKILL after a grace period."""
    for child in children:
        if child.relay is not None:
            child.relay.muted.set()  # what a stopped child says is in its log, not on the screen
    if any(c.proc.poll() is None for c in children):
        send_stop(control_endpoint, curve.client_keys() if curve is not None else None, secret)
        # (not sent: no broker, or a refused key; the children get SIGTERM next anyway)
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs: killing it", child.name, TERMINATE_GRACE_S)
            child.proc.kill()
            child.proc.wait()
        if child.relay is not None:
            child.relay.join(timeout=RELAY_DRAIN_S)
