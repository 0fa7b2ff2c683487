"""``python -m distill mode=stats`` finds the run (issue 39 item 5), on real processes: a broker's
log prints the stats command that reaches it, that command run as printed prints the broker's
counters, and against no broker mode=stats says which endpoint it waited for, in one line, and
exits nonzero within ``stats_wait_s`` instead of looping silently."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.errors import BrokerNotFound
from distill.modes import stats
from distill.pipeline import Broker
from distill.transport import endpoints as config_endpoints
from tests.unit.test_config import _compose

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT_S = 60.0
"""A broker process imports torch; on a loaded machine that takes a while."""
STATS_COMMAND = re.compile(r"this broker's counters: (.+)$", re.MULTILINE)


def _distill(args: list[str], cwd: Path, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "distill", *args], cwd=cwd, env=env, text=True,
                            start_new_session=True, **kwargs)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _printed_stats_command(log_path: Path, broker: subprocess.Popen) -> list[str]:
    """The stats command the broker's log prints, once it has printed it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (found := STATS_COMMAND.search(log_path.read_text(errors="replace"))):
        assert broker.poll() is None, f"the broker exited:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"no stats command in the broker's log:\n{log_path.read_text()}"
        time.sleep(0.2)
    return shlex.split(found.group(1))


def _counters_line(command: list[str], cwd: Path, timeout_s: float = START_TIMEOUT_S) -> str:
    """Run ``command`` (mode=stats) until it prints a line of counters; that line."""
    proc = _distill(command[3:], cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("workers="):
                return line
            assert time.monotonic() < deadline, "".join(seen)
        pytest.fail(f"mode=stats ended (code {proc.wait()}) without counters:\n{''.join(seen)}")
    finally:
        _stop(proc)


def test_the_broker_s_log_prints_a_stats_command_that_reaches_it(tmp_path: Path) -> None:
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o700)
    log_path = tmp_path / "broker.out"
    with open(log_path, "w") as out:
        broker = _distill(["mode=broker", f"pipeline.socket_dir={sock_dir}", f"hydra.run.dir={tmp_path / 'run'}"],
                          tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        command = _printed_stats_command(log_path, broker)
        assert command[:4] == [sys.executable, "-m", "distill", "mode=stats"]
        assert f"pipeline.socket_dir={sock_dir}" in command
        line = _counters_line(command, tmp_path)
        for column in stats.STATS_COLUMNS:
            assert f"{column}=" in line
        assert "workers=0" in line and "students=0" in line
    finally:
        _stop(broker)


def test_against_no_broker_one_line_names_the_endpoint_and_the_exit_code_is_nonzero(tmp_path: Path) -> None:
    sock_dir = tmp_path / "nobody"
    sock_dir.mkdir(mode=0o700)
    started = time.monotonic()
    proc = _distill(["mode=stats", f"pipeline.socket_dir={sock_dir}", "stats_wait_s=1", "stats_interval_s=0.2"],
                    tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
    finally:
        _stop(proc)
    assert proc.returncode == BrokerNotFound.exit_code != 0, err
    lines = [line for line in err.splitlines() if line.strip() and "][INFO]" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"no broker answered at ipc://{sock_dir}/frontend.sock in 1s")
    assert "workers=" not in out
    assert time.monotonic() - started < START_TIMEOUT_S


def test_mode_local_s_stats_command_reaches_the_broker_in_its_private_directory(tmp_path: Path) -> None:
    """The supervisor logs ``stats_command(cfg, <its private socket dir>)``: composed from a
    mode=local config, it names that directory, not the user's, and reaches a broker there."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    cfg = _compose(["mode=local"])
    command = shlex.split(stats.stats_command(cfg, str(private)))
    assert f"pipeline.socket_dir={private}" in command
    broker_cfg = _compose(["mode=broker", *command[4:]])
    broker = Broker(**{f"{name}_endpoint": ep for name, ep in config_endpoints(broker_cfg).items()}).start()
    try:
        assert _counters_line(command, tmp_path).startswith("workers=0")
    finally:
        broker.stop()
