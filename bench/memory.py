"""Broker memory under load: resident set size over a sustained run and during a flood.

Why: the broker is the one process every sample's address goes through; if any of
its tables (queues, in-flight work, peers, rate windows) grew with the number of
samples served, a long distillation run would end in an out-of-memory kill. This
prints, for a broker process (``distill.pipeline.Broker``):

1. ``sustained``: 2 worker processes fill 256 KiB slots as fast as a student (this
   process, ``DistillIterableDataset(batch_size=32, reuse_batches=True)``) takes
   them, for ``--seconds``. The broker's RSS is sampled every 0.5 s; the table
   shows it after warm-up, at its peak and at the end, the samples served, and the
   least-squares slope in KiB per minute (flat: within noise of 0).
2. ``flood``: a peer sends REQUESTs of 1,000 slots each as fast as it can, with no
   worker to serve them, for ``--flood-seconds`` (the broker refuses what exceeds
   its per-run queue bound and answers ERROR), then leaves (BYE). RSS before, peak
   during, and after the flood's requests were dropped.

Run it from the repository root::

    python bench/memory.py            # 60 s sustained + 10 s flood
    python bench/memory.py --quick    # 10 s + 3 s
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import zmq
from children import Children, run_broker  # bench/children.py
from pipeline import run_worker, sample_config  # bench/pipeline.py

from distill.pipeline import DistillIterableDataset, StudentClient, protocol
from distill.pipeline.protocol import Command

SAMPLE_BYTES = 256 << 10
BATCH, SLOTS, WORKER_BATCH = 32, 128, 32
SAMPLE_EVERY_S = 0.5
FLOOD_SLOTS_PER_REQUEST = 1000


@dataclass
class Trace:
    """RSS samples (seconds since start, KiB) of one process over one phase."""

    name: str
    times_s: list[float]
    rss_kib: list[int]
    served: int = 0

    @property
    def slope_kib_per_min(self) -> float:
        n = len(self.times_s)
        if n < 2:
            return 0.0
        mean_t, mean_r = sum(self.times_s) / n, sum(self.rss_kib) / n
        var = sum((t - mean_t) ** 2 for t in self.times_s)
        cov = sum((t - mean_t) * (r - mean_r) for t, r in zip(self.times_s, self.rss_kib, strict=True))
        return cov / var * 60 if var else 0.0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sustained(endpoints: dict[str, str], broker_pid: int, seconds: float) -> Trace:
    """Two workers, one student taking batches as fast as they come; broker RSS sampled."""
    config = sample_config(SAMPLE_BYTES)
    trace = Trace("sustained", [], [])
    with Children() as kids, StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"],
                                           endpoints["control_pub"]) as client:
        for _ in range(2):
            kids.start(run_worker, endpoints, SAMPLE_BYTES, WORKER_BATCH)
        client.hello()
        client.set_model("memory")
        dataset = DistillIterableDataset(0, client.generation_value, SLOTS, config, endpoints["frontend"],
                                         batch_size=BATCH, timeout_s=60, reuse_batches=True)
        batches = iter(dataset)
        try:
            warm_until = time.monotonic() + min(5.0, seconds / 5)
            while time.monotonic() < warm_until:
                next(batches)
            start = next_sample = time.monotonic()
            while (now := time.monotonic()) - start < seconds:
                if now >= next_sample:
                    trace.times_s.append(now - start)
                    trace.rss_kib.append(rss_kib(broker_pid))
                    next_sample += SAMPLE_EVERY_S
                next(batches)
                trace.served += BATCH
        finally:
            batches.close()
    return trace


def flood(endpoints: dict[str, str], broker_pid: int, seconds: float) -> Trace:
    """REQUESTs of many slots as fast as possible, nobody to serve them; then BYE."""
    trace = Trace("flood", [0.0], [rss_kib(broker_pid)])
    ctx = zmq.Context()
    sock = protocol.configure(ctx.socket(zmq.DEALER))
    peer_id = f"flood-{os.getpid()}"
    sock.setsockopt(zmq.ROUTING_ID, peer_id.encode())
    sock.connect(endpoints["frontend"])
    medium = f"dst_flood_{os.getpid()}_0"  # never mapped: no worker runs in this phase
    start = next_sample = time.monotonic()
    request_id = 0
    try:
        while (now := time.monotonic()) - start < seconds:
            slots = [[i, request_id + i] for i in range(FLOOD_SLOTS_PER_REQUEST)]
            request_id += FLOOD_SLOTS_PER_REQUEST
            protocol.send(sock, Command.REQUEST, {"run_id": "flood", "peer_id": peer_id, "generation": 0,
                                                  "medium": medium, "stride": 4096, "slots": slots})
            trace.served += FLOOD_SLOTS_PER_REQUEST
            while sock.poll(0):
                sock.recv_multipart()  # ERROR replies once the queue is full
            if now >= next_sample:
                trace.times_s.append(now - start)
                trace.rss_kib.append(rss_kib(broker_pid))
                next_sample += SAMPLE_EVERY_S
        protocol.send(sock, Command.BYE, {"peer_id": peer_id})
        time.sleep(2.0)  # the broker drains its socket and drops the requests
        trace.times_s.append(time.monotonic() - start)
        trace.rss_kib.append(rss_kib(broker_pid))
    finally:
        sock.close(linger=0)
        ctx.term()
    return trace


def print_trace(trace: Trace, unit: str) -> None:
    rss = trace.rss_kib
    print(f"{trace.name:<10} {len(rss):>7} {rss[0] / 1024:>10.1f} {max(rss) / 1024:>9.1f} "
          f"{rss[-1] / 1024:>9.1f} {trace.slope_kib_per_min:>12.1f} {trace.served:>14,} {unit}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s sustained, 3 s flood")
    parser.add_argument("--seconds", type=float, default=None, help="sustained phase (default 60)")
    parser.add_argument("--flood-seconds", type=float, default=None, help="flood phase (default 10)")
    args = parser.parse_args(argv)
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    flood_s = args.flood_seconds or (3.0 if args.quick else 10.0)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.getLogger("distill").setLevel(logging.ERROR)  # the flood's refusals are expected
    sock_dir = tempfile.mkdtemp(prefix="distill-mem-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control",
                                                                   "control_pub")}
    try:
        with Children() as shared:
            broker_pid = shared.start(run_broker, endpoints)
            traces = [(sustained(endpoints, broker_pid, seconds), "samples served"),
                      (flood(endpoints, broker_pid, flood_s), "slots requested")]
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    print(f"distill broker memory: {os.cpu_count()} CPUs, {SAMPLE_BYTES >> 10} KiB samples, "
          f"RSS sampled every {SAMPLE_EVERY_S} s, load average {os.getloadavg()[0]:.1f}")
    print(f"{'phase':<10} {'samples':>7} {'first MiB':>10} {'peak MiB':>9} {'last MiB':>9} "
          f"{'KiB/min':>12} {'count':>14}")
    for trace, unit in traces:
        print_trace(trace, unit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
