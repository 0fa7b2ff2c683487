"""Direct completion notices (``distill.pipeline.notices``) with a real broker, real
workers (in their own processes) and real students: the worker tells the student
itself, the broker only counts, and every way the shortcut can fail falls back to
the broker's COMPLETE without losing, doubling or tearing a sample."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import msgpack
import pytest

from distill.pipeline import Broker, StudentClient, Worker, notices, protocol
from distill.pipeline.mediums.shm import sweep_orphans
from distill.pipeline.notices import (
    NoticeInbox,
    NoticeOutbox,
    RequestLane,
    encode_datagram,
    encode_notice,
    notice_path,
    sweep_inboxes,
)
from distill.pipeline.protocol import Command
from distill.pipeline.student.slots import SlotState
from tests import peers

pytestmark = pytest.mark.timeout(120)


def _client(endpoints: dict[str, str], slot_count: int = 8, **kwargs: object) -> StudentClient:
    client = StudentClient(0, slot_count, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], **kwargs)
    client.hello()
    return client


def _worker_process(procs, endpoints: dict[str, str], **kwargs: object):
    return procs.start(peers.run_worker, endpoints, name="worker", **kwargs)


def test_a_local_worker_completes_slots_past_the_broker(procs, endpoints, broker_kwargs) -> None:
    """Notices alone (no direct requests): every fill dispatched by the broker is told directly."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    _worker_process(procs, endpoints, direct_requests=False)
    with _client(endpoints) as client:
        generation = client.set_model("direct")
        peers.consume_verified(client, generation, 400)
        counts = client._pool.counts
        deadline = time.monotonic() + 10
        while broker.stats.notified < 400 and time.monotonic() < deadline:
            time.sleep(0.01)  # a DONE follows its notice: the broker may not have counted the last ones
        stats = broker.stats
    broker.stop()
    assert counts["notices"] > 0 and counts["rejected"] == 0
    assert stats.notified >= 400 and stats.notified == stats.completed  # every one told directly
    assert stats.failed == 0 and stats.bad_messages == 0


@pytest.mark.parametrize("side", ["student", "worker"])
def test_notices_turned_off_go_through_the_broker(procs, endpoints, broker_kwargs, side: str) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2, notices=side != "worker").start()
    try:
        with _client(endpoints, notices=side != "student") as client:
            generation = client.set_model(f"relay-{side}")
            peers.consume_verified(client, generation, 200)
            assert client._pool.counts["notices"] == 0
    finally:
        worker.stop()
        broker.stop()
    assert broker.stats.notified == 0 and broker.stats.completed >= 200


@pytest.fixture
def socket_dirs():
    """Two short private directories (a Unix socket path has at most 107 bytes)."""
    dirs = [Path(tempfile.mkdtemp(prefix="dn-")) for _ in range(2)]
    yield dirs
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("worker_looks", ["same", "elsewhere"])
def test_inboxes_live_in_the_socket_dir_both_sides_are_given(endpoints, broker_kwargs, socket_dirs,
                                                            worker_looks: str) -> None:
    """``socket_dir`` (the app's ``pipeline.socket_dir``) moves the inbox; a worker
    told the same directory notifies, one that looks elsewhere leaves it to the broker."""
    student_dir, other_dir = socket_dirs
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2,
                    socket_dir=student_dir if worker_looks == "same" else other_dir).start()
    try:
        with _client(endpoints, socket_dir=str(student_dir)) as client:
            inbox = client._pool._inbox.path
            assert inbox.parent == student_dir and inbox.is_socket()
            assert not notice_path(client._pool.medium.buf_name).exists()  # not in the default directory
            generation = client.set_model(f"dir-{worker_looks}")
            peers.consume_verified(client, generation, 200)
            notices_taken = client._pool.counts["notices"]
        assert not inbox.exists()  # closing the pool removed it
    finally:
        worker.stop()
        broker.stop()
    if worker_looks == "same":
        assert notices_taken > 0 and broker.stats.notified > 0
    else:
        assert notices_taken == 0 and broker.stats.notified == 0 and broker.stats.completed >= 200


