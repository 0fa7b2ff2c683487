"""bench/gpu_check.sh on a machine without CUDA: it says so and exits 0 without running anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script really runs (minutes): bench, not test")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DIR=str(tmp_path / "logs"))
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped: no CUDA device" in done.stdout
    assert not (tmp_path / "logs").exists()  # nothing ran, nothing was written
