"""Exact delivery across real processes: nothing lost, duplicated, corrupted or stale."""

from __future__ import annotations

import pytest
import torch

from distill.pipeline import Broker, DistillIterableDataset, StudentClient, Worker
from tests import peers

SLOT_COUNT = 32


@pytest.mark.parametrize("batch_size", [16, None], ids=["batched", "per-sample"])
def test_two_workers_two_students_dataloader_workers(procs, endpoints, broker_kwargs, batch_size) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    for _ in range(2):
        procs.start(peers.run_worker, endpoints, name="worker")
    from tests.conftest import MP

    results = MP.Queue()
    per_student = 5000
    students = [procs.start(peers.run_student, endpoints, rank, per_student, results, name=f"student{rank}",
                            leader=rank == 0, batch_size=batch_size, slot_count=SLOT_COUNT)
                for rank in range(2)]
    reports = procs.collect(results, 2, students, timeout_s=240)
    for proc in students:
        procs.join(proc, 60)
    total = sum(r["samples"] for r in reports)
    assert total >= 10_000
    for report in reports:
        assert report["corrupt"] == 0, report
        assert report["duplicates"] == 0, report
        assert report["sources"] == 2  # one pool per DataLoader worker
        # at most the slots still in flight at the end are missing from each pool
        assert report["gaps"] <= 2 * SLOT_COUNT, report
    stats = broker.stats
    assert stats.failed == 0 and stats.bad_messages == 0
    assert stats.completed >= total
    broker.stop()


def test_stats_over_the_socket(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    client = StudentClient(0, 2, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"])
    client.hello()
    client.set_model("m")
    client.request_sample(timeout_ms=50)  # queues 2 slots: no worker yet
    import zmq

    from distill.pipeline import protocol
    from distill.pipeline.protocol import Command

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoints["frontend"])
    protocol.send(sock, Command.STATS, {})
    assert sock.poll(5000)
    stats = protocol.recv(sock).body["stats"]
    sock.close(0)
    for key in ("queued", "in_flight", "completed", "discarded", "workers", "students", "completed_per_s"):
        assert key in stats
    assert stats["queued"] == 2 and stats["students"] == 1
    assert broker.stats.queued == 2
    client.close()
    broker.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slot_count", [1, 3])
def test_a_batch_larger_than_the_pool_recycles_its_slots(endpoints, broker_kwargs, slot_count: int) -> None:
    """Each ready chunk is asked for again as soon as it is copied: a batch of 8 fills
    from 1 or 3 slots, every sample exact and of the current model, none twice."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2).start()
    seen: set[int] = set()
    try:
        with StudentClient(0, 1, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"]) as client:
            client.hello()
            generation = client.set_model("small-pool")
            dataset = DistillIterableDataset(0, client.generation_value, slot_count, peers.batch_config(),
                                             endpoints["frontend"], batch_size=8, with_meta=True, timeout_s=60)
            batches = iter(dataset)
            try:
                for _ in range(25):
                    batch = next(batches)
                    assert len(batch["x"]) == 8
                    for x, req, gen in zip(batch["x"], batch["request_id"].tolist(),
                                           batch["generation"].tolist(), strict=True):
                        assert gen == generation and req not in seen
                        assert torch.equal(x, peers.expected_x(req, generation)), f"request {req} torn"
                        seen.add(req)
            finally:
                batches.close()
    finally:
        worker.stop()
        broker.stop()
    assert len(seen) == 200 and broker.stats.failed == 0
