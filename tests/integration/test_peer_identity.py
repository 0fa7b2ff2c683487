"""Group 3 of the hardening issue: a peer id belongs to the connection that first used it.

Another connection naming it (in a DONE, READY, HELLO or BYE) is refused, counted as
``foreign`` and answered with an ERROR; the peer it names is untouched. With CurveZMQ,
a heartbeat (which comes from another connection than its peer's work) must carry the
key its peer registered with.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from distill.pipeline import Broker
from distill.pipeline.auth import CurveConfig, create_keys
from distill.pipeline.protocol import Command
from tests.hostile import Peer, fetch_stats, medium_name, request, set_model, stats_when

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(endpoints, broker_kwargs):
    """A broker with a model, a worker holding one WORK of a student's 4 slots."""
    broker = Broker(**broker_kwargs).start()
    leader = Peer(endpoints["control"])
    worker, student = Peer(endpoints["backend"], "worker-victim"), Peer(endpoints["frontend"], "student-victim")
    leader.send(Command.SET_MODEL, set_model())
    leader.expect(Command.MODEL_SET)
    worker.send(Command.READY, {"peer_id": "worker-victim", "credit": 4, "max_batch": 4})
    student.send(Command.REQUEST, request("student-victim", medium_name("victim"), [[s, 100 + s] for s in range(4)]))
    work = worker.expect(Command.WORK)
    yield broker, worker, student, work
    for peer in (leader, worker, student):
        peer.close()
    broker.stop()


def test_a_done_naming_another_worker_does_not_complete_its_slots(served, endpoints) -> None:
    broker, worker, student, work = served
    impostor = Peer(endpoints["backend"])
    try:
        impostor.send(Command.DONE, {"peer_id": "worker-victim", "work_id": work.body["work_id"], "num_items": 4,
                                     "failed": []})
        early = student.recv(timeout_s=0.5)
        assert early is None, f"the student was told of slots nobody wrote: {early}"
        reply = impostor.expect(Command.ERROR)
        assert "bound to another connection" in reply.body["reason"], reply.body
        worker.send(Command.DONE, {"peer_id": "worker-victim", "work_id": work.body["work_id"], "num_items": 4,
                                   "failed": []})
        rows = student.expect(Command.COMPLETE, skip=(Command.HEARTBEAT,)).body["slots"]
        assert sorted(rows) == [[s, 100 + s, True] for s in range(4)]
        assert broker.stats.foreign == 1
    finally:
        impostor.close()


def test_a_ready_naming_another_worker_does_not_take_its_work(served, endpoints) -> None:
    broker, worker, student, work = served
    impostor = Peer(endpoints["backend"], "impostor")
    try:
        impostor.send(Command.READY, {"peer_id": "worker-victim", "credit": 64, "max_batch": 64})
        assert "bound to another connection" in impostor.expect(Command.ERROR).body["reason"]
        worker.send(Command.DONE, {"peer_id": "worker-victim", "work_id": work.body["work_id"], "num_items": 4,
                                   "failed": []})
        student.expect(Command.COMPLETE)
        student.send(Command.REQUEST, request("student-victim", medium_name("victim"), [[0, 200]]))
        assert worker.expect(Command.WORK).body["items"][0][3] == 200  # the next WORK still goes to the worker
        assert impostor.recv(timeout_s=0.3) is None
    finally:
        impostor.close()


def test_a_heartbeat_naming_another_worker_keeps_it_neither_alive_nor_progressing(served, endpoints) -> None:
    """A hung worker whose beats another connection forges would never meet its deadline;
    the worker's own beat socket (``<identity>/beat``) is heard as before."""
    broker, worker, student, work = served
    impostor, beats = Peer(endpoints["backend"], "impostor"), Peer(endpoints["backend"], "worker-victim/beat")
    try:
        impostor.send(Command.HEARTBEAT, {"peer_id": "worker-victim", "role": "worker", "batches": 7})
        assert "bound to another connection" in impostor.expect(Command.ERROR).body["reason"]
        assert broker.stats.foreign == 1
        beats.send(Command.HEARTBEAT, {"peer_id": "worker-victim", "role": "worker", "batches": 1})
        assert beats.expect(Command.HEARTBEAT).body["peer_id"]  # the broker's answer names the broker
        assert broker.stats.foreign == 1
    finally:
        impostor.close()
        beats.close()


