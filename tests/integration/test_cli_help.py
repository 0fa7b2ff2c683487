"""``python -m distill --help`` in a subprocess: groups and keys explained, no schema groups, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HELP_TIMEOUT_S = 60


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=HELP_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return result


def test_help_lists_groups_and_explains_keys(tmp_path: Path) -> None:
    out = _run(["-m", "distill", "--help"], tmp_path).stdout
    for group in ("mode", "teacher", "replacement", "data", "pipeline", "device", "student"):
        assert f"\n  {group}\n" in out
    assert "_schema" not in out
    assert "    local    * Everything on one machine" in out
    assert "    student.steps_per_stage: int = 400\n        Optimizer steps per layer stage." in out
    assert "    teacher.dtype: {float32, bfloat16, float16} = float32\n" in out
    assert "    pipeline.slot_count: int = 32\n        Slots per consumer process" in out
    assert "    replacement.feature_map: str = hedgehog\n" in out
    assert "    lm_eval.tasks: list[str] = [arc_easy, hellaswag, piqa]\n" in out
    assert not (tmp_path / "outputs").exists()  # no run, no run directory


def test_help_imports_no_torch(tmp_path: Path) -> None:
    code = ("import sys; sys.argv = ['distill', '-h']; from distill.__main__ import cli; cli(); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'help imported torch'")
    assert "Keys (KEY=VALUE)" in _run(["-c", code], tmp_path).stdout


def test_hydra_help_is_still_hydra_s(tmp_path: Path) -> None:
    assert "Hydra (" in _run(["-m", "distill", "--hydra-help"], tmp_path).stdout