def test_an_inbox_that_vanishes_falls_back_to_the_broker(procs, endpoints, broker_kwargs) -> None:
    """Notices alone: with its inbox file gone (and the student not binding it again:
    only direct requests need that) every completion comes from the broker."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    _worker_process(procs, endpoints, direct_requests=False)
    with _client(endpoints, direct_requests=False) as client:
        generation = client.set_model("vanish")
        seen = peers.consume_verified(client, generation, 100)
        notified = broker.stats.notified
        assert notified > 0
        client._pool._inbox.path.unlink()  # the worker's sends now fail: ENOENT
        peers.consume_verified(client, generation, 400, seen=seen)
        stats = broker.stats
    broker.stop()
    assert stats.completed - stats.notified >= 250  # answered by the broker's COMPLETE
    assert stats.notified - notified <= 40  # at most what was in flight when it vanished


def test_failed_slots_of_a_notified_work_still_reach_the_student(endpoints, broker_kwargs) -> None:
    """A generator that overflows every third slot: the good slots are told directly,
    the failed ones by the broker (ok=false), and the student asks for them again."""
    calls = iter(range(10**9))

    def sometimes_too_big(model_id: str, model_cfg: dict | None) -> bytes:
        size = peers.batch_config().nbytes() + (1 if next(calls) % 3 == 0 else 0)
        return bytes(size)

    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(sometimes_too_big, slot_size=peers.batch_config().nbytes(), max_batch=4,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2, direct_requests=False).start()
    try:
        with _client(endpoints, slot_count=4) as client:
            client.set_model("flaky")
            for _ in range(120):  # 4 slots: a failed slot not asked for again would stall this
                ref = client.request_sample(timeout_ms=10_000)
                assert ref is not None, "a failed slot was never answered"
                client.release_slot(ref.slot_id)
            counts = client._pool.counts
    finally:
        worker.stop()
        broker.stop()
    assert counts["failed"] >= 30 and counts["notices"] > 0
    assert broker.stats.failed >= counts["failed"] and broker.stats.notified >= 100


def test_bad_notices_are_ignored_and_forged_ones_do_not_release_a_slot(procs, endpoints, broker_kwargs) -> None:
    """Garbage, other commands, foreign request ids and a COMPLETE for a slot nobody
    wrote: none crashes the student, none is delivered, and the slot a forged notice
    names is not asked for again (that could put two writers on it)."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    with _client(endpoints, slot_count=2) as client:
        generation = client.set_model("forged")
        assert client.request_sample(timeout_ms=200) is None  # no worker yet: both slots pending
        pool = client._pool
        pending = _pending(pool)
        assert len(pending) == 2
        slot, request_id = next(iter(pending.items()))
        garbage = [
            b"not msgpack \xc1",
            msgpack.packb([b"only", b"two"]),
            msgpack.packb(protocol.encode(Command.HEARTBEAT, {"peer_id": "x", "role": "worker"})),
            msgpack.packb(protocol.encode(Command.COMPLETE, {"generation": generation, "slots": [[1, 2]]})),
            encode_notice(generation, [[slot, request_id + 12345, True]]),  # not the request pending
            encode_notice(generation, [[99, 1, True]]),  # not our slot
            encode_notice(generation, [[slot, request_id, True]]),  # pending, but nobody wrote it
        ]
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for datagram in garbage:
            sender.sendto(datagram, os.fspath(pool._inbox.path))
        sender.close()
        assert client.request_sample(timeout_ms=500) is None  # nothing delivered
        assert pool.counts["notices"] == 3 and pool.counts["rejected"] == 3
        assert _pending(pool) == pending  # not asked for again: a worker may be on its way
        assert not pool.slots.check()
        assert broker.stats.requested == 2
        _worker_process(procs, endpoints)
        seen = peers.consume_verified(client, generation, 200)
    broker.stop()
    assert request_id in seen  # the slot the forgery named was filled and delivered once


def _pending(pool) -> dict[int, int]:
    """slot -> request id of the pool's PENDING slots."""
    return {r.idx: r.request_id for r in pool.slots.in_state(SlotState.PENDING)}