def test_hello_and_bye_naming_another_student_leave_its_queue_alone(endpoints, broker_kwargs) -> None:
    """No worker: the victim's slots stay queued, and an impostor's HELLO (which used to
    re-bind the id to the impostor's connection, dropping the queue) or BYE (which
    dropped the queue) must not change that."""
    broker = Broker(**broker_kwargs).start()
    victim, impostor = Peer(endpoints["frontend"], "student-victim"), Peer(endpoints["frontend"], "student-evil")
    try:
        victim.send(Command.REQUEST, request("student-victim", medium_name("victim"), [[s, s] for s in range(8)]))
        victim.send(Command.HELLO, {"run_id": "default", "peer_id": "student-victim"})
        victim.expect(Command.WELCOME)
        for command in (Command.HELLO, Command.BYE):
            impostor.send(command, {"run_id": "default", "peer_id": "student-victim"} if command is Command.HELLO
                          else {"peer_id": "student-victim"})
            stats = fetch_stats(endpoints["frontend"])
            assert stats["queued"] == 8 and stats["students"] == 1, f"after the impostor's {command.name}: {stats}"
            assert "bound to another connection" in impostor.expect(Command.ERROR, skip=(Command.WELCOME,)).body["reason"]
        assert stats_when(endpoints["frontend"], lambda stats: stats["foreign"] == 2)["foreign"] == 2
        victim.send(Command.BYE, {"peer_id": "student-victim"})  # its own BYE still works
        # STATS goes on a connection of its own, in no order with the BYE: wait for the BYE to land
        _until(lambda: fetch_stats(endpoints["frontend"])["queued"] == 0, "the victim's own BYE drops its queue")
    finally:
        victim.close()
        impostor.close()
        broker.stop()


def test_with_curve_a_heartbeat_must_carry_the_key_its_peer_registered_with(tmp_path, endpoints,
                                                                            broker_kwargs) -> None:
    create_keys(tmp_path / "keys", ["victim", "evil"])
    server = CurveConfig.from_keys_dir(tmp_path / "keys")
    broker = Broker(**broker_kwargs, curve=server).start()
    keys = {name: CurveConfig.from_keys_dir(tmp_path / "keys", name).client_keys() for name in ("victim", "evil")}
    worker = Peer(endpoints["backend"], "worker-victim", keys=keys["victim"])
    beats = Peer(endpoints["backend"], "worker-victim/beat", keys=keys["victim"])  # its heartbeat socket
    impostor = Peer(endpoints["backend"], keys=keys["evil"])
    try:
        worker.send(Command.READY, {"peer_id": "worker-victim", "credit": 4, "max_batch": 4})
        # Two connections have no order between them: the heartbeat waits until the READY is in
        # (a heartbeat of a worker the broker does not know yet is answered RECONNECT).
        _until(lambda: broker.stats.workers == 1, "the broker registers the worker's READY")
        beats.send(Command.HEARTBEAT, {"peer_id": "worker-victim", "role": "worker"})
        assert beats.expect(Command.HEARTBEAT).body["role"] == "broker"
        impostor.send(Command.HEARTBEAT, {"peer_id": "worker-victim", "role": "worker"})
        assert "another CurveZMQ key" in impostor.expect(Command.ERROR).body["reason"]
        assert broker.stats.foreign == 1 and broker.stats.workers == 1
    finally:
        for peer in (worker, beats, impostor):
            peer.close()
        broker.stop()


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)
