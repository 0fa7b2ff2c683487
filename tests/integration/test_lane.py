"""Direct requests (the *lane*, ``distill.pipeline.notices``): a student asks the local
worker that last filled a slot to fill it again, past the broker. Real broker, workers
(processes and threads), shared memory and datagram sockets; every sample is checked
byte for byte against its request id."""

from __future__ import annotations

import os
import signal
import time

import pytest

from distill.pipeline import Broker, StudentClient, Worker
from distill.pipeline.liveness import process_token
from distill.pipeline.notices import lane_path
from distill.pipeline.student.slots import Route, SlotState
from tests import peers

pytestmark = pytest.mark.timeout(120)


def _client(endpoints: dict[str, str], slot_count: int = 8, **kwargs: object) -> StudentClient:
    client = StudentClient(0, slot_count, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2, **kwargs)
    client.hello()
    return client


def _worker(endpoints: dict[str, str], batch_fn=peers.fill_targets, max_batch: int = 4, **kwargs: object) -> Worker:
    return Worker(batch_fn=batch_fn, batch_config=peers.batch_config(), max_batch=max_batch,
                  backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                  heartbeat_interval_s=0.2, **kwargs).start()


def _direct_holders(pool) -> list[str]:
    """Process tokens of the workers holding the pool's PENDING slots by DIRECT."""
    return [r.holder for r in pool.slots.records if r.state is SlotState.PENDING and r.route is Route.DIRECT]


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def _take(client: StudentClient, generation: int, seen: set[int], count: int) -> list[int]:
    """Like ``peers.consume_verified``, returning the slot of each sample taken."""
    slots = []
    for _ in range(count):
        ref = peers.take_verified(client, generation, seen)
        slots.append(ref.slot_id)
        client.release_slot(ref.slot_id)
    return slots


def test_slots_go_back_to_the_worker_that_filled_them_past_the_broker(procs, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="worker")
    with _client(endpoints) as client:
        generation = client.set_model("lane")
        peers.consume_verified(client, generation, 400)
        counts = dict(client._pool.counts)
        _wait_for(lambda: broker.stats.completed >= 400)  # direct fills are reported with heartbeats
        stats = broker.stats
    broker.stop()
    assert counts["direct"] >= 300 and counts["rejected"] == 0
    assert stats.dispatched < 100  # most slots never went through the broker
    assert stats.direct >= 300 and stats.completed >= 400 and stats.per_run["default"]["completed"] >= 400
    assert stats.failed == 0 and stats.bad_messages == 0


