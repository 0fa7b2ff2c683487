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
3. ``fairness``: what a flooding peer costs a good student. One worker and one
   student (this process, a ``StudentClient`` of 32 slots of 4 KiB, direct requests off:
   every sample goes through the broker) take samples in ``--rounds`` pairs of
   ``--fair-seconds`` windows, one quiet and one while a flooder (its own process) sends
   in turn, never reading an answer: REQUESTs of ~1.9 MiB of empty maps (the dearest
   bytes to unpack), of ~4 MiB (the old message limit) and valid REQUESTs of 8,192
   fresh slots. Printed side by side: the student's samples/s (median over the rounds)
   and their ratio, the broker's RSS, the longest a STATS (asked every 0.25 s) waited.

Run it from the repository root::

    python bench/memory.py            # 60 s sustained + 10 s flood + 3 x (4 + 4) s fairness
    python bench/memory.py --quick    # 10 s + 3 s + 3 x (2 + 2) s
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import msgpack
import zmq
from children import SPAWN, Children, child_init, run_broker  # bench/children.py
from pipeline import fill_targets, run_worker, sample_config  # bench/pipeline.py

from distill.pipeline import DistillIterableDataset, StudentClient, Worker, protocol
from distill.pipeline.protocol import PROTOCOL_TAG, Command

SAMPLE_BYTES = 256 << 10
BATCH, SLOTS, WORKER_BATCH = 32, 128, 32
SAMPLE_EVERY_S = 0.5
FLOOD_SLOTS_PER_REQUEST = 1000
FAIR_SAMPLE_BYTES, FAIR_SLOTS, FAIR_WORKER_BATCH = 4096, 32, 16
STATS_EVERY_S = 0.25


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


@dataclass
class Fairness:
    """The good student's samples/s per window, quiet and flooded, and what the broker showed."""

    quiet: list[float] = field(default_factory=list)
    flooded: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    stats_waits_s: list[float] = field(default_factory=list)
    flood_sent: int = 0


def run_fair_worker(parent_pid: int, ready, endpoints: dict[str, str]) -> None:
    """A worker whose every fill goes through the broker (no direct requests)."""
    child_init(parent_pid)
    worker = Worker(batch_fn=fill_targets, batch_config=sample_config(FAIR_SAMPLE_BYTES), max_batch=FAIR_WORKER_BATCH,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    direct_requests=False)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    ready.set()
    worker.run()


def _flood_messages(peer_id: str) -> list[list[bytes]]:
    """The flood, in turn: ~1.9 MiB of empty maps, ~4 MiB of them, a valid 8,192-slot REQUEST."""
    head = {"run_id": "default", "peer_id": peer_id, "generation": 0, "medium": f"dst_flood_{os.getpid()}_1",
            "stride": 4160}
    bodies = []
    for count in (1_900_000, 4 * 2**20 - 4096):  # lists of 65,536 maps: each passes max_array_len
        lists = [min(65536, count - start) for start in range(0, count, 65536)]
        slots = (b"\xdd" + len(lists).to_bytes(4, "big")
                 + b"".join(b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n for n in lists))
        packed = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in head.items())
        bodies.append([PROTOCOL_TAG, Command.REQUEST.value,
                       b"\xde" + (len(head) + 1).to_bytes(2, "big") + packed + msgpack.packb("slots") + slots])
    return bodies


def run_flooder(parent_pid: int, ready, endpoint: str, flooding, sent) -> None:
    """Sends the flood while ``flooding`` is set, as fast as the broker takes it, reading nothing."""
    child_init(parent_pid)
    peer_id = f"flooder-{os.getpid()}"
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, peer_id.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    messages, request_id = _flood_messages(peer_id), 0
    ready.set()
    while True:
        flooding.wait()
        request_id += 8192
        valid = protocol.encode(Command.REQUEST, {
            "run_id": "default", "peer_id": peer_id, "generation": 0, "medium": f"dst_flood_{os.getpid()}_1",
            "stride": 4160, "slots": [[i, request_id + i] for i in range(8192)]})
        for frames in (*messages, valid):
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                sent.value += 1
            except zmq.Again:
                sock.poll(50, zmq.POLLOUT)


def fairness(endpoints: dict[str, str], broker_pid: int, seconds: float, rounds: int) -> Fairness:
    """Quiet and flooded windows in turn; the good student's rate in each (see module docstring)."""
    result = Fairness()
    flooding, sent = SPAWN.Event(), SPAWN.Value("q", 0)
    with Children() as kids, StudentClient(0, FAIR_SLOTS, sample_config(FAIR_SAMPLE_BYTES), endpoints["frontend"],
                                           endpoints["control"], endpoints["control_pub"],
                                           direct_requests=False) as client:
        kids.start(run_fair_worker, endpoints)
        kids.start(run_flooder, endpoints["frontend"], flooding, sent)
        client.hello()
        client.set_model("fairness")
        _samples_per_s(client, 1.0, endpoints, broker_pid, None)  # warm up
        for _ in range(rounds):
            result.quiet.append(_samples_per_s(client, seconds, endpoints, broker_pid, None))
            flooding.set()
            time.sleep(0.5)  # the flood is on before the window opens
            result.flooded.append(_samples_per_s(client, seconds, endpoints, broker_pid, result))
            flooding.clear()
            time.sleep(1.0)  # what the flooder had queued drains
        result.flood_sent = sent.value
    return result


