"""The Broker class and its parts: configuration, the loop's guard, tables, limits, deadline.

The parts (``runs``, ``records``, ``limits``, ``deadline``) are plain objects tested on
their own; the guard is tested on a real broker (its sockets, a real peer), with one
handler made to fail.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import pytest

from distill.pipeline import Broker, BrokerConfig
from distill.pipeline.broker import limits
from distill.pipeline.broker.config import MAX_WORK_ITEMS, WORK_TIMEOUT_MIN_BEATS
from distill.pipeline.broker.deadline import BatchClock
from distill.pipeline.broker.dispatch import Dispatcher, _sort_outcomes
from distill.pipeline.broker.frontend import Frontend
from distill.pipeline.broker.records import (
    Connection,
    Impostor,
    SlotRequests,
    StudentTable,
    Work,
    WorkerPeer,
)
from distill.pipeline.broker.runs import RequestLedger, RunTable
from distill.pipeline.broker.state import BrokerState
from distill.pipeline.protocol import Command, ProtocolError
from distill.pipeline.throttle import LogThrottle
from tests.hostile import Peer, fetch_stats

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- configuration
def test_keywords_of_the_seed_readme_and_a_config_object_give_one_config(broker_kwargs) -> None:
    by_keywords = Broker(**broker_kwargs, heartbeat_interval_s=0.2, max_queued=5)
    by_config = Broker(config=BrokerConfig(**broker_kwargs, heartbeat_interval_s=0.2, max_queued=5))
    assert by_keywords.config == by_config.config
    assert by_keywords.frontend_endpoint == broker_kwargs["frontend_endpoint"]
    assert Broker(config=by_config.config, max_queued=7).config.max_queued == 7  # keywords win
    positional = Broker(*broker_kwargs.values())
    assert [positional.frontend_endpoint, positional.backend_endpoint, positional.control_endpoint,
            positional.control_pub_endpoint] == list(broker_kwargs.values())
    assert Broker().frontend_endpoint.endswith("/frontend.sock")  # defaults resolved once


def test_a_setting_that_does_not_exist_or_is_out_of_range_is_named() -> None:
    with pytest.raises(TypeError, match="max_queud"):
        Broker(max_queud=5)
    with pytest.raises(ValueError, match=r"max_queued=0"):
        Broker(max_queued=0)
    with pytest.raises(ValueError, match="work_timeout_s"):
        BrokerConfig(work_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        BrokerConfig(heartbeat_interval_s=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        BrokerConfig().max_queued = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- the loop's guard
def test_a_handler_that_raises_is_logged_with_the_peer_and_counted_and_the_broker_serves_on(
        endpoints, broker_kwargs, monkeypatch, caplog) -> None:
    original = Frontend.on_hello
    calls = []

    def failing_once(self, identity, key, body):
        calls.append(identity)
        if len(calls) == 1:
            raise RuntimeError("a bug in a handler")
        return original(self, identity, key, body)

    monkeypatch.setattr(Frontend, "on_hello", failing_once)
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    peer = Peer(endpoints["frontend"], "student-guard")
    try:
        with caplog.at_level(logging.WARNING, logger="distill.pipeline.broker"):
            peer.send(Command.HELLO, {"run_id": "default", "peer_id": "student-guard"})
            assert peer.recv(timeout_s=1.0) is None  # dropped, not answered
            peer.send(Command.HELLO, {"run_id": "default", "peer_id": "student-guard"})
            assert peer.expect(Command.WELCOME).body["generation"] == 0
        assert broker.stats.errors == 1
        lines = [r.getMessage() for r in caplog.records if "a bug in a handler" in r.getMessage()]
        assert len(lines) == 1 and "HELLO from b'student-guard'" in lines[0], lines
    finally:
        peer.close()
        broker.stop()


def test_a_dispatch_step_that_raises_is_counted_and_the_broker_serves_on(endpoints, broker_kwargs,
                                                                         monkeypatch) -> None:
    original = Dispatcher.dispatch
    failures = []

    def failing(self):
        if len(failures) < 3:
            failures.append(1)
            raise KeyError("a bug in dispatch")
        return original(self)

    monkeypatch.setattr(Dispatcher, "dispatch", failing)
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    try:
        deadline = time.monotonic() + 10
        while broker.stats.errors < 3:  # the loop runs dispatch at least once per heartbeat
            assert time.monotonic() < deadline, f"dispatch ran {len(failures)} times in 10 s"
            time.sleep(0.05)
        for _ in range(3):
            assert fetch_stats(endpoints["frontend"]) is not None
        assert broker.stats.errors == 3
    finally:
        broker.stop()


# --------------------------------------------------------------------------- runs and queues
def _requests(owner: Connection, medium: str, slots: list[list[int]]) -> SlotRequests:
    return SlotRequests(owner, "r", medium, 4160, slots)


def _check_counts(table: RunTable, connections: list[Connection]) -> None:
    """The invariant RunTable keeps: every count equals what the queues hold."""
    for run in table.runs.values():
        assert run.queued == sum(len(r.slots) for queue in run.queues.values() for r in queue)
    assert table.queued == sum(run.queued for run in table.runs.values())
    for connection in connections:
        assert connection.queued == sum(len(r.slots) for run in table.runs.values()
                                        for r in run.queues.get(connection, ()))


def test_run_queue_counts_stay_equal_to_the_queues_through_every_change() -> None:
    table = RunTable(BrokerConfig())
    a, b = Connection(b"a", None), Connection(b"b", None)
    run = table.get_or_add("r", set)
    table.enqueue(run, _requests(a, "m1", [[i, i] for i in range(5)]))
    table.enqueue(run, _requests(b, "m2", [[i, i] for i in range(3)]))
    _check_counts(table, [a, b])
    taken = table.take(run, 6)  # three of each: a's group split
    assert [(r.owner, len(r.slots)) for r in taken] == [(a, 3), (b, 3)]
    _check_counts(table, [a, b])
    table.requeue_front(run, taken)
    _check_counts(table, [a, b])
    assert [len(r.slots) for r in run.queues[a]] == [3, 2] and [r.slots for r in run.queues[a]][0] == [[0, 0], [1, 1], [2, 2]]
    table.drop(run, b)
    _check_counts(table, [a, b])
    assert b.queued == 0 and a.queued == 5
    room = table.make_room(run, a, 10)
    assert (room.slots, room.limit, room.reclaimed) == (BrokerConfig().max_queued_per_student - 5,
                                                        "max_queued_per_student", [])


def _ask(table: RunTable, run_id: str, owner: Connection, count: int, first: int = 0):
    """One REQUEST of ``count`` slots as the frontend makes it: room made, what fits queued."""
    run = table.get_or_add(run_id, set)
    room = table.make_room(run, owner, count)
    if room.slots:
        table.enqueue(run, _requests(owner, f"m-{owner.identity.decode()}",
                                     [[i, i] for i in range(first, first + min(count, room.slots))]))
    return room


def test_a_run_that_asks_takes_its_share_back_from_a_run_that_holds_every_queued_slot() -> None:
    """Issue 37: a run nobody serves used to keep max_queued filled, and every other run was
    refused. A run that asks is owed max_queued / (runs asking): it takes that much back
    from the run over its share, newest slots first, and that run gets no more meanwhile."""
    table = RunTable(BrokerConfig(max_queued=100))
    hog, good = Connection(b"hog", None), Connection(b"good", None)
    assert _ask(table, "hog", hog, 100).slots == 100  # alone: all of it
    room = _ask(table, "good", good, 30)
    assert room.slots == 30 and room.limit == "max_queued"
    assert [row for r in room.reclaimed for row in r.slots] == [[i, i] for i in range(70, 100)]
    assert {r.owner for r in room.reclaimed} == {hog} and table.queued == 100
    room = _ask(table, "hog", hog, 10, first=100)
    assert (room.slots, room.limit, room.share, room.reclaimed) == (0, "max_queued", True, [])
    room = _ask(table, "good", good, 40, first=30)  # up to its share of 50, taken from the hog's 70
    assert room.slots == 20 and sum(len(r.slots) for r in room.reclaimed) == 20
    assert table.runs["hog"].queued == table.runs["good"].queued == 50
    _check_counts(table, [hog, good])


def test_a_connection_that_asks_takes_its_share_of_its_run_back_from_one_over_its_share() -> None:
    table = RunTable(BrokerConfig(max_queued=100, max_queued_per_run=60))
    many, one = Connection(b"many", None), Connection(b"one", None)
    assert _ask(table, "r", many, 100).slots == 60  # the run's limit binds
    room = _ask(table, "r", one, 40)
    assert room.slots == 30 and sum(len(r.slots) for r in room.reclaimed) == 30  # half of the run's 60
    assert many.queued == one.queued == 30
    assert _ask(table, "r", many, 5, first=100).slots == 0
    _check_counts(table, [many, one])


def test_fair_shares_never_take_the_broker_past_max_queued() -> None:
    """Random asks and takes of 6 connections in 3 runs: the counts stay equal to the
    queues, the total within max_queued, and every asker gets its share of it."""
    rng = random.Random(37)
    table = RunTable(BrokerConfig(max_queued=90, max_queued_per_student=40))
    owners = [Connection(f"c{i}".encode(), None) for i in range(6)]
    for step in range(2000):
        owner = rng.choice(owners)
        run_id = f"r{owners.index(owner) % 3}"
        if rng.random() < 0.3:
            table.take(table.get_or_add(run_id, set), rng.randint(1, 20))
        else:
            wanted = rng.randint(1, 40)
            room = _ask(table, run_id, owner, wanted, first=1000 * step)
            run = table.runs[run_id]
            share = min(90 // table.asking // max(1, len(run.queues)), 40)
            assert owner.queued >= min(wanted, share), (step, owner.queued, wanted, share, room)
        assert table.queued <= 90
        _check_counts(table, owners)


def test_a_student_with_many_slots_queued_does_not_hold_up_the_one_behind_it() -> None:
    table = RunTable(BrokerConfig())
    big, small = Connection(b"big", None), Connection(b"small", None)
    run = table.get_or_add("r", set)
    table.enqueue(run, _requests(big, "m1", [[i, i] for i in range(8192)]))
    table.enqueue(run, _requests(small, "m2", [[i, i] for i in range(4)]))
    first = table.take(run, 8)
    assert [(r.owner, len(r.slots)) for r in first] == [(big, 4), (small, 4)]
    assert [(r.owner, len(r.slots)) for r in table.take(run, 8)] == [(big, 8)]
    table.enqueue(run, _requests(small, "m2", [[4, 4]]))
    assert {r.owner for r in table.take(run, 2)} == {big, small}
    _check_counts(table, [big, small])


def test_a_full_run_table_forgets_an_idle_run_or_refuses_by_name() -> None:
    table = RunTable(BrokerConfig(max_runs=2))
    table.get_or_add("idle", set)
    busy = table.get_or_add("busy", set)
    table.set_model(busy, "m", None, 0)
    table.mark_live("idle", 1.0)
    table.mark_live("busy", 1.0)
    table.get_or_add("new", set)
    assert set(table.runs) == {"busy", "new"}
    table.mark_live("new", 1.0)
    with pytest.raises(ProtocolError, match="max_runs"):
        table.get_or_add("newer", lambda: {"new"})


def test_a_run_no_live_peer_ever_showed_up_for_gives_its_place_up_first() -> None:
    """SET_MODELs alone (made-up runs) fill the table: a new run takes the oldest one's
    place, however many there are, and never the place of a run that had a live peer."""
    table = RunTable(BrokerConfig(max_runs=3))
    live = table.get_or_add("live", set)
    table.set_model(live, "m", None, 0)
    table.mark_live("live", 1.0)
    for i in range(10):
        made_up = table.get_or_add(f"made-up-{i}", set)
        table.set_model(made_up, "m", {"k": i}, 100)
    assert list(table.runs) == ["live", "made-up-8", "made-up-9"]
    assert table.retained_cfg_bytes == 200  # what the forgotten runs kept is given back
    assert list(table.order) == list(table.runs)


def test_a_run_without_live_peers_is_forgotten_after_the_grace() -> None:
    table = RunTable(BrokerConfig(run_grace_s=5.0))
    for run_id in ("student", "leader", "gone"):
        table.set_leader(table.get_or_add(run_id, set), 1, f"leader-of-{run_id}")
    start = time.monotonic()
    assert table.forget_abandoned(start + 4.0, busy={"student"}) == []  # within the grace
    table.heard_leader("leader-of-leader", start + 4.0)  # its heartbeats: its run is alive
    assert table.forget_abandoned(start + 8.0, busy={"student"}) == ["gone"]
    assert table.leaders == {"leader-of-student": "student", "leader-of-leader": "leader"}
    assert table.forget_abandoned(start + 12.0, busy=set()) == ["leader"]  # quiet since start + 4
    assert table.forget_abandoned(start + 14.0, busy=set()) == ["student"]
    assert not table.runs and not table.order and not table.leaders and not table.unclaimed


def test_one_leader_heartbeat_keeps_one_run_alive() -> None:
    """A peer id leads the run of its latest SET_MODEL only: one peer's beats cannot keep
    a thousand made-up runs alive."""
    table = RunTable(BrokerConfig(run_grace_s=5.0))
    first, second = (table.get_or_add(run_id, set) for run_id in ("first", "second"))
    table.set_leader(first, 1, "beats")
    table.set_leader(second, 1, "beats")
    start = time.monotonic()
    table.heard_leader("beats", start + 4.0)
    assert table.forget_abandoned(start + 8.0, busy=set()) == ["first"]
    assert "second" not in table.unclaimed


def test_what_all_runs_keep_of_their_model_cfg_is_bounded() -> None:
    config = BrokerConfig(max_retained_cfg_bytes=10_000)
    table = RunTable(config)
    cfg = {"layers": list(range(100))}
    cost = limits.cfg_cost(config, cfg)
    assert cost > 100 * limits.CFG_BYTES_PER_VALUE
    runs = [table.get_or_add(f"r{i}", set) for i in range(3)]
    table.set_model(runs[0], "m", cfg, cost)
    with pytest.raises(ProtocolError, match="max_retained_cfg_bytes"):
        for run in runs[1:]:
            table.set_model(run, "m", cfg, cost)
    assert table.retained_cfg_bytes == sum(r.cfg_cost for r in runs) <= 10_000
    table.set_model(runs[0], "m", None, 0)  # a switch to a smaller config frees what the old one kept
    assert table.retained_cfg_bytes == sum(r.cfg_cost for r in runs)


def test_the_ledger_drops_repeats_within_and_across_requests() -> None:
    ledger = RequestLedger()
    assert ledger.admit("m", [[0, 1], [1, 2], [0, 1]]) == [[0, 1], [1, 2]]
    assert ledger.admit("m", [[0, 1], [2, 3]]) == [[2, 3]]
    owner = Connection(b"a", None)
    ledger.settle([_requests(owner, "m", [[0, 1]])], answered=False)  # dropped: may be asked again
    assert ledger.admit("m", [[0, 1]]) == [[0, 1]]
    ledger.settle([_requests(owner, "m", [[0, 1]])])  # answered: a repeat still on its way is dropped
    assert ledger.admit("m", [[0, 1]]) == []


def test_a_failed_slot_is_a_warning_and_a_failure_unless_its_student_has_left(caplog) -> None:
    """A dataset that closes with WORK in flight unlinks its segment; the worker then fails
    those slots, which is expected at the end of every run: only slots of live students'
    segments warn, and only they count as failed (the others as discarded)."""
    live, gone = Connection(b"a", None), Connection(b"b", None)
    work = Work(1, b"w", "r", 3, [_requests(live, "dst_live", [[0, 10], [1, 11]]),
                                  _requests(gone, "dst_gone", [[0, 20]])], 3)
    by_student: dict = {}
    with caplog.at_level(logging.DEBUG, logger="distill.pipeline.broker.dispatch"):
        abandoned = _sort_outcomes(work, False, {1: "bad address: x", 2: "bad address: y"}, by_student, {},
                                   LogThrottle(logging.getLogger("distill.pipeline.broker.dispatch")), {"dst_live"})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert warned == ["worker failed slot 1 of dst_live: bad address: x"]
    assert quiet == ["worker failed slot 0 of dst_gone, whose student has left: bad address: y"]
    assert by_student == {b"a": [[0, 10, True], [1, 11, False]], b"b": [[0, 20, False]]}
    assert abandoned == 1
    state = BrokerState(BrokerConfig())
    run = state.runs.get_or_add("r", set)
    Dispatcher(state)._count_outcomes(run, by_student, {b"a": [[2, 12]]}, 0, abandoned, True)
    counters = state.counters
    assert (counters.completed, counters.failed, counters.discarded) == (1, 1, 2)
    # The run's own figures tell a stale slot (DISCARDED) from one nobody waits for any more.
    assert (run.completed, run.discarded, run.abandoned) == (2, 1, 1)


# --------------------------------------------------------------------------- peers and mediums
def test_peer_ids_and_mediums_are_bound_to_the_connection_that_first_used_them() -> None:
    students = StudentTable(BrokerConfig(max_mediums_per_student=2))
    peer = students.add(b"conn-a", "student-a", None, "r", 0.0)
    assert students.bound(b"conn-a", "student-a", None, "REQUEST") is peer
    with pytest.raises(Impostor, match="bound to another connection"):
        students.bound(b"conn-b", "student-a", None, "BYE")
    with pytest.raises(Impostor, match="CurveZMQ key"):
        students.bound(b"conn-a", "student-a", "another key", "BYE")
    students.claim_medium(peer.connection, "dst_a_1_1", 4160)
    students.claim_medium(peer.connection, "dst_a_1_1", 4160)
    with pytest.raises(ProtocolError, match="stride 4224"):
        students.claim_medium(peer.connection, "dst_a_1_1", 4224)
    other = students.add(b"conn-b", "student-b", None, "r", 0.0)
    with pytest.raises(Impostor, match="belongs to another student"):
        students.claim_medium(other.connection, "dst_a_1_1", 4160)
    students.claim_medium(peer.connection, "dst_a_1_2", 4160)
    with pytest.raises(ProtocolError, match="max_mediums_per_student"):
        students.claim_medium(peer.connection, "dst_a_1_3", 4160)
    students.remove(peer)  # its last peer gone: the connection's mediums are free again
    students.claim_medium(other.connection, "dst_a_1_1", 4160)
    assert students.mediums["dst_a_1_1"] is other.connection and b"conn-a" not in students.connections


# --------------------------------------------------------------------------- limits
def test_numbers_a_peer_sends_are_capped_where_they_are_read() -> None:
    config = BrokerConfig(max_worker_credit=100, max_slots_per_medium=16, max_stride_bytes=1 << 20)
    assert limits.worker_credit(config, 2**62) == 100
    assert limits.worker_batch(2**62) == MAX_WORK_ITEMS and limits.worker_batch(0) == 1
    limits.check_request(config, 4160, [[15, 1]])
    for stride, slots, match in [(64, [[0, 1]], "no room after"), (1 << 21, [[0, 1]], "max_stride_bytes"),
                                 (4160, [[16, 1]], "max_slots_per_medium")]:
        with pytest.raises(ProtocolError, match=match):
            limits.check_request(config, stride, slots)
    with pytest.raises(ProtocolError, match="max_model_cfg_bytes"):
        limits.cfg_cost(BrokerConfig(max_model_cfg_bytes=100), {"x": "y" * 200})
    assert limits.direct_counts({"r": [1, 2], "bad": [1], 3: [1, 1]}) == {"r": (1, 2)}


def test_the_echo_budget_names_refused_slots_up_to_twice_a_student_s_share_per_second() -> None:
    budget = limits.EchoBudget(100)
    assert budget.take(b"a", 60) and budget.take(b"a", 40)
    assert not budget.take(b"a", 1)
    assert budget.take(b"b", 100)  # per connection


# --------------------------------------------------------------------------- deadline
def _worker(in_flight: list[Work], last_done_at: float = 0.0) -> WorkerPeer:
    peer = WorkerPeer(b"w", "w", None, 0, 0, 1, 0.0, last_done_at=last_done_at)
    peer.in_flight = {w.work_id: w for w in in_flight}
    return peer


def test_the_deadline_of_a_work_follows_its_model_s_measured_batches() -> None:
    config = BrokerConfig(heartbeat_interval_s=0.1, first_work_timeout_s=30.0)
    clock = BatchClock(config)
    floor = WORK_TIMEOUT_MIN_BEATS * 0.1
    assert clock.deadline_s("m")[0] == 30.0  # nothing measured: the first-work allowance
    work = Work(1, b"w", "r", 1, [], 4, model_id="m", sent_at=10.0)
    clock.observe(_worker([work], last_done_at=5.0), work, now=10.05)  # 50 ms: under the floor
    assert clock.deadline_s("m")[0] == pytest.approx(floor)
    slow = Work(2, b"w", "r", 1, [], 4, model_id="m", sent_at=20.0)
    clock.observe(_worker([slow]), slow, now=20.5)
    assert clock.deadline_s("m")[0] == pytest.approx(5.0)  # 10 x the slowest recent batch
    assert clock.deadline_s("other")[0] == 30.0  # another model (a deeper layer) is measured on its own
    assert BatchClock(dataclasses.replace(config, work_timeout_s=2.0)).deadline_s("m") == (2.0, "work_timeout_s")


def test_a_first_batch_is_allowed_ten_times_the_slowest_first_batch_of_its_run() -> None:
    """A layer switch (a model nothing was measured for) or a worker that joins late: not
    ``first_work_timeout_s`` once a first batch of the run was measured."""
    clock = BatchClock(BrokerConfig(heartbeat_interval_s=0.1, first_work_timeout_s=600.0))
    assert clock.deadline_s("layer_1", "r", first=True)[0] == 600.0  # nothing measured yet
    first = Work(1, b"w", "r", 1, [], 4, model_id="layer_0", sent_at=10.0)
    clock.observe(_worker([first]), first, now=10.5)  # its first batch: 0.5 s, loading included
    steady = Work(2, b"w", "r", 1, [], 4, model_id="layer_0", sent_at=11.0)
    peer = _worker([steady])
    peer.last_model = "layer_0"
    clock.observe(peer, steady, now=11.01)
    assert clock.deadline_s("layer_1", "r", first=True) == (5.0, "10 x the slowest first batch measured in its run")
    assert clock.deadline_s("layer_1", "other", first=True)[0] == 600.0  # another run: nothing measured
    assert clock.deadline_s("layer_1", "r")[0] == 600.0  # not a first batch (and never measured)
    assert clock.overdue(_worker([Work(3, b"w", "r", 1, [], 1, model_id="layer_1", sent_at=0.0)]), now=5.5)


def test_a_worker_holding_direct_work_whose_batches_stand_still_is_stalled() -> None:
    clock = BatchClock(BrokerConfig(work_timeout_s=1.0))
    peer = _worker([])
    peer.backlog, peer.backlog_since = 2, 50.0
    assert clock.stalled(peer, now=99.0) is None  # says nothing of its batches (an older worker)
    peer.batches, peer.progress_at = 3, 10.0
    assert clock.stalled(peer, now=50.5) is None  # holds DIRECT work since 50.0 only
    stalled = clock.stalled(peer, now=51.5)
    assert stalled is not None and stalled[0] == pytest.approx(1.5)
    peer.progress_at = 51.0  # a batch finished
    assert clock.stalled(peer, now=51.5) is None
    peer.backlog = 0
    assert clock.stalled(peer, now=99.0) is None  # holds nothing


def test_a_worker_s_oldest_work_is_timed_from_its_sending_or_its_last_done() -> None:
    clock = BatchClock(BrokerConfig(work_timeout_s=1.0))
    first, second = (Work(i, b"w", "r", 1, [], 1, model_id="m", sent_at=0.0) for i in (1, 2))
    assert clock.overdue(_worker([]), now=99.0) is None
    assert clock.overdue(_worker([first, second]), now=0.5) is None
    overdue = clock.overdue(_worker([first, second]), now=1.5)
    assert overdue is not None and overdue[0] is first and overdue[1] == pytest.approx(1.5)
    # The first was answered at 1.2: the second only started then.
    assert clock.overdue(_worker([second], last_done_at=1.2), now=1.5) is None