@pytest.mark.parametrize("side", ["student", "worker", "shared run"])
def test_direct_requests_turned_off_go_through_the_broker(procs, endpoints, broker_kwargs, side: str) -> None:
    """Off on either side, or for a run opted in to fan-out (the broker must see its
    requests to share its samples with other runs)."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="worker", direct_requests=side != "worker")
    with _client(endpoints, direct_requests=side != "student", fan_out=side == "shared run") as client:
        generation = client.set_model(f"broker-{side.replace(' ', '-')}")
        peers.consume_verified(client, generation, 200)
        counts = dict(client._pool.counts)
    broker.stop()
    assert counts["direct"] == 0 and counts["notices"] > 0
    assert broker.stats.direct == 0 and broker.stats.dispatched >= 200


def test_a_stopping_worker_declines_what_it_holds_and_the_broker_gets_it(endpoints, broker_kwargs) -> None:
    """Two workers in this process (so their process stays alive: only the decline can
    free the slots the stopped one was asked for); a 4-slot student must keep going."""
    delay_s = [0.05]

    def slow(model_id: str, model_cfg: dict | None, targets: list) -> None:
        time.sleep(delay_s[0])  # DIRECTs queue up at this worker while it fills, one slot at a time
        peers.fill_targets(model_id, model_cfg, targets)

    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    first = _worker(endpoints, batch_fn=slow, max_batch=1)
    second = None
    try:
        with _client(endpoints, slot_count=4) as client:
            generation = client.set_model("stopping")
            seen: set[int] = set()
            _take(client, generation, seen, 40)  # every slot now has the slow worker's lane
            deadline = time.monotonic() + 10  # its lane may come late to a loaded machine
            while client._pool.counts["direct"] == 0 and time.monotonic() < deadline:
                _take(client, generation, seen, 4)
            assert client._pool.counts["direct"] > 0
            second = _worker(endpoints)
            delay_s[0] = 0.3  # from now on a DIRECT waits behind the one being filled, not beside it
            _take(client, generation, seen, 1)  # the slots are given back: DIRECTs queue at the slow one
            first.stop()
            assert not lane_path(first.peer_id).exists()
            slots = _take(client, generation, seen, 200)
            counts = dict(client._pool.counts)
    finally:
        first.stop()
        if second is not None:
            second.stop()
        broker.stop()
    assert counts["declined"] > 0
    assert set(slots) == {0, 1, 2, 3}  # every slot came back into use


def test_a_killed_worker_s_direct_slots_go_to_the_broker(procs, endpoints, broker_kwargs) -> None:
    """A worker frozen while holding DIRECT requests, then killed: its slots are asked
    for through the broker (same request ids) once its process is gone, and all eight
    come back into use."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    doomed = procs.start(peers.run_worker, endpoints, name="doomed")
    with _client(endpoints) as client:
        generation = client.set_model("killed")
        seen: set[int] = set()
        _take(client, generation, seen, 100)  # every slot now has the doomed worker's lane
        token = process_token(doomed.pid)
        os.kill(doomed.pid, signal.SIGSTOP)
        procs.start(peers.run_worker, endpoints, name="survivor")
        deadline = time.monotonic() + 20
        while token not in _direct_holders(client._pool):  # it holds DIRECTs it will never fill
            assert time.monotonic() < deadline, "no DIRECT went to the frozen worker"
            _take(client, generation, seen, 1)
        os.kill(doomed.pid, signal.SIGKILL)
        # The slots given to the broker may first go to the frozen worker (it still has
        # credit there) and come back once the broker finds it silent: take samples until
        # every slot has come back into use, however fast the survivor serves the others.
        slots = _take(client, generation, seen, 300)
        deadline = time.monotonic() + 30
        while set(slots) != set(range(8)) and time.monotonic() < deadline:
            slots += _take(client, generation, seen, 50)
        held = [holder for holder in _direct_holders(client._pool) if holder == token]
        assert not client._pool.slots.check()
    broker.stop()
    assert held == []
    assert set(slots) == set(range(8))


def test_a_frozen_worker_s_direct_slots_are_asked_again_and_its_late_answers_change_nothing(
        procs, endpoints, broker_kwargs) -> None:
    """Two workers; one is frozen while it holds DIRECT requests and stays frozen. Once
    the broker gives up on it, the student asks again for what it held but never claimed
    (the frozen worker will find other fills in those slots and write nothing): no
    sample waits for the frozen worker. Thawed, it answers late, and that changes
    nothing; no request id is ever yielded twice and every slot stays in use."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    frozen = procs.start(peers.run_worker, endpoints, max_batch=2, name="frozen")
    procs.start(peers.run_worker, endpoints, max_batch=2, name="other")
    _wait_for(lambda: broker.stats.workers == 2)  # so the first requests are split between them
    with _client(endpoints) as client:
        pool = client._pool
        generation = client.set_model("frozen")
        seen: set[int] = set()
        _take(client, generation, seen, 40)
        token = process_token(frozen.pid)
        lanes = [record.lane[1] for record in pool.slots.records if record.lane is not None]
        assert 0 < lanes.count(token) < 8, "the slots were not split between the workers"
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            while token not in _direct_holders(pool):  # it holds DIRECTs it will not fill
                assert time.monotonic() < deadline, "no DIRECT went to the frozen worker"
                _take(client, generation, seen, 1)
            asked = {r.request_id for r in pool.slots.records
                     if r.route is Route.DIRECT and r.holder == token and r.state is SlotState.PENDING}
            deadline = time.monotonic() + 20
            while token in _direct_holders(pool):  # the broker gave up on it: the student asks again
                assert time.monotonic() < deadline, "the silent worker's DIRECT slots were never asked again"
                _take(client, generation, seen, 1)
            deadline = time.monotonic() + 20
            while not asked <= seen:  # their samples come from the other worker
                assert time.monotonic() < deadline, f"never delivered: {sorted(asked - seen)}"
                _take(client, generation, seen, 1)
            # What it never claimed is asked again, not waited for; only a batch it was
            # writing when the SIGSTOP came (at most max_batch=2 slots, claimed) stays out of
            # use until its late answer (the check after SIGCONT: every slot back in use).
            assert pool.counts["quarantined"] <= 2, pool.counts
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        slots: set[int] = set()
        deadline = time.monotonic() + 20
        while slots != set(range(8)):  # its late answers leave every slot in use
            assert time.monotonic() < deadline, f"in use: {sorted(slots)}"
            slots.update(_take(client, generation, seen, 10))
        assert not pool.slots.check()
    broker.stop()


def test_a_model_switch_sends_direct_requests_to_the_broker_first(procs, endpoints, broker_kwargs) -> None:
    """After SET_MODEL the worker has not seen the new model: it declines DIRECTs of the
    new generation, the broker dispatches them (with the model), then the lane resumes."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="worker")
    with _client(endpoints) as client:
        first = client.set_model("before")
        peers.consume_verified(client, first, 100)
        direct_before = client._pool.counts["direct"]
        second = client.set_model("after")
        peers.consume_verified(client, second, 300)
        counts = dict(client._pool.counts)
    broker.stop()
    assert second > first
    assert counts["declined"] > 0 and counts["direct"] - direct_before >= 200