def _samples_per_s(client: StudentClient, seconds: float, endpoints: dict[str, str], broker_pid: int,
                   watch: Fairness | None) -> float:
    count, start = 0, time.monotonic()
    next_stats = start
    while (now := time.monotonic()) - start < seconds:
        if watch is not None and now >= next_stats:
            watch.stats_waits_s.append(_stats_wait_s(endpoints["frontend"]))
            watch.rss_kib.append(rss_kib(broker_pid))
            next_stats = time.monotonic() + STATS_EVERY_S
        ref = client.request_sample(timeout_ms=60_000)
        if ref is None:
            raise RuntimeError("the good student got no sample for 60 s")
        client.release_slot(ref.slot_id)
        count += 1
    return count / (time.monotonic() - start)


def _stats_wait_s(frontend: str, timeout_s: float = 60.0) -> float:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend)
    try:
        started = time.monotonic()
        protocol.send(sock, Command.STATS, {})
        if not sock.poll(timeout_s * 1000):
            return float("inf")
        sock.recv_multipart()
        return time.monotonic() - started
    finally:
        sock.close(0)


def print_fairness(result: Fairness, seconds: float, rss_before_kib: int) -> None:
    quiet, flooded = statistics.median(result.quiet), statistics.median(result.flooded)
    print(f"\nfairness: a good student through the broker ({FAIR_SLOTS} slots of {FAIR_SAMPLE_BYTES >> 10} KiB, "
          f"1 worker) in {len(result.quiet)} pairs of {seconds:g} s windows, quiet and while one peer floods "
          f"({result.flood_sent:,} flood messages sent)")
    print(f"{'window':<10} {'samples/s':>10} {'lowest':>10} {'highest':>10} {'vs quiet':>9} {'broker MiB':>11} "
          f"{'STATS wait':>11}")
    print(f"{'quiet':<10} {quiet:>10,.0f} {min(result.quiet):>10,.0f} {max(result.quiet):>10,.0f} {1:>9.2f} "
          f"{rss_before_kib / 1024:>11.1f} {'-':>11}")
    print(f"{'flooded':<10} {flooded:>10,.0f} {min(result.flooded):>10,.0f} {max(result.flooded):>10,.0f} "
          f"{flooded / quiet:>9.2f} {max(result.rss_kib) / 1024:>11.1f} {max(result.stats_waits_s) * 1000:>9.1f}ms")


def print_trace(trace: Trace, unit: str) -> None:
    rss = trace.rss_kib
    print(f"{trace.name:<10} {len(rss):>7} {rss[0] / 1024:>10.1f} {max(rss) / 1024:>9.1f} "
          f"{rss[-1] / 1024:>9.1f} {trace.slope_kib_per_min:>12.1f} {trace.served:>14,} {unit}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s sustained, 3 s flood")
    parser.add_argument("--seconds", type=float, default=None, help="sustained phase (default 60)")
    parser.add_argument("--flood-seconds", type=float, default=None, help="flood phase (default 10)")
    parser.add_argument("--fair-seconds", type=float, default=None, help="each fairness window (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="quiet/flooded window pairs (default 3)")
    parser.add_argument("--only-fairness", action="store_true", help="skip the sustained and flood phases")
    args = parser.parse_args(argv)
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    flood_s = args.flood_seconds or (3.0 if args.quick else 10.0)
    fair_s = args.fair_seconds or (2.0 if args.quick else 4.0)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.getLogger("distill").setLevel(logging.ERROR)  # the flood's refusals are expected
    sock_dir = tempfile.mkdtemp(prefix="distill-mem-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control",
                                                                   "control_pub")}
    try:
        with Children() as shared:
            broker_pid = shared.start(run_broker, endpoints)
            traces = [] if args.only_fairness else [
                (sustained(endpoints, broker_pid, seconds), "samples served"),
                (flood(endpoints, broker_pid, flood_s), "slots requested")]
            rss_before = rss_kib(broker_pid)
            fair = fairness(endpoints, broker_pid, fair_s, args.rounds)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    print(f"distill broker memory: {os.cpu_count()} CPUs, {SAMPLE_BYTES >> 10} KiB samples, "
          f"RSS sampled every {SAMPLE_EVERY_S} s, load average {os.getloadavg()[0]:.1f}")
    if traces:
        print(f"{'phase':<10} {'samples':>7} {'first MiB':>10} {'peak MiB':>9} {'last MiB':>9} "
              f"{'KiB/min':>12} {'count':>14}")
    for trace, unit in traces:
        print_trace(trace, unit)
    print_fairness(fair, fair_s, rss_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
