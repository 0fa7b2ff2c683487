"""The mode=local supervisor's parts, on real child processes: it notices a child's death and
says where its log is, stops everything (STOP, then SIGTERM, then SIGKILL for a child that
ignores SIGTERM), passes the user's overrides on without its own, tells the students their
broker's process, and records the time split."""

from __future__ import annotations

import json
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from distill.config import CONF_DIR, register_configs
from distill.errors import ChildFailed
from distill.modes import local
from distill.pipeline import protocol
from distill.pipeline.observe import send_stop
from distill.pipeline.protocol import Command
from distill.transport import control_client
from tests import peers
from tests.unit.test_config import _compose

SLEEPER = "import time; time.sleep(60)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


@pytest.fixture
def children() -> Iterator[list[local.Child]]:
    made: list[local.Child] = []
    yield made
    for child in made:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def _child(children: list[local.Child], name: str, code: str, log_path: Path | None = None) -> local.Child:
    stdout = open(log_path, "w") if log_path else subprocess.PIPE  # noqa: SIM115 - closed with the process
    child = local.Child(name, subprocess.Popen([sys.executable, "-c", code], stdout=stdout, text=True), log_path)
    children.append(child)
    return child


def test_students_finishing_ends_the_wait(children) -> None:
    broker = _child(children, "broker", SLEEPER)
    students = _child(children, "students", "pass")
    started = time.monotonic()
    local._wait_for_students([broker, students])
    assert time.monotonic() - started < 5 and broker.proc.poll() is None


def test_a_dead_child_stops_the_wait_naming_it_its_last_error_and_its_log(children, tmp_path: Path) -> None:
    log_path = tmp_path / "worker0.out"
    code = "print('ValueError: teacher failed to load'); print('exiting'); raise SystemExit(3)"
    worker = _child(children, "worker0", code, log_path)
    students = _child(children, "students", SLEEPER)
    with pytest.raises(ChildFailed) as failed:
        local._wait_for_students([worker, students])
    assert str(failed.value) == ("worker0 exited with code 3; last error line: 'ValueError: teacher failed to load'; "
                                 f"full log: {log_path}")


def test_a_failing_student_run_is_an_error_too(children) -> None:
    students = _child(children, "students", "raise SystemExit(1)")
    with pytest.raises(ChildFailed, match="students exited with code 1"):
        local._wait_for_students([students])


