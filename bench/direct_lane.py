"""Direct requests at 4 MiB, per ring size: the real lane against its prototype.

The 4 MiB transport target (0.7x cold memcpy, performance issue) is only within reach
of a ring that fits the CPU cache (3-8 slots), and such a ring runs dry unless the
round trip is short. The pipeline's default now sends a slot's REQUEST straight to
the local worker that last filled it (a DIRECT datagram, ``distill/pipeline/notices.py``);
this benchmark was written to measure that design before it existed, and now keeps
the real one honest against the prototype it was built from.

``prototype lane`` cells: this process iterates a real ``DistillIterableDataset``
(``reuse_batches=True``: its real pool, header checks, notice inbox and batch
gather), but the pool's ``flush`` sends each REQUEST as one Unix datagram straight to
1 or 2 worker processes (slot ``i`` to worker ``i % n``), and no broker runs. Each
worker maps the student's segment, fills the asked-for slots with ``fill_sample``,
commits their headers with ``write_headers`` and notifies with the real
``NoticeOutbox``. It has none of the real lane's rules (declines, dead workers,
generation checks, statistics, the fair share), so it is a ceiling; it does claim each
slot before writing it, as every writer must (``distill/pipeline/worker/claims.py``).

Side by side in one run, per slot count (4 MiB samples, batches of 4): cold memcpy
(the reference), the pipe handoff (the transport ceiling: two small messages per
slot between two processes, no Python pipeline code), the pipeline with every
REQUEST through the broker (``pipeline/notices``), the pipeline as it runs by default
(``pipeline/dataset``: direct requests) and the prototype, each with 1 and 2
producers; ratios to cold memcpy. ``pipeline/<method>`` are ``bench/pipeline.py``'s cell
labels (its ``--methods`` names), not module paths::

    python bench/direct_lane.py                    # 3, 4, 6, 8, 16 slots; about 5 minutes
    python bench/direct_lane.py --slots 4 --seconds 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pipeline as bp  # bench/pipeline.py
import torch
from children import Children, child_init  # bench/children.py

from distill.pipeline import DistillIterableDataset, SlotPool
from distill.pipeline.liveness import new_writer_id
from distill.pipeline.mediums.shm import attach_segment
from distill.pipeline.notices import NoticeOutbox
from distill.pipeline.slot import HEADER_BYTES, HeaderTable

SAMPLE_BYTES = 4 << 20
BATCH_SIZE = 4
SLOT_COUNTS = (3, 4, 6, 8, 16)
COLUMNS = {"pipe handoff": "pipe handoff", "pipeline via broker": "pipeline/notices",
           "pipeline direct": "pipeline/dataset", "prototype lane": "direct lane"}
"""Column -> the method of its cells."""
MAX_REQUEST_BYTES = 1 << 16


def run_direct_worker(parent_pid: int, ready, segment: str, stride: int, slot_count: int,
                      payload_bytes: int, request_path: str, inbox_dir: str) -> None:
    """Fill the slots each datagram asks for, commit them, notify the student."""
    child_init(parent_pid)
    requests = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    requests.bind(request_path)
    attached = attach_segment(segment)
    view = memoryview(attached.mapping)[:stride * slot_count]
    table = HeaderTable(view, stride)
    writer = new_writer_id()
    rows = torch.frombuffer(view, dtype=torch.uint8).view(slot_count, stride)
    payloads = rows[:, HEADER_BYTES:HEADER_BYTES + payload_bytes]
    outbox = NoticeOutbox(Path(inbox_dir))
    ready.set()
    while True:
        generation, slots = msgpack.unpackb(requests.recv(MAX_REQUEST_BYTES))
        slot_idxs = [slot for slot, _ in slots]
        table.set_claims(slot_idxs, writer)
        for slot, request_id in slots:
            bp.fill_sample(payloads[slot], request_id)
        table.write(slot_idxs, generation, [req for _, req in slots], payload_bytes, writer=writer)
        if not outbox.send(segment, generation, [[slot, req, True] for slot, req in slots]):
            raise RuntimeError(f"notice to {segment} not sent")


class DirectDataset(DistillIterableDataset):
    """The real dataset, its pool asking its workers directly (started with the pool)."""

    def __init__(self, kids: Children, workers: int, lane_dir: str, **kwargs: object) -> None:
        super().__init__(**kwargs, socket_dir=lane_dir)
        self.kids, self.workers, self.lane_dir = kids, workers, lane_dir
        self.worker_pids: list[int] = []

    def _open_pool(self) -> SlotPool:
        pool = super()._open_pool()
        paths = [os.path.join(self.lane_dir, f"worker{w}.req") for w in range(self.workers)]
        for path in paths:
            self.worker_pids.append(self.kids.start(
                run_direct_worker, pool.medium.buf_name, pool.medium.slot_stride, self.slot_count,
                self.batch_config.nbytes(), path, self.lane_dir))
        lane = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

        def flush() -> None:  # replaces the REQUEST to the broker
            table = pool.slots
            if not table.to_send:
                return
            by_worker: dict[int, list[list[int]]] = {}
            for slot in dict.fromkeys(table.to_send):
                by_worker.setdefault(slot % len(paths), []).append([slot, table.records[slot].request_id])
            table.to_send.clear()
            for worker, slots in by_worker.items():
                lane.sendto(msgpack.packb([pool._generation(), slots]), paths[worker])

        pool.flush = flush
        return pool


def direct_cells(size: bp.Size, seconds: float) -> Iterator[bp.Result]:
    for workers in (1, 2):
        with Children() as kids, tempfile.TemporaryDirectory(prefix="lane-") as lane_dir:
            dataset = DirectDataset(kids, workers, lane_dir, student_rank=0, generation_value=mp.Value("q", 1),
                                    slot_count=size.slot_count, batch_config=bp.sample_config(size.sample_bytes),
                                    frontend_endpoint=f"ipc://{lane_dir}/no-broker.sock",
                                    batch_size=size.batch_size, timeout_s=30, reuse_batches=True,
                                    heartbeat_interval_s=3600)  # no broker to miss
            batches = iter(dataset)
            try:
                # The first step opens the pool and starts the workers (measure reads their
                # CPU time only after its warm-up).
                yield bp.measure(size, "direct lane", workers, lambda it=batches: len(next(it)["x"]),
                                 seconds, {"consumer": [os.getpid()], "producers": dataset.worker_pids})
            finally:
                batches.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", default=",".join(map(str, SLOT_COUNTS)), help="comma-separated slot counts")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring window per cell")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for count in (int(n) for n in args.slots.split(",")):
        size = bp.Size("4 MiB", SAMPLE_BYTES, batch_size=BATCH_SIZE, slot_count=count, worker_batch=BATCH_SIZE)
        results = bp.run_all((size,), {"memcpy", "pipe", "dataset", "notices"}, args.seconds, bp.RING_BYTES)
        results += direct_cells(size, args.seconds)
        rate = {(r.method, r.procs): r.rate for r in results}
        reference = rate[("cold memcpy", 0)]
        rows.append((count, reference, [rate[(method, procs)] / reference for method in COLUMNS.values()
                                        for procs in (1, 2)]))
    print(f"\n4 MiB samples, batches of {BATCH_SIZE}, {args.seconds:g} s cells: samples/s / cold memcpy "
          "(1 / 2 producers)")
    print(f"{'slots':>5}  {'memcpy/s':>9}" + "".join(f"  {name:>20}" for name in COLUMNS))
    for count, reference, r in rows:
        print(f"{count:>5}  {reference:>9,.0f}" + "".join(f"  {f'{r[i]:.2f} / {r[i + 1]:.2f}':>20}"
                                                          for i in range(0, len(r), 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
