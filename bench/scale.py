"""How big can it go: the sizing formulas for 8B and 70B teachers, checked by a measured run here.

Why: a layer-by-layer run streams each stage's targets instead of storing them, and what
that costs (shared memory per student, network per student, teacher GPUs per student) is
set by the teacher's shape. ``distill.train.sizing`` holds the formulas; this prints them
for Llama-3.1-8B and Llama-3.1-70B shapes (docs/scale.md carries the table), then checks
the same formulas against one real run on this machine:

1. ``formulas``: per teacher (bfloat16, ``--seq-len`` tokens per sample, one layer per
   stage: 2 boundary states per sample, ``pipeline.slot_count=32``): bytes per token per
   boundary state, bytes per sample, /dev/shm per student rank, the samples/s one student
   GPU trains a linear-attention replacement at and one teacher GPU delivers for the first
   and the last stage (at ``--tflops`` achieved bf16 TFLOP/s on both, FLOPs counted as
   ``Teacher.layer_flops_per_token``), the teacher GPUs one student GPU keeps busy, the
   network per student over the TCP medium, and what storing every boundary state of
   ``--disk-tokens`` tokens on disk would take instead.
2. ``measured``: ``python -m distill`` (mode=local, the offline tiny teacher, 1 worker, 1
   student, the network medium with ``pipeline.local_shm=false`` so every sample crosses
   TCP) inside a private network namespace (``unshare -rn``: its loopback carries this run
   only). /dev/shm is polled for the run's segments during the run; the loopback's bytes
   are read at its end; the workers' own sample counts give bytes per sample. It asserts
   that the measured segment size equals ``shm_bytes`` exactly and that bytes per sample
   over TCP are within 5% of ``network_bytes_per_s(1, sample)`` (one slot stride per sample;
   the rest is ZeroMQ/TCP framing and control messages). Without ``unshare`` the TCP row
   is skipped (said so).

Run it from the repository root (under the CPU lock)::

    python bench/scale.py                 # formulas + the measured run (about a minute)
    python bench/scale.py --no-run        # formulas only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from distill.pipeline.mediums.shm import SHM_DIR
from distill.pipeline.slot import slot_stride
from distill.train.sizing import (
    ModelShape,
    disk_bytes,
    network_bytes_per_s,
    sample_bytes,
    shm_bytes,
    state_bytes_per_token,
    student_samples_per_s,
    teacher_samples_per_s,
)

TEACHERS = {
    "Llama-3.1-8B": ModelShape(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                               head_dim=128, intermediate_size=14336),
    "Llama-3.1-70B": ModelShape(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                head_dim=128, intermediate_size=28672),
}
POSITIONS, SLOT_COUNT, DTYPE = 2, 32, "bfloat16"
RUN_ID = "scalebench"
TCP_TOLERANCE = 0.05


def formulas(seq_len: int, tflops: float, disk_tokens: float) -> list[tuple[str, list[str]]]:
    """Rows (quantity, one value per teacher) of the sizing table."""
    flops = tflops * 1e12
    rows: dict[str, list[str]] = {}
    for shape in TEACHERS.values():
        sample = sample_bytes(seq_len, shape.hidden_size, DTYPE, POSITIONS)
        student = student_samples_per_s(shape.layer_flops_per_token(seq_len), seq_len, flops)
        first = teacher_samples_per_s(shape, 0, seq_len, flops)
        last = teacher_samples_per_s(shape, shape.num_layers - 1, seq_len, flops)
        mean_layers = (shape.num_layers + 1) / 2
        values = {
            "hidden size D, layers L, parameters": f"{shape.hidden_size}, {shape.num_layers}, {shape.params / 1e9:.1f}B",
            "teacher weights in bf16 (GPUs of 80 GB)": f"{shape.params * 2 / 1e9:.0f} GB ({-(-shape.params * 2 // 72e9):.0f})",
            "bytes per token per boundary state (D x 2)": f"{state_bytes_per_token(shape.hidden_size, DTYPE):,}",
            f"bytes per sample (T={seq_len}, 2 states)": f"{sample / 2**20:.1f} MiB",
            f"/dev/shm per student rank ({SLOT_COUNT} + 1 slots)": f"{shm_bytes(sample, SLOT_COUNT) / 2**30:.2f} GiB",
            "student GPU: samples/s it trains (1 layer)": f"{student:.0f}",
            "teacher GPU: samples/s, first stage (l=0)": f"{first:.0f}",
            "teacher GPU: samples/s, last stage (l=L-1)": f"{last:.1f}",
            "teacher GPUs per student GPU: last / mean stage": f"{student / last:.0f} / {student / first * mean_layers:.0f}",
            "TCP per student at its rate": f"{network_bytes_per_s(student, sample) / 1e9:.1f} GB/s "
                                           f"({network_bytes_per_s(student, sample) * 8 / 1e9:.0f} Gbit/s)",
            f"disk: every boundary state of {disk_tokens:.0e} tokens": f"{disk_bytes(int(disk_tokens), shape.hidden_size, DTYPE, shape.num_layers) / 1e12:.0f} TB",
        }
        for key, value in values.items():
            rows.setdefault(key, []).append(value)
    return list(rows.items())


def print_formulas(seq_len: int, tflops: float, disk_tokens: float) -> None:
    print(f"sizing formulas (distill.train.sizing): bf16 teacher, T={seq_len}, layers_per_stage=1, "
          f"{tflops:.0f} achieved TFLOP/s per GPU")
    names = list(TEACHERS)
    print(f"{'':<52} " + " ".join(f"{n:>24}" for n in names))
    for key, values in formulas(seq_len, tflops, disk_tokens):
        print(f"{key:<52} " + " ".join(f"{v:>24}" for v in values))


# ---------------------------------------------------------------------- the measured run


def _overrides(run_dir: Path, steps: int) -> list[str]:
    return ["mode=local", f"run_id={RUN_ID}", "pipeline=tcp", "pipeline.broker_host=127.0.0.1",
            "pipeline.tcp_host=127.0.0.1", "pipeline.local_shm=false", "local.num_workers=1",
            "local.num_students=1", f"student.steps_per_stage={steps}", "student.layers=[0,3]", "evaluate=false",
            f"checkpoint_dir={run_dir / 'ckpt'}", f"hydra.run.dir={run_dir}"]


class ShmWatch:
    """Polls /dev/shm for this run's segments; keeps the largest total size seen."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.sizes: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ShmWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            total = 0
            for entry in os.scandir(SHM_DIR):
                if entry.name.startswith(f"dst_{RUN_ID}_"):
                    try:
                        size = entry.stat().st_size
                    except FileNotFoundError:
                        continue
                    self.sizes.add(size)
                    total += size
            self.peak_bytes = max(self.peak_bytes, total)


