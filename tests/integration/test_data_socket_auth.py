"""Group 7 of issue 21: the network medium's data sockets take samples from their
writers only.

- With CurveZMQ on for broker, worker and student, a peer without keys that knows the
  student's pending slots and request ids floods its data socket with forged samples
  (whole slots with headers that would check out) while a real remote worker serves:
  not one yielded sample is the forger's.
- Strangers that reach a data socket (CurveZMQ off) can make the student hold nothing:
  eight connections push 256 MiB of messages while the student is not reading; its
  memory does not grow by it, nothing reaches its slots, and what is refused is logged
  a bounded number of times (it was one line per message); a writer that holds the
  medium's key still delivers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import zmq

from distill.pipeline import Broker, SlotPool, StudentClient, protocol
from distill.pipeline.auth import CurveConfig, create_keys
from distill.pipeline.mediums.tcp import TcpSender, parse_medium
from distill.pipeline.slot import SLOT_MAGIC, SLOT_VERSION, slot_stride
from distill.pipeline.student.slots import SlotState
from tests import peers
from tests.procfs import rss_bytes

LOOPBACK = "127.0.0.1"
_FORGED_HEADER = struct.Struct("<4sHHQQQI4xQQQ")  # commit fields, writer, claim, fill
FORGER = 0x0BAD_0000_0001


def _forged_slot(stride: int, generation: int, request_id: int, payload_bytes: int) -> bytes:
    """A whole slot whose header would check out for (generation, request id): only its
    payload (all 0xff) is not what the worker would have written."""
    buf = bytearray(b"\xff" * stride)
    _FORGED_HEADER.pack_into(buf, 0, SLOT_MAGIC, SLOT_VERSION, 0, generation, request_id, payload_bytes, 0,
                             FORGER, FORGER, request_id)
    return bytes(buf)


@pytest.mark.timeout(90)
def test_a_keyless_peer_that_knows_the_request_ids_replaces_no_sample(procs, endpoints, broker_kwargs,
                                                                      tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    create_keys(keys, ["worker", "student"])
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2, curve=CurveConfig.from_keys_dir(keys)).start()
    procs.start(peers.run_worker, endpoints, name="remote", local_shm=False,
                curve=CurveConfig.from_keys_dir(keys, "worker"))
    stop = threading.Event()
    try:
        with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2, medium="tcp", tcp_host=LOOPBACK,
                           curve=CurveConfig.from_keys_dir(keys, "student")) as client:
            client.hello()
            generation = client.set_model("m")
            pool = client._pool
            forger = threading.Thread(target=_forge, args=(pool, generation, stop), daemon=True)
            forger.start()
            peers.consume_verified(client, generation, 200, what="no sample while a forger floods")
            stop.set()
            forger.join(10)
            assert pool.medium.counts["received"] >= 200  # every sample came over the data socket
    finally:
        stop.set()
        broker.stop()


def _forge(pool: SlotPool, generation: int, stop: threading.Event) -> None:
    """Push a forged slot for every pending slot, over and over, without keys."""
    medium = pool.medium
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(parse_medium(medium.buf_name).endpoint)
    try:
        while not stop.is_set():
            rows = [[r.idx, r.request_id] for r in list(pool.slots.records)
                    if r.state in (SlotState.PENDING, SlotState.AWAITING)]
            if rows:
                slots = [memoryview(_forged_slot(medium.slot_stride, generation, req, pool.payload_bytes))
                         for _, req in rows]
                with contextlib.suppress(zmq.Again):
                    push.send_multipart(protocol.encode_data(generation, medium.slot_stride, rows, slots),
                                        zmq.NOBLOCK)
            time.sleep(0.001)
    finally:
        push.close(0)


STRANGERS = 8
MESSAGES_EACH = 8
FRAMES_EACH = 4
FRAME_BYTES = 1 << 20


@pytest.mark.timeout(60)
def test_strangers_on_a_data_socket_make_the_student_hold_nothing(tmp_path: Path, caplog) -> None:
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    pool = SlotPool(f"ipc://{tmp_path}/frontend.sock", "strangers", 4, config.nbytes(), lambda: 1, lambda _: None,
                    medium="tcp", tcp_host=LOOPBACK)
    ctx = zmq.Context()
    pushes = []
    try:
        pool.request_free()  # asked for (not sent: there is no broker), so the slots wait for data
        endpoint = parse_medium(pool.medium.buf_name).endpoint
        before = rss_bytes(os.getpid())
        junk = [protocol.PROTOCOL_TAG, b"DATA", b"\xc1"] + [bytes(FRAME_BYTES)] * FRAMES_EACH
        with caplog.at_level(logging.WARNING, logger="distill.pipeline.mediums.tcp"):
            for _ in range(STRANGERS):
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.setsockopt(zmq.SNDHWM, MESSAGES_EACH)
                push.connect(endpoint)
                pushes.append(push)
            for push in pushes:
                for _ in range(MESSAGES_EACH):
                    try:
                        push.send_multipart(junk, zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
            time.sleep(1.5)  # the student is busy elsewhere: whatever the sockets take, it holds
            grown = rss_bytes(os.getpid()) - before
            assert grown < 64 << 20, f"the student holds {grown / 2**20:.0f} MiB of strangers' messages"
            assert pool.medium.receive(pool.slots.expected_request) == []
            refusals = [r for r in caplog.records if r.name == "distill.pipeline.mediums.tcp"]
            assert len(refusals) <= 20, f"{len(refusals)} log lines for refused data"
        # A writer with the medium's key is let in and delivers.
        record = pool.slots.records[0]
        sender = TcpSender()
        staged = sender.stage(stride)
        staged[:] = _forged_slot(stride, 1, record.request_id, config.nbytes())
        assert sender.send(pool.medium.buf_name, 1, stride, [[0, record.request_id]], [staged]) is None
        deadline = time.monotonic() + 10
        written = []
        while not written and time.monotonic() < deadline:
            written = pool.medium.receive(pool.slots.expected_request)
            time.sleep(0.02)
        sender.close()
        assert written == [0]
    finally:
        for push in pushes:
            push.close(0)
        ctx.term()
        pool.close()