def test_the_inbox_is_private_and_cleaned_up(tmp_path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    assert NoticeInbox.open("dst_x_1_1", open_dir) is None  # other users could send to it
    assert NoticeInbox.open("dst_" + "x" * 200, tmp_path / "private") is None  # path too long
    inbox = NoticeInbox.open("dst_x_1_2", tmp_path / "private")
    assert inbox is not None
    assert (tmp_path / "private").stat().st_mode & 0o077 == 0
    assert inbox.path.exists()
    inbox.close()
    inbox.close()
    assert not inbox.path.exists()


def test_a_crashed_owners_inbox_is_swept_with_its_segment(procs) -> None:
    proc = procs.start(peers.run_segment_owner, name="owner")
    deadline = time.monotonic() + 30
    name = None
    while name is None and time.monotonic() < deadline:
        name = next((n for n in os.listdir("/dev/shm") if n.startswith(f"dst_owner_{proc.pid}_")), None)
        time.sleep(0.05)
    assert name is not None, "the owner never made its segment"
    while not notice_path(name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    procs.join(proc, 10, expect_code=None)
    assert name in sweep_orphans(min_age_s=0)
    assert not notice_path(name).exists()
    assert not os.path.exists(f"/dev/shm/{name}")



def test_sweep_takes_only_inboxes_whose_segment_is_gone(tmp_path) -> None:
    for name in ("dst_gone_1_1", "dst_live_1_1"):
        (tmp_path / f"{name}.notice").touch()
    (tmp_path / "frontend.sock").touch()
    assert sweep_inboxes(lambda segment: segment == "dst_live_1_1", tmp_path, min_age_s=0) == ["dst_gone_1_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst_live_1_1.notice", "frontend.sock"]
    (tmp_path / "dst_young_1_1.notice").touch()
    assert sweep_inboxes(lambda segment: False, tmp_path, min_age_s=60) == []  # its owner may be binding it


def test_sweep_takes_lanes_nobody_is_bound_to(tmp_path) -> None:
    """A killed worker leaves its lane's file: nobody answers there, so it goes; a live
    worker's lane stays."""
    (tmp_path / "worker-1-dead.lane").touch()
    live = RequestLane.open("worker-2-live", tmp_path)
    try:
        assert sweep_inboxes(lambda segment: True, tmp_path, min_age_s=0) == ["worker-1-dead.lane"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-2-live.lane"]
    finally:
        live.close()


def test_a_lane_that_shuts_gives_back_what_was_queued_and_takes_no_more(tmp_path) -> None:
    """A stopping worker removes its lane's file first (a student's send then fails and it
    asks the broker) and gets every DIRECT already queued, to decline it."""
    lane = RequestLane.open("worker-3-x", tmp_path)
    inbox = NoticeInbox.open("dst_s_1_1", tmp_path)
    try:
        direct = encode_datagram(Command.DIRECT, {"run_id": "r", "peer_id": "p", "generation": 1,
                                                  "medium": "dst_s_1_1", "stride": 4160, "slots": [[0, 5]]})
        assert inbox.send_to(os.fspath(lane.path), direct)
        assert inbox.send_to(os.fspath(lane.path), b"garbage")  # dropped, not returned
        assert inbox.present()
        waiting = lane.shut()
        assert [m.body["slots"] for m in waiting] == [[[0, 5]]]
        assert not lane.path.exists()
        assert not inbox.send_to(os.fspath(lane.path), direct)
        inbox.path.unlink()
        assert not inbox.present()
    finally:
        inbox.close()


def test_a_notice_an_inbox_could_not_read_whole_is_not_sent(tmp_path, monkeypatch) -> None:
    """An inbox reads at most MAX_NOTICE_BYTES and would drop a truncated datagram, so
    a larger notice goes through the broker (the kernel's send buffer, usually smaller,
    hides this bound on most machines: here it is lowered below the kernel's)."""
    inbox = NoticeInbox.open("dst_big_1_1", tmp_path)
    outbox = NoticeOutbox(tmp_path)
    monkeypatch.setattr(notices, "MAX_NOTICE_BYTES", 256)
    try:
        assert outbox.send("dst_big_1_1", 1, [[0, 2**55, True]])
        assert not outbox.send("dst_big_1_1", 1, [[slot, 2**55 + slot, True] for slot in range(20)])
        assert [m.body["slots"] for m in inbox.receive()] == [[[0, 2**55, True]]]
        assert (outbox.sent, outbox.missed) == (1, 1)
    finally:
        outbox.close()
        inbox.close()
