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
