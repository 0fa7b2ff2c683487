"""Group 1 of the hardening issue: no well-formed message can kill the broker.

Each test sends what killed the broker's thread before (a READY whose credit and
max_batch made it build a WORK past the protocol's item limit; a model_cfg nested
1,000 deep; a DONE that inflated a worker's credit) and then checks that the broker
still answers, refused or capped what it had to, and counted it.
"""

from __future__ import annotations

import time

import pytest

from distill.pipeline import Broker, protocol
from distill.pipeline.protocol import Command
from tests.hostile import Peer, deep_map, fetch_stats, medium_name, raw_body, request, set_model

pytestmark = pytest.mark.timeout(60)


def _alive(endpoints: dict[str, str]) -> dict:
    stats = fetch_stats(endpoints["frontend"], timeout_s=3.0)
    assert stats is not None, "the broker no longer answers STATS"
    return stats


def test_a_ready_with_huge_credit_and_batch_gets_capped_works(endpoints, broker_kwargs) -> None:
    """credit = max_batch = 100,000 with 73,728 slots queued: the broker used to build one
    WORK of 73,728 items (more than a message may hold), fail to encode it and die."""
    broker = Broker(**broker_kwargs).start()
    leader, worker = Peer(endpoints["control"]), Peer(endpoints["backend"], "worker-huge")
    students = [Peer(endpoints["frontend"], f"student-{i}") for i in range(9)]
    try:
        leader.send(Command.SET_MODEL, set_model())
        leader.expect(Command.MODEL_SET)
        for i, student in enumerate(students):
            student.send(Command.REQUEST, request(f"student-{i}", medium_name(f"huge{i}"),
                                                  [[slot, slot] for slot in range(8192)]))
        deadline = time.monotonic() + 20
        while _alive(endpoints)["queued"] < 9 * 8192:
            assert time.monotonic() < deadline, "the REQUESTs were not all queued"
            time.sleep(0.05)
        worker.send(Command.READY, {"peer_id": "worker-huge", "credit": 100_000, "max_batch": 100_000})
        works = worker.collect(Command.WORK, quiet_s=1.0)
        stats = _alive(endpoints)
        sizes = [len(w.body["items"]) for w in works]
        assert sizes and max(sizes) <= protocol.MAX_ITEMS_PER_MESSAGE, sizes
        assert sum(sizes) == stats["in_flight"] <= broker.config.max_worker_credit
        assert stats["errors"] == 0
    finally:
        for peer in (leader, worker, *students):
            peer.close()
        broker.stop()


def test_a_model_cfg_nested_a_thousand_deep_is_refused(endpoints, broker_kwargs) -> None:
    """Two fan-out runs with such a config, slots queued in both, a worker: comparing the
    two runs' configs raised RecursionError out of the broker's loop."""
    broker = Broker(**broker_kwargs).start()
    leader, worker = Peer(endpoints["control"]), Peer(endpoints["backend"], "worker-1")
    students = {run_id: Peer(endpoints["frontend"], f"student-{run_id}") for run_id in ("a", "b")}
    try:
        replies = []
        for run_id, student in students.items():
            leader.send_raw(Command.SET_MODEL, raw_body(set_model(run_id=run_id, share_model=True),
                                                        {"model_cfg": deep_map(1000)}))
            replies.append(leader.recv())
            student.send(Command.REQUEST, request(f"student-{run_id}", medium_name(run_id), [[0, 1], [1, 2]],
                                                  run_id=run_id))
        worker.send(Command.READY, {"peer_id": "worker-1", "credit": 8, "max_batch": 4})
        stats = _alive(endpoints)
        assert all(r is not None and r.command is Command.ERROR and "nests deeper than 32" in r.body["reason"]
                   for r in replies), replies
        assert stats["bad_messages"] == 2 and stats["errors"] == 0
        # 31 levels is within the limit: two runs of such a model share their samples.
        worker.send(Command.BYE, {"peer_id": "worker-1"})
        for run_id in students:
            leader.send_raw(Command.SET_MODEL, raw_body(set_model(run_id=run_id, share_model=True),
                                                        {"model_cfg": deep_map(31)}))
            assert leader.expect(Command.MODEL_SET).body["generation"] == 1
        _alive(endpoints)  # the BYE and the switches are processed: the slots wait for a worker
        late = Peer(endpoints["backend"], "worker-2")
        late.send(Command.READY, {"peer_id": "worker-2", "credit": 8, "max_batch": 4})
        work = late.expect(Command.WORK)
        late.close()
        assert sorted(group[0] for group in work.body["runs"]) == ["a", "b"], work.body
    finally:
        for peer in (leader, worker, *students.values()):
            peer.close()
        broker.stop()


def test_a_done_cannot_lift_a_worker_above_its_credit(endpoints, broker_kwargs) -> None:
    """A DONE for a work the broker does not know returns ``num_items`` of credit (work
    from before a restart): 2**62 of it let one worker be handed every queued slot."""
    broker = Broker(**broker_kwargs).start()
    leader, worker, student = (Peer(endpoints["control"]), Peer(endpoints["backend"], "worker-small"),
                               Peer(endpoints["frontend"], "student-1"))
    try:
        leader.send(Command.SET_MODEL, set_model())
        leader.expect(Command.MODEL_SET)
        worker.send(Command.READY, {"peer_id": "worker-small", "credit": 4, "max_batch": 2})
        worker.send(Command.DONE, {"peer_id": "worker-small", "work_id": 999_999, "num_items": 2**62,
                                   "failed": []})
        student.send(Command.REQUEST, request("student-1", medium_name("credit"), [[s, s] for s in range(64)]))
        works = worker.collect(Command.WORK, quiet_s=1.0)
        assert sum(len(w.body["items"]) for w in works) == 4, [len(w.body["items"]) for w in works]
        assert _alive(endpoints)["queued"] == 60
    finally:
        for peer in (leader, worker, student):
            peer.close()
        broker.stop()
