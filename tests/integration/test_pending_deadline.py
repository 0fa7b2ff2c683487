"""Group 6 of issue 21 (the student's side): no slot stays pending forever.

- A worker that says DONE for a slot, claiming it told the student directly
  (``notified``), but never sent the notice nor wrote the slot: the broker completes
  nothing, and before the fix the slot waited forever. Once the student's other slot
  is served again (progress without it), the pending-slot deadline looks at it, finds
  nobody writing it, asks again (one log line), and another worker fills it.
- A worker whose samples are smaller than the student's slots: before the fix its
  direct notice was refused and the slot left pending forever. Now it refuses the
  segment, naming both sizes (its log line), and another worker fills the slot.

Real broker and worker processes; the misbehaving peers run in the test process.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
import zmq

from distill.pipeline import StudentClient, Worker, protocol
from distill.pipeline.protocol import Command
from tests import peers

DEADLINE_S = 1.0


def _client(endpoints: dict[str, str], slot_count: int = 1, **kwargs: object) -> StudentClient:
    return StudentClient(0, slot_count, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], heartbeat_interval_s=0.2, **kwargs)


def _lying_worker(endpoints: dict[str, str]) -> zmq.Socket:
    """A backend peer with more credit than any worker, ready for one WORK."""
    sock = protocol.configure(zmq.Context.instance().socket(zmq.DEALER))
    sock.connect(endpoints["backend"])
    protocol.send(sock, Command.READY, {"peer_id": "liar", "credit": 1000, "max_batch": 1})
    return sock


def _lie_once(sock: zmq.Socket, timeout_s: float = 20) -> str:
    """Take one WORK, say DONE "notified" without writing or notifying, then take no more."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert sock.poll(max(0.0, deadline - time.monotonic()) * 1000), "the lying worker got no WORK"
        msg = protocol.recv(sock)
        if msg.command is Command.WORK:
            break
    medium = msg.body["items"][0][0]
    protocol.send(sock, Command.DONE, {"peer_id": "liar", "work_id": msg.body["work_id"],
                                       "num_items": len(msg.body["items"]), "failed": [], "notified": [medium]})
    protocol.send(sock, Command.READY, {"peer_id": "liar", "credit": 0, "max_batch": 1})
    return medium


@pytest.mark.timeout(60)
def test_a_notice_that_never_comes_is_asked_again_at_the_deadline(procs, endpoints, caplog) -> None:
    procs.start(peers.run_broker, endpoints, name="broker")
    liar = _lying_worker(endpoints)
    try:
        with _client(endpoints, slot_count=2, pending_deadline_s=DEADLINE_S) as client, \
                caplog.at_level(logging.WARNING, logger="distill.pipeline.student.pool"):
            client.hello()
            generation = client.set_model("m")
            assert client.request_sample(timeout_ms=100) is None  # both slots went to the liar
            _lie_once(liar)
            procs.start(peers.run_worker, endpoints, name="worker")
            started, slots, seen = time.monotonic(), set(), set()
            while slots != {0, 1}:  # the slot of the notice that never came is in use again
                assert time.monotonic() - started < 15, "the slot of a notice that never came stayed pending"
                ref = client.request_sample(timeout_ms=5_000)
                assert ref is not None and ref.generation == generation
                assert torch.equal(ref.tensors["x"], peers.expected_x(ref.request_id, generation))
                assert ref.request_id not in seen
                seen.add(ref.request_id)
                slots.add(ref.slot_id)
                client.release_slot(ref.slot_id)
            assert client._pool.counts["overdue"] >= 1
            lines = [r for r in caplog.records if "pending for more than" in r.getMessage()]
            assert len(lines) == 1, [r.getMessage() for r in lines]
            assert not client._pool.slots.check()
    finally:
        liar.close(0)


def test_a_worker_with_smaller_samples_refuses_the_slot_and_another_fills_it(procs, endpoints, caplog) -> None:
    config = peers.batch_config()
    small = Worker(lambda model_id, model_cfg: bytes(config.nbytes() - 64), slot_size=config.nbytes() - 64,
                   backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                   max_batch=1, prefetch_batches=1, heartbeat_interval_s=0.2)
    procs.start(peers.run_broker, endpoints, name="broker")
    with caplog.at_level(logging.WARNING):
        small.start()
        try:
            with _client(endpoints) as client:
                client.hello()
                generation = client.set_model("m")
                assert client.request_sample(timeout_ms=500) is None  # only the small worker: refused
                procs.start(peers.run_worker, endpoints, name="worker")
                peers.consume_verified(client, generation, 20, timeout_ms=20_000,
                                       what="the slot a smaller sample was written for stayed pending")
                assert client._pool.counts["failed"] >= 1
        finally:
            small.stop()
    sizes = f"{config.nbytes()}-byte samples, this worker makes {config.nbytes() - 64}"
    assert any(sizes in r.getMessage() for r in caplog.records), "no log line names both sample sizes"
