"""Group 4 of the hardening issue (broker side): a medium belongs to the student that
first asked for its slots.

Another connection's REQUEST for slots of it (at its stride, or at another that puts
a header inside a neighbouring slot) used to reach a real worker, which wrote into the
sample the owner was holding. Now it is refused before any worker sees it.
"""

from __future__ import annotations

import pytest
import torch

from distill.pipeline import Broker, StudentClient, Worker
from distill.pipeline.protocol import Command
from tests import peers
from tests.hostile import Peer, request

pytestmark = pytest.mark.timeout(60)


def test_a_request_for_another_student_s_medium_never_reaches_a_worker(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2).start()
    impostor = Peer(endpoints["frontend"], "student-evil")
    try:
        with StudentClient(0, 4, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
            client.hello()
            generation = client.set_model("m")
            held = client.request_sample(timeout_ms=20_000)
            while held is not None and held.slot_id == 0:  # hold a slot with a neighbour before it
                client.release_slot(held.slot_id)
                held = client.request_sample(timeout_ms=20_000)
            assert held is not None
            medium, stride = client._pool.medium.buf_name, client._pool.medium.slot_stride
            for req, slot_stride in ((777, stride), (778, stride + 64)):
                impostor.send(Command.REQUEST, request("student-evil", medium, [[held.slot_id, req]],
                                                       stride=slot_stride))
            replies = []
            while (reply := impostor.recv(timeout_s=1.0)) is not None:
                replies.append(reply)
            assert torch.equal(held.tensors["x"], peers.expected_x(held.request_id, generation)), \
                f"a worker wrote into the sample the owner holds (the impostor was answered {replies})"
            assert [r.command for r in replies] == [Command.ERROR] * 2, replies
            assert all("belongs to another student connection" in r.body["reason"] for r in replies), replies
            client.release_slot(held.slot_id)
            peers.consume_verified(client, generation, 40)  # every slot (and its header) intact
        assert broker.stats.foreign == 2
    finally:
        impostor.close()
        worker.stop()
        broker.stop()


def test_the_owner_cannot_change_its_medium_s_stride_or_name_slots_past_the_cap(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, max_slots_per_medium=64).start()
    owner = Peer(endpoints["frontend"], "student-owner")
    try:
        owner.send(Command.REQUEST, request("student-owner", "dst_own_1_1", [[0, 1]], stride=4160))
        owner.send(Command.REQUEST, request("student-owner", "dst_own_1_1", [[1, 2]], stride=4160 + 64))
        assert "asked for with stride 4160" in owner.expect(Command.ERROR).body["reason"]
        owner.send(Command.REQUEST, request("student-owner", "dst_own_1_1", [[64, 3]], stride=4160))
        assert "max_slots_per_medium" in owner.expect(Command.ERROR).body["reason"]
        assert broker.stats.queued == 1
    finally:
        owner.close()
        broker.stop()
