"""Malformed, unknown and out-of-bounds messages are refused with an error reply, and
the broker and worker keep serving correctly afterwards."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from distill.pipeline import Broker, StudentClient, Worker, protocol
from distill.pipeline.mediums.shm import SharedMemoryManager
from distill.pipeline.protocol import PROTOCOL_TAG, Command
from distill.pipeline.slot import HEADER_BYTES, HeaderTable, check_slot, slot_stride
from tests import peers

GARBAGE = [
    [b"hello"],
    [PROTOCOL_TAG, b"REQUEST"],
    [b"XXX\x09", b"REQUEST", msgpack.packb({})],
    [PROTOCOL_TAG, b"FROBNICATE", msgpack.packb({})],
    [PROTOCOL_TAG, b"REQUEST", b"\xc1"],
    [PROTOCOL_TAG, b"REQUEST", msgpack.packb({"run_id": "r", "peer_id": "p", "generation": 0,
                                              "medium": "m", "stride": -5, "slots": []})],
    [PROTOCOL_TAG, b"REQUEST", msgpack.packb({"run_id": "r", "peer_id": "p", "generation": 0,
                                              "medium": "m", "stride": 8, "slots": [[0, 1]]})],
    [PROTOCOL_TAG, b"WORK", msgpack.packb({"work_id": 1, "run_id": "r", "generation": 1, "model_id": "m",
                                           "items": []})],  # a worker command sent to the wrong socket
]


def _send_and_expect_error(sock: zmq.Socket, frames: list[bytes]) -> str:
    sock.send_multipart(frames)
    assert sock.poll(5000), f"no answer to {frames!r}"
    reply = protocol.recv(sock)
    assert reply.command is Command.ERROR
    return reply.body["reason"]


@pytest.mark.parametrize("socket_name", ["frontend", "backend", "control"])
def test_broker_refuses_garbage_and_keeps_serving(socket_name, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoints[socket_name])
    reasons = [_send_and_expect_error(sock, frames) for frames in GARBAGE]
    assert any("frames" in r for r in reasons) and any("unknown command" in r for r in reasons)
    sock.close(0)
    assert broker.stats.bad_messages == len(GARBAGE)
    # still serves a normal exchange
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]).start()
    with StudentClient(0, 4, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        client.hello()
        gen = client.set_model("m")
        for _ in range(20):
            ref = client.request_sample(timeout_ms=5000)
            assert ref is not None
            assert torch.equal(ref.tensors["x"], peers.expected_x(ref.request_id, gen))
            client.release_slot(ref.slot_id)
    worker.stop()
    broker.stop()


def test_worker_refuses_bad_addresses_and_never_writes_outside_its_slot(endpoints) -> None:
    """A fake broker hands a real worker garbage and out-of-bounds WORK."""
    config = peers.batch_config()
    ctx = zmq.Context.instance()
    backend = ctx.socket(zmq.ROUTER)
    backend.bind(endpoints["backend"])
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoints["control_pub"])
    worker = Worker(batch_fn=peers.fill_targets, batch_config=config, backend_endpoint=endpoints["backend"],
                    control_pub_endpoint=endpoints["control_pub"]).start()
    identity, ready = _recv_skipping_heartbeats(backend)
    assert ready.command is Command.READY
    stride = slot_stride(config.nbytes())
    with SharedMemoryManager(slot_count=2, slot_stride=stride) as shm:
        canary = bytes(range(256)) * (stride // 256) + bytes(stride % 256)
        shm.slot_view(1)[:] = canary
        HeaderTable(shm.slot_view(0), stride).ask([0], [6])  # the good item's fill, as its student asks
        backend.send_multipart([identity, PROTOCOL_TAG, b"WORK", b"\xc1"])
        _, err = _recv_skipping_heartbeats(backend)
        assert err.command is Command.ERROR and "msgpack" in err.body["reason"]
        bad_items = [
            ["psm_not_ours", 0, stride, 1],          # foreign segment name
            ["dst_nobody_1_1", 0, stride, 2],        # ours in form, but does not exist
            [shm.buf_name, 2, stride, 3],            # slot index past the end
            [shm.buf_name, 1, stride * 2, 4],        # a stride that puts slot 1 past the end
            [shm.buf_name, 0, HEADER_BYTES + 8, 5],  # stride too small for the payload
            [shm.buf_name, 0, stride, 6],            # the one good item
        ]
        protocol.send(backend, Command.WORK, {"work_id": 7, "run_id": "r", "generation": 1, "model_id": "m",
                                              "items": bad_items}, identity=identity)
        _, done = _recv_skipping_heartbeats(backend)
        assert done.command is Command.DONE and done.body["work_id"] == 7
        failed = dict(done.body["failed"])
        assert set(failed) == {0, 1, 2, 3, 4}, failed
        assert check_slot(shm.slot_view(0), 1, 6, config.nbytes()) is None
        assert bytes(shm.slot_view(1)) == canary  # nothing written outside the good slot
    worker.stop()
    backend.close(0)
    pub.close(0)


def _recv_skipping_heartbeats(sock: zmq.Socket) -> tuple[bytes, protocol.Message]:
    while True:
        assert sock.poll(5000)
        identity, msg = protocol.recv_routed(sock)
        assert not isinstance(msg, protocol.ProtocolError)
        if msg.command is Command.HEARTBEAT:
            protocol.send(sock, Command.HEARTBEAT, {"peer_id": "fake", "role": "broker"}, identity=identity)
            continue
        return identity, msg
