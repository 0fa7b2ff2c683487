"""Group 5 of issue 21: one datagram cannot stop a student.

A forged completion notice (COMPLETE, generation 2**62, no slots; and one naming the
slots and request ids the student waits for) and a forged DECLINED arrive in a live
student's inbox, where any process of the user can send. Only the broker's answers to
the leader (and its broadcasts) may move a generation, and only to a value the leader
set: the student's generation stays, samples keep coming, and the next switch is the
next generation, not 2**62 + 1. Real broker and worker processes.
"""

from __future__ import annotations

import os
import socket

import pytest

from distill.pipeline import StudentClient
from distill.pipeline.notices import encode_datagram, encode_notice
from distill.pipeline.protocol import Command
from tests import peers

WILD = 2**62


@pytest.mark.timeout(90)
def test_forged_datagrams_move_no_generation(procs, endpoints) -> None:
    procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_worker, endpoints, name="worker")
    with StudentClient(0, 4, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("m")
        seen = peers.consume_verified(client, generation, 20)
        pool = client._pool
        waiting = [[r.idx, r.request_id] for r in pool.slots.records if r.request_id]
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for datagram in (encode_notice(WILD, []),
                         encode_notice(WILD, [[slot, req, True] for slot, req in waiting]),
                         encode_datagram(Command.DECLINED, {"generation": WILD, "slots": waiting,
                                                            "reason": "forged"})):
            sender.sendto(datagram, os.fspath(pool._inbox.path))
        sender.close()
        peers.consume_verified(client, generation, len(seen) + 50, seen=seen,
                               what="no sample after a forged datagram")
        assert client.generation == generation
        assert client.set_model("m2") == generation + 1
        peers.consume_verified(client, generation + 1, 50, what="no sample after the next switch")
        assert not pool.slots.check()
