"""A user's mistake in a subprocess of the CLI: one line on stderr naming the key and the fix,
exit code 2, no traceback and no process started; the traceback on request."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.errors import ConfigError
from tests.integration.test_app import _tiny

CLI_TIMEOUT_S = 60


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distill", *args, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=dict(os.environ, **env))


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The whole stderr is one line, and the exit code that of a config error."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.returncode == ConfigError.exit_code, result.stderr
    return lines[0]


def test_unknown_key_suggests_the_schema_s_key(tmp_path: Path) -> None:
    line = _one_line(_run(["student.stepz_per_stage=5"], tmp_path))
    assert line == "unknown key student.stepz_per_stage: did you mean student.steps_per_stage?"
    assert not (tmp_path / "run").exists()  # refused before Hydra made a run directory


def test_unknown_key_of_a_chosen_option(tmp_path: Path) -> None:
    line = _one_line(_run(["teacher=hf", "teacher.nme_or_path=/models/x"], tmp_path))
    assert line == "unknown key teacher.nme_or_path: did you mean teacher.name_or_path?"


def test_unknown_option_lists_the_options(tmp_path: Path) -> None:
    line = _one_line(_run(["replacement=foo"], tmp_path))
    assert line.startswith("replacement=foo: no such option; choose one of copy, ")
    assert "_schema" not in line  # the schema's nodes are not options a user can choose


def test_bad_value_names_the_key(tmp_path: Path) -> None:
    line = _one_line(_run(["student.steps_per_stage=abc"], tmp_path))
    assert "student.steps_per_stage=abc" in line and "Integer" in line


def test_text_glob_matching_nothing_fails_before_any_process(tmp_path: Path) -> None:
    glob = tmp_path / "corpus" / "*.txt"
    line = _one_line(_run(["mode=local", "data=text", f"data.path={glob}"], tmp_path))
    assert line == f"`data.path='{glob}'` matches no file. Give a glob such as '/corpus/*.txt'."
    assert not list((tmp_path / "run").glob("*.out"))  # no broker, no worker


def test_missing_teacher_path(tmp_path: Path) -> None:
    line = _one_line(_run(["mode=local", "teacher=hf", f"teacher.name_or_path={tmp_path / 'nowhere'}"], tmp_path))
    assert line.startswith(f"teacher.name_or_path='{tmp_path / 'nowhere'}' does not exist; give a model directory")


def test_hf_teacher_without_its_path(tmp_path: Path) -> None:
    line = _one_line(_run(["teacher=hf"], tmp_path))
    assert line == ("teacher.name_or_path has no value and the chosen options need one: "
                    "add teacher.name_or_path=<value> to the command")


def test_eval_without_a_student(tmp_path: Path) -> None:
    line = _one_line(_run(["mode=eval"], tmp_path))
    assert line.startswith("mode=eval needs lm_eval.student=<an exported student directory>")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None, reason="the eval extra is installed")
def test_eval_without_its_extra(tmp_path: Path) -> None:
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "distill_student.json").write_text("{}")
    line = _one_line(_run(["mode=eval", f"lm_eval.student={tmp_path / 'student'}"], tmp_path))
    assert line == "mode=eval needs lm-evaluation-harness: pip install -e '.[eval]' (or pip install lm-eval)"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_too_little_shared_memory(tmp_path: Path) -> None:
    slots = 10_000_000  # about 2 TiB of slots for the tiny teacher
    line = _one_line(_run(["mode=local", f"pipeline.slot_count={slots}", f"pipeline.max_queued_per_student={slots}"],
                          tmp_path))
    assert line.startswith("/dev/shm has ") and "lower slot_count" in line


@pytest.mark.parametrize("ask", ["HYDRA_FULL_ERROR=1", "log_level=DEBUG"])
def test_the_traceback_on_request(tmp_path: Path, ask: str) -> None:
    env, args = ({"HYDRA_FULL_ERROR": "1"}, []) if ask.startswith("HYDRA") else ({}, [ask])
    result = _run(["mode=eval", *args], tmp_path, **env)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError: mode=eval needs lm_eval.student" in result.stderr


HOLDER = ("import pathlib, sys\n"
          "from distill.train.checkpoint import hold_checkpoint_dir\n"
          "claim = hold_checkpoint_dir(pathlib.Path(sys.argv[1]))\n"
          "print('held', flush=True)\n"
          "sys.stdin.read()\n")


def test_a_second_run_in_a_live_run_s_checkpoint_dir_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """The first run holds an flock on ``<checkpoint_dir>/run.lock`` (with its pid); the second is
    one line, exit 2, before any broker, worker or student. Killed (-9), the first leaves no stale lock."""
    from distill.train.checkpoint import hold_checkpoint_dir
    from tests.integration.test_app import _tiny

    checkpoints = tmp_path / "checkpoints"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(checkpoints)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = _run(["mode=local", *_tiny(tmp_path), f"checkpoint_dir={checkpoints}"], tmp_path)
        assert result.returncode == ConfigError.exit_code and "Traceback" not in result.stderr, result.stderr
        line = result.stderr.splitlines()[-1]  # after the tiny teacher's build bars, when this test builds it
        assert line.startswith(f"another run (pid {holder.pid}) is using the checkpoint directory {checkpoints}")
        assert not list((tmp_path / "run").glob("*.out")) and not list((tmp_path / "run").glob("*.err"))
        assert "config:" not in result.stdout and not (tmp_path / "run" / "config.yaml").exists()  # refused first
    finally:
        holder.kill()
        holder.wait(timeout=CLI_TIMEOUT_S)
    hold_checkpoint_dir(checkpoints).close()  # the kernel dropped the dead run's lock


def test_invocations_that_do_no_work_leave_no_run_directory(tmp_path: Path) -> None:
    """Hydra's ``outputs/<date>/<time>/`` only for runs: not for mode=plan (it prints), nor for a config
    error found inside Hydra's job (the text glob); a run that starts still gets one (test_app)."""
    def bare(args: list[str]) -> subprocess.CompletedProcess:  # Hydra names the run directory
        return subprocess.run([sys.executable, "-m", "distill", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=CLI_TIMEOUT_S)

    # the session's small teacher (building the default one takes minutes)
    small = [o for o in _tiny(tmp_path) if o.startswith(("teacher.", "data.seq_len="))]
    plan = bare(["mode=plan", "student.layers=[0]", *small])
    assert plan.returncode == 0 and "total" in plan.stdout, plan.stderr
    assert not list(tmp_path.iterdir()), list(tmp_path.rglob("*"))
    error = bare(["mode=local", "data=text", f"data.path={tmp_path / 'none' / '*.txt'}"])
    assert error.returncode == ConfigError.exit_code and "matches no file" in error.stderr
    assert not list(tmp_path.iterdir()), list(tmp_path.rglob("*"))