def test_stop_all_publishes_stop_then_terminates_then_kills(children, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(local, "TERMINATE_GRACE_S", 1.0)
    control = f"ipc://{tmp_path}/control.sock"
    router = protocol.configure(zmq.Context.instance().socket(zmq.ROUTER))
    router.bind(control)
    polite = _child(children, "worker0", SLEEPER)
    stubborn = _child(children, "worker1", STUBBORN)
    assert stubborn.proc.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    started = time.monotonic()
    local._stop_all([polite, stubborn], control)
    assert polite.proc.returncode == -15 and stubborn.proc.returncode == -9
    assert time.monotonic() - started < 8
    assert router.poll(2000), "no STOP reached the broker's control socket"
    _, message = protocol.recv_routed(router)
    assert message.command == Command.STOP
    router.close(linger=0)


def test_stop_all_of_finished_children_sends_nothing(children, tmp_path: Path) -> None:
    done = _child(children, "students", "pass")
    done.proc.wait()
    local._stop_all([done], f"ipc://{tmp_path}/nobody.sock")  # no broker: nothing to tell, no hang


def test_children_get_the_user_overrides_but_not_the_supervisor_s_own(tmp_path: Path) -> None:
    register_configs()
    user = ["mode=local", "replacement=mlp", "student.lr=0.01", "run_id=mine", f"hydra.run.dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=user, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        out = local._child_overrides("run7", "/sock/dir", tmp_path / "run")
    finally:
        HydraConfig.instance().cfg = None
    assert out[:2] == ["replacement=mlp", "student.lr=0.01"]
    assert out[2:] == ["run_id=run7", "pipeline.socket_dir=/sock/dir", f"hydra.run.dir={tmp_path / 'run'}",
                       "hydra.output_subdir=null"]


def test_the_supervisor_s_own_broker_pid_replaces_the_user_s(tmp_path: Path) -> None:
    register_configs()
    user = ["mode=local", "pipeline.broker_pid=1", f"hydra.run.dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=user, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        out = local._child_overrides("run7", "/sock/dir", tmp_path / "run")
    finally:
        HydraConfig.instance().cfg = None
    assert not [o for o in out if o.startswith("pipeline.broker_pid=")]


def test_the_students_wait_on_their_broker_s_process(children, tmp_path: Path) -> None:
    """The students' command names the broker's process, and their control client (built from
    the composed config, as mode=student builds it) waits while it runs and fails at once,
    naming it, when it has exited."""
    broker = _child(children, "broker", SLEEPER)
    overrides = local._student_overrides(broker)
    assert overrides == [f"pipeline.broker_pid={broker.proc.pid}"]
    cfg = _compose(["mode=student", *overrides, f"pipeline.socket_dir={tmp_path}"])
    client = control_client(cfg, 0, peers.batch_config())
    try:
        assert client.config.broker_wait_s == cfg.pipeline.broker_wait_s == 600
        assert client._pool.patience.broker_runs() is True
        broker.proc.kill()
        broker.proc.wait()
        started = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"HELLO .*\(pid {broker.proc.pid}\) has exited"):
            client.hello()
        assert time.monotonic() - started < 2
    finally:
        client.close()


def test_add_worker_sh_is_the_jobs_own_worker_command(tmp_path: Path) -> None:
    """add_worker.sh starts mode=worker with the job's overrides (quoted: a socket dir with a
    space stays one argument), then the user's; only the user may run it."""
    script = tmp_path / "add_worker.sh"
    common = ["replacement=mlp", "run_id=run7", "pipeline.socket_dir=/sock dir/x", f"hydra.run.dir={tmp_path}"]
    local._write_add_worker(script, common)
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    argv = shlex.split(script.read_text().splitlines()[-1])
    assert argv[:2] == ['OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}', "exec"]
    assert argv[2:] == [sys.executable, "-m", "distill", "mode=worker", *common, "hydra.job.name=worker_added", "$@"]


def test_the_private_socket_dir_is_ours_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory = Path(local._private_socket_dir("abc123"))
    assert directory.name.startswith("abc123-") and directory.is_dir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_the_time_split_lands_in_result_json_and_report_md(children, tmp_path: Path) -> None:
    (tmp_path / "result.json").write_text(json.dumps({"summary": {}, "timings": {
        "student_compute_s": 6.0, "student_wait_s": 1.0, "student_start_s": 2.0}}))
    (tmp_path / "report.md").write_text("# Distillation report\n\n## Time\n\n| phase | seconds | share |\n"
                                        "| --- | --- | --- |\n| student_compute | 6.0 | 67% |\n\n## Losses\n")
    (tmp_path / "teacher_time.1.json").write_text(json.dumps({"teacher_s": 4.0, "copy_s": 0.5}))
    broker = _child(children, "broker", SLEEPER)
    local._report_time_split(tmp_path, broker, wall_s=10.0, num_workers=1)
    split = json.loads((tmp_path / "result.json").read_text())["time_split"]
    assert split["wall_s"] == 10.0 and split["student compute"] == 6.0
    assert split["teacher forward (mean per worker)"] == 4.0
    other = "student other (launching the student processes, barriers, tearing the run down)"
    assert split[other] == pytest.approx(1.0)
    report = (tmp_path / "report.md").read_text()
    assert "## Where the time went" in report and "| student compute | 6.0 | 60% |" in report
    assert "## Time\n" not in report and report.count(" | seconds | ") == 1  # one time table, the wall time's
    assert report.index("## Where the time went") < report.index("## Losses")


def test_the_supervisor_starts_without_transformers_or_matplotlib() -> None:
    """Every mode=local job starts its supervisor first; the models and the report's plots are
    the children's business (about 3 s of imports a job, in a test suite of 20 jobs)."""
    code = ("import sys, distill.modes.local, distill.modes.checks; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'matplotlib', 'tokenizers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(120)
def test_the_supervisor_stops_the_workers_of_a_led_run_with_the_jobs_secret(procs, tmp_path: Path) -> None:
    """The run's leader (built from the composed config, as mode=student builds it) and the
    supervisor read one secret from the job's socket directory: the supervisor's STOP
    reaches the worker, where a STOP without it is refused; a restarted leader of the same
    job leads the run again at once."""
    socket_dir = tmp_path / "sock"
    secret = local.run_secret(socket_dir, "ledrun")
    cfg = _compose(["mode=student", "run_id=ledrun", f"pipeline.socket_dir={socket_dir}",
                    "pipeline.heartbeat_interval_s=0.2"])
    endpoints = {name: local.default_endpoint(name, socket_dir) for name in ("frontend", "backend", "control",
                                                                             "control_pub")}
    procs.start(peers.run_broker, endpoints, name="broker")
    worker = procs.start(peers.run_worker, endpoints, name="worker")
    leader = control_client(cfg, 0, peers.batch_config())
    try:
        assert leader.leader_secret == secret
        leader.hello()
        generation = leader.set_model("m")
    finally:
        leader.close()
    restarted = control_client(cfg, 0, peers.batch_config())
    try:
        assert restarted.set_model("m2") == generation + 1  # not refused as a stranger
    finally:
        restarted.close()
    send_stop(endpoints["control"])  # no secret: refused, the worker serves on
    worker.join(2)
    assert worker.is_alive()
    send_stop(endpoints["control"], leader_secret=secret)
    worker.join(30)
    assert worker.exitcode == 0
