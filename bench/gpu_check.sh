#!/usr/bin/env bash
# The GPU checks of distill in one run, one table at the end (under 8 minutes on one GPU):
#   1. pytest -m gpu                      every CUDA parametrisation of the test suite
#   2. bench/teacher.py --device cuda     teacher targets: the pipeline vs a bare loop
#   3. bench/cuda_staging.py --size 4     the transport with CUDA staging, 4 MiB samples
#   4. python -m distill device=gpu       the default run, teacher and student on the GPU
#                                         (device.share_gpu=true with one GPU): wall time and split
# Without CUDA it says so and exits 0 (nothing to check). Logs stay in $GPU_CHECK_DIR (default
# a temporary directory, printed). Run from anywhere:  bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False); nothing was run"
    exit 0
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
OUT=${GPU_CHECK_DIR:-$(mktemp -d -t distill-gpu-check-XXXXXX)}
mkdir -p "$OUT"
echo "gpu_check: $GPUS GPU(s); logs in $OUT"

# step NAME LIMIT_S COMMAND...: run it with a time limit, record rc and seconds
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "gpu_check: $name ..."
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$? $((SECONDS - start))" > "$OUT/$name.rc"
}

SHARE=true
[ "$GPUS" -ge 2 ] && SHARE=false  # two GPUs: the teacher on cuda:0, the student on cuda:1

step pytest 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider -n 0
step teacher 110 "$PY" bench/teacher.py --device cuda --quick
step staging 60 "$PY" bench/cuda_staging.py --size 4 --seconds 3
step run 150 "$PY" -m distill device=gpu device.share_gpu=$SHARE "hydra.run.dir=$OUT/run" \
    "checkpoint_dir=$OUT/run/checkpoints"

"$PY" - "$OUT" <<'EOF'
"""One table from the four logs."""
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])


def status(name):
    rc, seconds = (out / f"{name}.rc").read_text().split()
    text = (out / f"{name}.log").read_text(errors="replace")
    return int(rc), int(seconds), text


def find(pattern, text, default="?"):
    match = re.search(pattern, text)
    return match.group(1) if match else default


rows = []
rc, s, text = status("pytest")
rows.append(("pytest -m gpu", rc, s, find(r"(\d+ passed[^\n=]*)", text, text.strip().splitlines()[-1:] or "?")))
rc, s, text = status("teacher")
rows.append(("teacher.py --device cuda", rc, s,
             "pipeline/bare at best B: " + find(r"best B=\d+: ([0-9.]+ \w+)", text)))
rc, s, text = status("staging")
rows.append(("cuda_staging 4 MiB", rc, s, "pipeline " + find(r"pipeline\s+[0-9.]+\s+([0-9.]+)", text) + " GB/s, "
             "pipeline/bare " + find(r"pipeline/bare ([0-9.]+)", text) + ", bare/limit "
             + find(r"bare\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)", text)))
rc, s, text = status("run")
result = out / "run" / "result.json"
split = json.loads(result.read_text()).get("time_split", {}) if result.exists() else {}
shares = ", ".join(f"{k} {v:.0f}s" for k, v in split.items() if k != "wall_s" and isinstance(v, float) and v >= 1)
rows.append(("default run device=gpu", rc, s,
             f"wall {split.get('wall_s', float('nan')):.0f}s: {shares}" if split else "no result.json"))

print(f"\n{'check':<26} {'status':<8} {'s':>5}  result")
for name, rc, seconds, figure in rows:
    state = "ok" if rc == 0 else ("timeout" if rc in (124, 130, 137) else f"rc={rc}")
    print(f"{name:<26} {state:<8} {seconds:>5}  {figure}")
sys.exit(0 if all(rc == 0 for _, rc, _, _ in rows) else 1)
EOF
