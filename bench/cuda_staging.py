"""The transport with CUDA staging: samples made on a GPU reach a student's batch through the pipeline.

Why: a GPU teacher worker writes each batch's states from device memory into the students'
shared-memory slots through pinned staging buffers on a side stream
(``distill.teacher.transfer.DeviceToSlots``), finishing the copies after it has launched the
next batch (the worker's deferred commit). This measures, side by side in one run, for
samples of ``--size`` (default 4 MiB) made by one GPU op per batch:

- ``device -> pinned``: one ``copy_`` of a whole batch from the GPU into a pinned buffer,
  nothing else: the PCIe/NVLink limit of one process.
- ``bare``: the worker's batch function (the GPU op, then ``DeviceToSlots``: staging, side
  stream, the deferred finish into pageable host tensors like slots) in a loop here.
- ``pipeline``: a broker process and 1 worker process with that batch function fill the
  slots of a student (this process, ``DistillIterableDataset(batch_size=B,
  reuse_batches=True)``, which copies each batch once into its batch tensors).

``--device cpu`` runs the same code on the CPU fallback (a smoke test of the plumbing).

Run it from the repository root::

    python bench/cuda_staging.py                      # 4 MiB, cuda, about 30 s
    python bench/cuda_staging.py --device cpu --seconds 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from children import Children, child_init, run_broker  # bench/children.py

from distill.pipeline import BatchConfig, DistillIterableDataset, StudentClient, TensorSpec, Worker
from distill.teacher.transfer import DeviceToSlots

ROW = 1024
"""float32 per row of a sample ([rows, ROW]); the sample is one hidden state of rows tokens."""
BATCH, SLOTS, SUB_WINDOWS = 8, 32, 6


def sample_config(sample_bytes: int) -> BatchConfig:
    return BatchConfig([TensorSpec("hidden", (1, sample_bytes // (4 * ROW), ROW), "float32")])


class GpuStates:
    """The worker's batch function: one GPU op makes the batch, DeviceToSlots copies it out."""

    def __init__(self, sample_bytes: int, device: str) -> None:
        self.device = torch.device(device)
        self.states_BTD = torch.zeros(BATCH, sample_bytes // (4 * ROW), ROW, device=self.device)
        self.to_slots = DeviceToSlots(self.device)

    def __call__(self, model_id: str, model_cfg: dict | None, targets: list) -> Callable[[], None] | None:
        self.states_BTD = self.states_BTD + 1.0  # a new tensor, every byte written, as a forward makes
        finish = self.to_slots.start([self.states_BTD[:len(targets)]], [t.tensors["hidden"] for t in targets])
        return finish if self.to_slots.cuda else None


class _Target:
    def __init__(self, hidden: torch.Tensor) -> None:
        self.request_id, self.tensors = 0, {"hidden": hidden}


def run_worker(parent_pid: int, ready, endpoints: dict[str, str], sample_bytes: int, device: str) -> None:
    child_init(parent_pid)
    worker = Worker(batch_fn=GpuStates(sample_bytes, device), batch_config=sample_config(sample_bytes),
                    max_batch=BATCH, backend_endpoint=endpoints["backend"],
                    control_pub_endpoint=endpoints["control_pub"])
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    ready.set()
    worker.run()


def measure(step: Callable[[], int], seconds: float) -> float:
    """Median samples/s over sub-windows, after a warm-up."""
    step()
    warm_until = time.perf_counter() + max(0.3, seconds / 5)
    while time.perf_counter() < warm_until:
        step()
    rates, window_s, samples = [], seconds / SUB_WINDOWS, 0
    start = window_start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        if now - window_start >= window_s:
            rates.append(samples / (now - window_start))
            window_start, samples = now, 0
        samples += step()
    return statistics.median(rates) if rates else samples / (time.perf_counter() - window_start)


def device_to_pinned(sample_bytes: int, device: str) -> Callable[[], int]:
    source = torch.ones(BATCH, sample_bytes // 4, device=device)
    pinned = torch.empty(BATCH, sample_bytes // 4, pin_memory=device != "cpu")

    def step() -> int:
        pinned.copy_(source, non_blocking=True)
        if device != "cpu":
            torch.cuda.synchronize()
        return BATCH

    return step


def bare(sample_bytes: int, device: str) -> Callable[[], int]:
    fn = GpuStates(sample_bytes, device)
    config = sample_config(sample_bytes)
    slots = torch.empty(BATCH, *config.specs[0].shape)  # pageable, like shared-memory slots
    state = {"finish": None}

    def step() -> int:
        finish = fn("bench", None, [_Target(slots[i]) for i in range(BATCH)])
        if state["finish"] is not None:  # like the Worker: the previous batch completes now
            state["finish"]()
        state["finish"] = finish
        return BATCH

    return step


@contextlib.contextmanager
def pipeline(endpoints: dict[str, str], sample_bytes: int, device: str):
    config = sample_config(sample_bytes)
    with Children() as kids:
        kids.start(run_worker, endpoints, sample_bytes, device)
        with StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], run_id=f"bench-{secrets.token_hex(4)}") as client:
            client.hello()
            client.set_model("cuda-staging")
            batches = iter(DistillIterableDataset(0, client.generation_value, SLOTS, config, endpoints["frontend"],
                                                  batch_size=BATCH, timeout_s=120, reuse_batches=True, run_id=client.run_id))
            try:
                yield lambda: len(next(batches)["hidden"])
            finally:
                batches.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=4.0, help="MiB per sample")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring window per cell")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (plumbing smoke test)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_staging: skipped: no CUDA device")
        return 0
    sample_bytes = int(args.size * 2**20) // (4 * ROW) * 4 * ROW
    torch.set_num_threads(1)
    sock_dir = tempfile.mkdtemp(prefix="distill-staging-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control", "control_pub")}
    try:
        limit = measure(device_to_pinned(sample_bytes, args.device), args.seconds)
        alone = measure(bare(sample_bytes, args.device), args.seconds)
        with Children() as shared:
            shared.start(run_broker, endpoints)
            with pipeline(endpoints, sample_bytes, args.device) as step:
                piped = measure(step, args.seconds)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    gb = sample_bytes / 1e9
    print(f"transport with CUDA staging: {sample_bytes / 2**20:.0f} MiB samples, batches of {BATCH}, "
          f"{SLOTS} slots, device {args.device}, {os.cpu_count()} CPUs, {args.seconds:g} s per cell")
    print(f"{'cell':<18} {'samples/s':>10} {'GB/s':>7} {'vs device->pinned':>18}")
    for name, rate in (("device -> pinned", limit), ("bare", alone), ("pipeline", piped)):
        print(f"{name:<18} {rate:>10.1f} {rate * gb:>7.2f} {rate / limit:>18.2f}")
    print(f"pipeline/bare {piped / alone:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
