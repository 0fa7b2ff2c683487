"""Faults the base pipeline must survive: a worker killed mid-batch, a generator that
always fails, and the reused-batch fast path used where it would be unsafe."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from distill.pipeline import Broker, DistillIterableDataset, StudentClient, Worker
from distill.pipeline.student import delivery as delivery_module
from distill.pipeline.student.slots import SlotState
from tests import peers


def test_worker_killed_mid_batch_its_slots_are_redone(procs, endpoints, broker_kwargs, tmp_path: Path) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    busy = tmp_path / "busy"
    frozen = procs.start(peers.run_freezing_worker, endpoints, str(busy), name="frozen")
    with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("m")
        assert client.request_sample(timeout_ms=100) is None  # all 8 slots are with the frozen worker
        _wait_for(busy.exists, 60, "the worker to start its batch")
        procs.start(peers.run_worker, endpoints, name="healthy", heartbeat_interval_s=0.2)
        held_by_killed = _pending_requests(client)
        claimed = int(busy.read_text())
        assert claimed == 4  # the student's fair share: 8 slots, at most half to one writer
        os.kill(frozen.pid, signal.SIGKILL)
        seen = peers.consume_verified(client, generation, 50, timeout_ms=20_000,
                                      what="slots of the killed worker were never redone")
        assert held_by_killed <= seen, "requests of the killed worker were lost"
        # Its claims name a dead writer by the time the broker gives up on it: nothing
        # needs quarantine, every slot is asked for again at once.
        assert client._pool.counts["quarantined"] == 0
        assert not client._pool.slots.check()
    # 8, and the slots it never claimed that were asked for again (overdue) while it hung
    # and went to it once more (its heartbeats went on: it had credit).
    assert broker.stats.quarantined >= 8
    broker.stop()


def _pending_requests(client: StudentClient) -> set[int]:
    return {r.request_id for r in client._pool.slots.in_state(SlotState.PENDING)}


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_frozen_worker_resumed_late_never_corrupts_a_yielded_sample(procs, endpoints, broker_kwargs,
                                                                      tmp_path: Path) -> None:
    """SIGSTOP a worker in the middle of writing its slots until the broker declares it
    dead, let another worker serve, then SIGCONT it: its late writes land only in
    quarantined slots, its late DONE completes nothing, and its requests are redone."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    mid_write = tmp_path / "mid_write"
    zombie = procs.start(peers.run_zombie_worker, endpoints, str(mid_write), name="zombie")
    with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("m")
        assert client.request_sample(timeout_ms=100) is None  # all 8 slots are with the zombie
        _wait_for(mid_write.exists, 60, "the zombie to start writing")
        os.kill(zombie.pid, signal.SIGSTOP)
        held_by_zombie = _pending_requests(client)
        procs.start(peers.run_worker, endpoints, name="healthy", heartbeat_interval_s=0.2)
        _wait_for(lambda: broker.stats.quarantined + broker.stats.requeued >= 8, 30, "the zombie's purge")
        _wait_for(lambda: broker.stats.workers == 1, 60, "the healthy worker")

        def verify(ref) -> None:
            assert torch.equal(ref.tensors["x"], peers.expected_x(ref.request_id, generation)), \
                f"slot {ref.slot_id} (request {ref.request_id}) holds a torn or foreign sample"

        held = []  # whatever the healthy worker delivers while the zombie is frozen
        while len(held) < 8 and (ref := client.request_sample(timeout_ms=1500)) is not None:
            verify(ref)
            held.append(ref)
        os.kill(zombie.pid, signal.SIGCONT)
        _wait_for((tmp_path / "mid_write.written").exists, 30, "the zombie's late writes")
        for ref in held:  # the zombie wrote its second halves while these were held
            verify(ref)
        _wait_for(lambda: broker.stats.released >= 8, 30, "the zombie's late DONE")
        seen = {ref.request_id for ref in held}
        for ref in held:
            client.release_slot(ref.slot_id)
        peers.consume_verified(client, generation, 40, seen=seen, timeout_ms=20_000,
                               what="slots were never filled again after the zombie came back")
        assert held_by_zombie <= seen, "requests the zombie held were lost"
        # It had claimed its fair share (4 of 8) when it froze: those 4 were quarantined and
        # released by its late DONE; the 4 it never claimed were asked for again at once.
        counts = client._pool.counts
        assert counts["quarantined"] == 4 and counts["released"] == 4, counts
        assert not client._pool.slots.check()
    stats = broker.stats
    assert stats.quarantined == 8 and stats.released == 8 and stats.failed == 0
    broker.stop()


def test_a_generator_that_always_fails_ends_in_a_clear_error(monkeypatch, endpoints, broker_kwargs) -> None:
    monkeypatch.setattr(delivery_module, "BACKOFF_MAX_S", 0.01)
    monkeypatch.setattr(delivery_module, "MAX_CONSECUTIVE_FAILURES", 40)
    broker = Broker(**broker_kwargs).start()

    def broken(model_id: str, model_cfg: dict | None) -> bytes:
        raise OSError("disk on fire")

    worker = Worker(generator_fn=broken, slot_size=peers.batch_config().nbytes(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]).start()
    with StudentClient(0, 4, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        client.hello()
        client.set_model("m")
        with pytest.raises(RuntimeError, match="failed 40 fills in a row"):
            for _ in range(1000):
                client.request_sample(timeout_ms=200)
    worker.stop()
    broker.stop()
    assert broker.stats.failed >= 40


def test_reused_batches_are_exact_and_refused_in_dataloader_workers(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]).start()
    with StudentClient(0, 1, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        client.hello()
        client.set_model("m")
        dataset = DistillIterableDataset(0, client.generation_value, 16, peers.batch_config(),
                                         endpoints["frontend"], batch_size=8, reuse_batches=True,
                                         with_meta=True, timeout_s=30)
        it = iter(dataset)
        first = next(it)
        x_ptr = first["x"].data_ptr()
        for _ in range(5):
            batch = next(it)
            assert batch["x"].data_ptr() == x_ptr  # the same tensors, refilled
            for x, req, gen in zip(batch["x"], batch["request_id"], batch["generation"], strict=True):
                assert torch.equal(x, peers.expected_x(int(req), int(gen)))
        it.close()
        loader = DataLoader(dataset, batch_size=None, num_workers=1)
        with pytest.raises(ValueError, match="reuse_batches"):
            next(iter(loader))
    worker.stop()
    broker.stop()


def test_broker_killed_and_restarted_everyone_rejoins(procs, endpoints) -> None:
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_worker, endpoints, name="worker", heartbeat_interval_s=0.2)
    with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("layer_3")

        def consume(count: int) -> None:
            for _ in range(count):
                ref = client.request_sample(timeout_ms=30_000)
                assert ref is not None, "no sample after the broker came back"
                assert ref.generation == generation  # the run's model and generation survived
                assert torch.equal(ref.tensors["x"], peers.expected_x(ref.request_id, ref.generation))
                client.release_slot(ref.slot_id)

        consume(100)
        os.kill(broker.pid, signal.SIGKILL)
        broker.join(10)
        procs.start(peers.run_broker, endpoints, name="broker2")
        consume(100)
