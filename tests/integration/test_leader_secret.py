"""Issue 37, item 1: one message took a run over.

A SET_MODEL with ``leader_epoch=2**63-1`` and ``min_generation=2**63-2``, from any
connection, used to be answered ``MODEL_SET 9223372036854775806``: the workers then
computed the attacker's model, the students yielded its samples, and the real leader,
even restarted, was refused for good. Now a run's leader is whoever holds the run's
secret, numbers move by one step, and, with keys on, a key is admitted only on the
sockets of its role. Real broker and worker processes, real clients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from distill.pipeline import Broker, StudentClient, Worker, protocol
from distill.pipeline.auth import CurveConfig, create_keys
from distill.pipeline.protocol import Command
from tests import peers
from tests.hostile import Peer, fetch_stats

HUGE_EPOCH = 2**63 - 1
HUGE_GENERATION = 2**63 - 2


def _leader(endpoints: dict[str, str], **options) -> StudentClient:
    return StudentClient(0, 4, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], heartbeat_interval_s=0.2, **options)


def _attack(endpoint: str, **fields) -> protocol.Message:
    """The finding's SET_MODEL, from a fresh connection; returns the broker's answer."""
    attacker = Peer(endpoint)
    try:
        attacker.send(Command.SET_MODEL, {"run_id": "default", "model_id": "evil", "model_cfg": {"evil": 1},
                                          "leader_epoch": HUGE_EPOCH, "min_generation": HUGE_GENERATION,
                                          "peer_id": "evil", **fields})
        answer = attacker.recv(5.0)
        assert answer is not None, "no answer to the attacker's SET_MODEL"
        return answer
    finally:
        attacker.close()


@pytest.mark.timeout(120)
def test_one_message_cannot_take_a_run_over(procs, endpoints) -> None:
    procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_worker, endpoints, name="worker")
    with _leader(endpoints) as leader:
        leader.hello()
        generation = leader.set_model("m")
        seen = peers.consume_verified(leader, generation, 20)
        for fields in ({}, {"leader_secret": "the-attackers-own-secret"},
                       {"leader_secret": "the-attackers-own-secret", "restore_generation": HUGE_GENERATION}):
            answer = _attack(endpoints["control"], **fields)
            assert answer.command is Command.ERROR, f"{fields}: answered {answer.command.name} {answer.body}"
        assert "leader secret does not match" in answer.body["reason"]
        stats = fetch_stats(endpoints["frontend"])
        assert stats is not None and stats["per_run"]["default"]["generation"] == generation
        assert stats["per_run"]["default"]["model_id"] == "m"
        # The real leader keeps its model; its students keep getting its samples.
        assert leader.generation == generation and leader.model_id == "m"
        peers.consume_verified(leader, generation, len(seen) + 50, seen=seen,
                               what="no sample after the attack")
        assert leader.set_model("m2") == generation + 1
        peers.consume_verified(leader, generation + 1, 30, what="no sample after the leader's switch")
        # Even one holding the secret cannot jump: numbers move by one step.
        answer = _attack(endpoints["control"], leader_secret=leader.leader_secret,
                         leader_epoch=leader.leader_epoch + 1)
        assert answer.command is Command.ERROR and "jumps past" in answer.body["reason"]
        # A restarted leader process (the same secret) goes on, at the next generation.
        with _leader(endpoints, leader_secret=leader.leader_secret) as restarted:
            assert restarted.set_model("m3") == generation + 2
            peers.consume_verified(restarted, generation + 2, 30, what="no sample for the restarted leader")


@pytest.mark.timeout(60)
def test_a_second_connection_without_the_runs_secret_is_refused(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    with _leader(endpoints) as leader, _leader(endpoints) as claimant:
        assert leader.set_model("m") == 1
        for epoch in (None, leader.leader_epoch + 1):
            claimant.leader_epoch = epoch if epoch is not None else protocol.TAKE_OVER_EPOCH
            with pytest.raises(RuntimeError, match="leader secret does not match"):
                claimant.set_model("other")
        with pytest.raises(RuntimeError, match="not its secret"):
            claimant.stop_workers()
        assert leader.set_model("m2") == 2
    assert broker.stats.per_run["default"]["model_id"] == "m2"
    broker.stop()


@pytest.fixture
def role_keys(tmp_path: Path) -> Path:
    """Keys issued for roles: 'worker' (a worker's) and 'student' (a student's)."""
    create_keys(tmp_path / "keys", ["worker", "student"], roles={"worker": "worker", "student": "student"})
    return tmp_path / "keys"


def _answered(endpoint: str, keys: CurveConfig, command: Command, body: dict) -> bool:
    """Whether the broker answers ``command`` sent with ``keys`` (a refused key: no handshake)."""
    peer = Peer(endpoint, keys=keys.client_keys())
    try:
        peer.sock.setsockopt(zmq.SNDTIMEO, 2000)
        try:
            peer.send(command, body)
        except zmq.Again:
            return False
        return peer.recv(2.0) is not None
    finally:
        peer.close()


@pytest.mark.timeout(90)
def test_a_key_is_admitted_only_on_the_sockets_of_its_role(tcp_endpoints, role_keys) -> None:
    broker = Broker(**{f"{k}_endpoint": v for k, v in tcp_endpoints.items()}, heartbeat_interval_s=0.2,
                    curve=CurveConfig.from_keys_dir(role_keys)).start()
    worker_keys = CurveConfig.from_keys_dir(role_keys, "worker")
    student_keys = CurveConfig.from_keys_dir(role_keys, "student")
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=tcp_endpoints["backend"], control_pub_endpoint=tcp_endpoints["control_pub"],
                    heartbeat_interval_s=0.2, curve=worker_keys).start()
    try:
        with _leader(tcp_endpoints, curve=student_keys) as leader:
            generation = leader.set_model("m")
            peers.consume_verified(leader, generation, 10)  # each key on its own sockets: served
            stats = {"run_id": "default"}
            assert _answered(tcp_endpoints["control"], student_keys, Command.STATS, stats)
            # A worker's key on the control and frontend sockets: no handshake, no answer.
            assert not _answered(tcp_endpoints["control"], worker_keys, Command.SET_MODEL, {
                "run_id": "default", "model_id": "evil", "leader_epoch": 0, "peer_id": "evil",
                "leader_secret": leader.leader_secret})
            assert not _answered(tcp_endpoints["frontend"], worker_keys, Command.STATS, stats)
            # A student's key on the backend: no handshake, so no READY, no work.
            assert not _answered(tcp_endpoints["backend"], student_keys, Command.READY, {
                "peer_id": "fake-worker", "credit": 8, "max_batch": 8})
            assert broker.stats.workers == 1
            assert broker.stats.per_run["default"]["model_id"] == "m"
            peers.consume_verified(leader, generation, 20, what="no sample after the refused keys")
    finally:
        worker.stop()
        broker.stop()
