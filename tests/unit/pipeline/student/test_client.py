"""The student's side in one process: StudentClient's config (and the seed README's
arguments), where its generation may come from (the leader's switches and the broker,
never a datagram), a switch on a restarted broker, a follower that missed the switch's
broadcast, and the SlotPool's requests (random ids, consecutive fill numbers, asked
headers). Real in-process brokers and sockets."""

from __future__ import annotations

import os
import socket
import time

import pytest

from distill.pipeline import Broker, PoolConfig, SlotPool, StudentClient, StudentClientConfig
from distill.pipeline.notices import encode_notice
from distill.pipeline.slot import read_claim
from distill.pipeline.student.slots import SlotState
from tests import peers


def _client(endpoints: dict[str, str], rank: int = 0, **kwargs: object) -> StudentClient:
    return StudentClient(rank, 2, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], heartbeat_interval_s=0.2, **kwargs)


def test_the_seed_readme_arguments_and_a_config_object_make_the_same_client(endpoints) -> None:
    config = StudentClientConfig(student_rank=0, slot_count=2, batch_config=peers.batch_config(),
                           frontend_endpoint=endpoints["frontend"], control_endpoint=endpoints["control"],
                           control_pub_endpoint=endpoints["control_pub"], heartbeat_interval_s=0.2)
    with _client(endpoints) as readme, StudentClient(config=config) as configured:
        assert readme.config == configured.config
        assert configured.student_rank == 0 and configured._pool.config.slot_count == 2
    with pytest.raises(TypeError, match="slot_cont.*StudentClientConfig"):
        StudentClient(0, 2, peers.batch_config(), slot_cont=3)
    with pytest.raises(ValueError, match=r"needs batch_config \(the seed"):
        StudentClient(0)


def test_a_switch_on_a_restarted_broker_gets_a_generation_above_every_one_seen(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    with _client(endpoints) as leader:
        leader.hello()
        assert leader.set_model("layer_1") == 1 and leader.set_model("layer_2") == 2
        broker.stop()
        broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()  # counts from 0 again
        assert leader.set_model("layer_3") == 3  # not 1: generation 2 still names layer_2 everywhere
        assert broker.stats.per_run["default"]["generation"] == 3
    broker.stop()


def test_a_follower_that_missed_the_broadcast_learns_the_generation_from_the_broker(endpoints,
                                                                                    broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    with _client(endpoints) as leader, _client(endpoints, rank=1) as follower:
        leader.hello()
        follower.hello()
        generation = leader.set_model("m")  # published before the follower subscribes
        follower.start_sub_listener()
        started = time.monotonic()
        assert follower.wait_generation(generation, timeout_s=10) == generation
        assert time.monotonic() - started < 5
    broker.stop()


def test_no_datagram_moves_the_generation(endpoints, broker_kwargs) -> None:
    """Group 5 at the pool: a forged notice of generation 2**62 (with and without the
    pending slots) reaches the inbox; the pool never calls note_generation with it."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    noted: list[int] = []
    pool = SlotPool(endpoints["frontend"], "default", 2, peers.batch_config().nbytes(), lambda: 1, noted.append,
                    heartbeat_interval_s=0.2)
    try:
        pool.request_free()
        pool.flush()
        waiting = [[r.idx, r.request_id, True] for r in pool.slots.records]
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for datagram in (encode_notice(2**62, []), encode_notice(2**62, waiting)):
            sender.sendto(datagram, os.fspath(pool._inbox.path))
        sender.close()
        assert pool.next_ready_many(2, 300) == []
        assert not any(g >= 2**62 for g in noted)
        assert [r.state for r in pool.slots.records] == [SlotState.PENDING] * 2
        assert pool.counts["rejected"] == 2 and not pool.slots.check()
    finally:
        pool.close()
        broker.stop()


def test_requests_have_random_ids_consecutive_fills_and_asked_headers(tmp_path) -> None:
    pool = SlotPool(config=PoolConfig(frontend_endpoint=f"ipc://{tmp_path}/nobody.sock", run_id="ids",
                                      slot_count=8, payload_bytes=64))
    try:
        pool.request_free()
        records = pool.slots.records
        assert [r.fill for r in records] == list(range(1, 9))
        assert len({r.request_id for r in records}) == 8
        assert all(read_claim(pool.medium.slot_view(r.idx)) == (0, r.request_id) for r in records)
        with pytest.raises(IndexError, match="not a slot handed out"):
            pool.release_many([0])  # PENDING, not OUT
        assert pool.config.pending_deadline_s is None and pool.custody.deadline_s() >= 2 * 3 * 1.0
    finally:
        pool.close()
    with pytest.raises(ValueError, match="pending_deadline_s"):
        PoolConfig(frontend_endpoint="ipc:///x", pending_deadline_s=0)
    with pytest.raises(ValueError, match="medium='udp'"):
        PoolConfig(frontend_endpoint="ipc:///x", medium="udp")