def test_an_inbox_that_vanishes_is_bound_again_and_nothing_is_lost(procs, endpoints, broker_kwargs) -> None:
    """Workers keep the answers to DIRECTs they could not deliver; the student binds its
    inbox again at its next heartbeat and gets them (else its slots would stay pending)."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="worker")
    with _client(endpoints) as client:
        generation = client.set_model("vanish")
        seen = peers.consume_verified(client, generation, 100)
        inbox = client._pool._inbox
        inbox.path.unlink()
        peers.consume_verified(client, generation, 500, seen=seen)
        assert client._pool._inbox is not inbox and client._pool._inbox.present()
        counts = dict(client._pool.counts)
    broker.stop()
    assert counts["direct"] >= 300 and counts["rejected"] == 0


def test_broker_work_for_the_same_student_does_not_decline_its_direct_requests(procs, endpoints,
                                                                                broker_kwargs) -> None:
    """A ring much larger than the worker's credit: its first requests wait at the broker
    while its first fills come back as DIRECTs. The broker's WORK waiting on the worker is
    then for this same student, so its DIRECTs are filled after it, not declined (declined,
    they went to the broker, whose WORK for them kept waiting: 88% of all slots at 4 KiB)."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, max_batch=4, name="worker")
    with _client(endpoints, slot_count=256) as client:
        generation = client.set_model("same")
        peers.consume_verified(client, generation, 2000)
        counts = dict(client._pool.counts)
    broker.stop()
    assert counts["declined"] == 0, counts
    # Most refills went straight to the worker (at most 1,744 can: the first 256 fills come
    # through the broker). A DIRECT the worker's datagram queue cannot take (10 by default,
    # net.unix.max_dgram_qlen, while a busy machine keeps the worker off its core) goes to
    # the broker instead, which is not a decline: on a contended CI machine 1,332 did.
    assert counts["direct"] >= 1000, counts


def test_broker_work_for_another_student_declines_direct_requests(procs, endpoints, broker_kwargs) -> None:
    """Two students, one worker: while WORK for one waits at the worker, the other's DIRECTs
    are declined and go to the broker, which shares the worker between them; both are served.
    The worker takes 5 ms a batch, so the second student's first fills, through the broker,
    are still waiting when the first student's DIRECTs arrive (a worker that filled all 128
    first slots before any DIRECT came left nothing to decline: 1 run in 6 here)."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_sleeping_worker, endpoints, 0.005, max_batch=4, name="worker")
    with _client(endpoints, slot_count=64) as first, _client(endpoints, slot_count=64) as second:
        generation = first.set_model("shared")
        second.wait_generation(generation, timeout_s=10)
        seen: dict[int, set[int]] = {0: set(), 1: set()}
        for _ in range(40):
            for idx, client in enumerate((first, second)):
                peers.consume_verified(client, generation, len(seen[idx]) + 25, seen=seen[idx])
        declined = first._pool.counts["declined"] + second._pool.counts["declined"]
    broker.stop()
    assert declined > 0
    assert len(seen[0]) == len(seen[1]) == 1000
