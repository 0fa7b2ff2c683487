"""Exact delivery across real processes: nothing lost, duplicated, corrupted or stale."""

from __future__ import annotations

import pytest

from distill.pipeline import Broker, StudentClient
from tests import peers

SLOT_COUNT = 32


@pytest.mark.parametrize("batch_size", [16, None], ids=["batched", "per-sample"])
def test_two_workers_two_students_dataloader_workers(procs, endpoints, broker_kwargs, batch_size) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    for _ in range(2):
        procs.start(peers.run_worker, endpoints, name="worker")
    from tests.conftest import SPAWN

    results = SPAWN.Queue()
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
