"""bench/pipeline.py still runs against the pipeline it measures.

Its cells follow each other on one broker, each with a student of its own; when runs got
leader secrets (issue 37) every cell after the first was refused as "not its leader" and
the benchmark died on its second cell, unnoticed until the next time someone measured.
This runs the smallest set of cells that covers each way a student is served (direct
requests, REQUESTs through the broker, relayed notices) with 1 and 2 workers, and the
round-trip table, in quick mode.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_pipeline_benchmark_runs_every_cell_it_is_asked_for(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "pipeline.py"), "--quick", "--sizes", "4KiB",
                           "--methods", "dataset,notices,relay,rtt"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cells = {(m[1], m[2]) for m in re.finditer(r"^4 KiB\s+pipeline/(\w+)\s+(\d)\s+\d+\s+[\d,]+\s", done.stdout, re.M)}
    assert cells >= {(method, workers) for method in ("dataset", "notices", "relay") for workers in "12"}, done.stdout
    assert "control path" in done.stdout and "notices / lane" in done.stdout