def measured_run(steps: int) -> dict:
    """The run in a private network namespace; what it allocated and sent."""
    work = Path(tempfile.mkdtemp(prefix="distill-scale-"))
    command = " ".join([sys.executable, "-m", "distill", *_overrides(work, steps)])
    isolated = shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0
    script = f"ip link set lo up && {command} && grep ' lo:' /proc/net/dev" if isolated else command
    shell = ["unshare", "-rn", "sh", "-c", script] if isolated else ["sh", "-c", script]
    started = time.monotonic()
    try:
        with ShmWatch() as watch:
            done = subprocess.run(shell, capture_output=True, text=True, timeout=900,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode != 0:
            raise RuntimeError(f"the run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        teachers = [json.loads(p.read_text()) for p in work.glob("teacher_time.*.json")]
        config = json.loads((work / "result.json").read_text())
        ends = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["event"] == "stage_end"]
        lo_bytes = int(re.search(r"lo:\s*(\d+)", done.stdout).group(1)) if isolated else None
        return {"isolated": isolated, "lo_bytes": lo_bytes, "samples": sum(t["samples"] for t in teachers),
                "teacher_busy_s": sum(t["teacher_s"] for t in teachers), "shm_peak": watch.peak_bytes,
                "shm_sizes": sorted(watch.sizes), "stage_ends": ends, "wall_s": time.monotonic() - started,
                "timings": config.get("timings", {})}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_measured(steps: int) -> int:
    """Run, compare with the formulas, print, and return a non-zero code if they disagree."""
    from distill.config import TinyConfig

    tiny, seq_len = TinyConfig(), 128  # the defaults the run uses (teacher=tiny_llama, data.seq_len)
    sample = sample_bytes(seq_len, tiny.hidden_size, "float32", POSITIONS)
    want_shm = shm_bytes(sample, SLOT_COUNT)
    run = measured_run(steps)
    print(f"\nmeasured: python -m distill (tiny Llama D={tiny.hidden_size}, T={seq_len}, float32, layers 0 and 3, "
          f"{steps} steps each, 1 worker, 1 student, pipeline=tcp local_shm=false) in {run['wall_s']:.0f} s")
    print(f"{'quantity':<42} {'formula':>14} {'measured':>14} {'ratio':>7}")
    rows = [("/dev/shm of the student (bytes)", want_shm, run["shm_peak"])]
    if run["isolated"]:
        per_sample = run["lo_bytes"] / max(run["samples"], 1)
        rows.append(("bytes over TCP per sample", network_bytes_per_s(1, sample), per_sample))
    for name, want, got in rows:
        print(f"{name:<42} {want:>14,.0f} {got:>14,.0f} {got / want:>7.3f}")
    if not run["isolated"]:
        print("bytes over TCP per sample: not measured (unshare -rn not permitted here)")
    for end in run["stage_ends"]:
        print(f"stage {end['stage']} (layer {end['layers']}): student needed {end['needed_samples_per_s']:.0f} "
              f"samples/s, the teacher delivered {end['delivered_samples_per_s']:.0f} "
              f"(waited {end['wait_fraction']:.0%} of its steps)")
    print(f"teacher: {run['samples']} samples in {run['teacher_busy_s']:.1f} s busy "
          f"({run['samples'] / max(run['teacher_busy_s'], 1e-9):.0f} samples/s over both stages); sample "
          f"{sample:,} bytes, slot stride {slot_stride(sample):,}")
    ok = run["shm_peak"] == want_shm and (not run["isolated"]
                                          or abs(rows[-1][2] / rows[-1][1] - 1) <= TCP_TOLERANCE)
    print("formulas hold" if ok else "FORMULAS DO NOT HOLD")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sample in the formulas")
    parser.add_argument("--tflops", type=float, default=400.0,
                        help="achieved bf16 TFLOP/s per GPU (H100 SXM: 989 peak; 400 is ~40%% MFU)")
    parser.add_argument("--disk-tokens", type=float, default=1e9, help="tokens whose targets would go to disk")
    parser.add_argument("--steps", type=int, default=30, help="steps per stage of the measured run")
    parser.add_argument("--no-run", action="store_true", help="print the formulas only")
    args = parser.parse_args(argv)
    print_formulas(args.seq_len, args.tflops, args.disk_tokens)
    return 0 if args.no_run else check_measured(args.steps)


if __name__ == "__main__":
    sys.exit(main())
