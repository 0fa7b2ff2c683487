"""Issue 37, item 7: deadlines on every path.

- A worker whose batch function hangs while it serves DIRECT requests (past the
  broker): the broker had no WORK of it in flight, and its heartbeat thread beat on, so
  nobody ever gave up on it. The student re-sent its requests to the hung lane and
  stalled for good. Now the student gives up on a lane that has answered nothing for
  ten times its slowest recent answer (at least ten heartbeats) and asks the broker,
  and the broker gives up on a worker that holds DIRECT work and whose heartbeats say
  it has finished no batch within its deadline. Each alone is enough: with the
  broker's deadline set to 600 s, the student's lane deadline still gets the samples
  from the healthy worker.
- A worker whose first batch hangs after a layer switch (a model nothing was measured
  for) waited out ``first_work_timeout_s`` (600 s), though the run's first batches had
  been measured fast: now a first batch is allowed ten times the slowest first batch of
  its run.

Real broker, worker processes and threads, shared memory and datagram lanes; every
sample is checked byte for byte against its request id.
"""

from __future__ import annotations

import logging
import time

import pytest

from distill.pipeline import Broker, StudentClient, Worker
from distill.pipeline.broker.config import WORK_TIMEOUT_MIN_BEATS
from distill.pipeline.liveness import process_token
from distill.pipeline.student.slots import Route, SlotState
from tests import peers

pytestmark = pytest.mark.timeout(120)
HEARTBEAT_S = 0.2


def _worker(endpoints: dict[str, str], **kwargs: object) -> Worker:
    return Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                  backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                  heartbeat_interval_s=HEARTBEAT_S, **kwargs)


def _client(endpoints: dict[str, str], slot_count: int, **kwargs: object) -> StudentClient:
    client = StudentClient(0, slot_count, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=HEARTBEAT_S, **kwargs)
    client.hello()
    return client


def _wait_for(what: str, predicate, timeout_s: float, step=lambda: time.sleep(0.02)) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        step()


def _lane_bound_s(pool, token: str) -> float:
    """How long the student may wait behind the hung lane: its own derived deadline for
    that lane (LANE_DEADLINE_FACTOR x the slowest wait between its answers so far), plus 5 s
    to ask the broker and get the healthy worker's sample; at least 15 s. A loaded machine
    stretches those waits past 1 s (seen: 10.05 s under -n 2 with two more test files
    beside it, and more with the suite run twice side by side), so a fixed bound fails
    there while the student does exactly what it should."""
    clock = pool.custody._lanes.get(token)
    lane_s = pool.custody.lane_deadline_s(clock)[0] if clock is not None else 0.0
    return max(15.0, lane_s + 5.0)


@pytest.mark.parametrize("broker_deadline", ["derived", "600 s"])
def test_a_worker_that_hangs_serving_direct_requests_is_given_up_on(procs, endpoints, broker_kwargs, tmp_path,
                                                                    caplog, broker_deadline: str) -> None:
    """One worker fills a 4-slot ring: its first two batches are the broker's WORK, every
    later one DIRECT requests; its third never returns. A healthy worker joins: the
    student gets every sample it asks for from it, within seconds. ``600 s``: the
    broker's deadline is out of the way, so the student's lane deadline alone does it."""
    busy_file = tmp_path / "hanging"
    timeout = {} if broker_deadline == "derived" else {"work_timeout_s": 600.0}
    broker = Broker(**broker_kwargs, heartbeat_interval_s=HEARTBEAT_S, **timeout).start()
    hanging = procs.start(peers.run_hanging_worker, endpoints, 2, str(busy_file), True, name="hanging-worker")
    healthy = _worker(endpoints)
    try:
        with _client(endpoints, 4) as client, caplog.at_level(logging.WARNING, logger="distill.pipeline"):
            pool = client._pool
            generation = client.set_model("m")
            seen: set[int] = set()

            def take_one() -> None:
                ref = client.request_sample(timeout_ms=200)
                if ref is not None:
                    seen.add(ref.request_id)
                    client.release_slot(ref.slot_id)

            _wait_for("the worker never got to its hanging batch", busy_file.exists, 60, take_one)
            token = process_token(hanging.pid)
            held = [r for r in pool.slots.records if r.state is SlotState.PENDING and r.route is Route.DIRECT]
            assert any(r.holder == token for r in held), "the hanging batch was not a DIRECT one"
            hung_at = time.monotonic()
            bound_s = _lane_bound_s(pool, token)
            healthy.start()
            peers.consume_verified(client, generation, len(seen) + 1, seen=seen, timeout_ms=int(bound_s * 1000),
                                   what=f"the student stalled behind the hung lane (bound {bound_s:.1f}s)")
            first_s = time.monotonic() - hung_at
            # (the first may come from a slot the hung lane did not hold; the rest wait for
            # its slots to be given up on, within the same bound)
            peers.consume_verified(client, generation, len(seen) + 60, seen=seen, timeout_ms=int(bound_s * 1000))
            took_s = time.monotonic() - hung_at
            assert not pool.slots.check()
            counts = dict(pool.counts)
            if broker_deadline == "derived":
                _wait_for("the broker never gave up on the hung worker", lambda: broker.stats.overdue == 1, 15)
        stats = broker.stats
    finally:
        healthy.stop()
        broker.stop()
    assert first_s < bound_s and took_s < bound_s + 15, (first_s, took_s, bound_s)
    assert healthy.samples_written >= 60
    messages = [record.getMessage() for record in caplog.records]
    if broker_deadline == "derived":
        # Given up on by the broker's derived deadline: for its DIRECT slots, or for a broker
        # WORK it may hold too (a slot the student asked again through the broker while the
        # lane was silent can reach it: before any deadline a hung worker is only a loaded
        # one), whichever fires first (about half the runs each here). The stall alone is
        # tested on the broker's records in tests/unit/pipeline/broker/test_deadline.py.
        assert stats.workers == 1 and stats.quarantined <= 2, stats
        assert any(("has finished no batch" in m and "direct slot(s)" in m) or "as if it were silent" in m
                   for m in messages), messages
    else:
        assert stats.overdue == 0, stats
        assert counts["hung_lanes"] == 1, counts
        assert any("answered none of our direct requests" in m for m in messages), messages


def test_a_first_batch_that_hangs_after_a_switch_gets_a_deadline_from_the_run_s_measured_batches(
        procs, endpoints, broker_kwargs, tmp_path, caplog) -> None:
    """A fast worker serves layer 0, then leaves; the leader switches to layer 1 (nothing
    of it measured) and a new worker takes all of its first WORK, whose batch hangs. The
    broker allows it ten times the run's slowest first batch (at least ten heartbeats),
    not ``first_work_timeout_s`` (600 s)."""
    busy_file = tmp_path / "hanging"
    caplog.set_level(logging.WARNING, logger="distill.pipeline.broker")
    broker = Broker(**broker_kwargs, heartbeat_interval_s=HEARTBEAT_S).start()
    fast = _worker(endpoints, direct_requests=False).start()
    try:
        with _client(endpoints, 4, direct_requests=False) as client:
            peers.consume_verified(client, client.set_model("layer_0"), 20)
            fast.stop()
            _wait_for("the fast worker never left", lambda: broker.stats.workers == 0, 15)
            client.set_model("layer_1")
            procs.start(peers.run_freezing_worker, endpoints, str(busy_file), HEARTBEAT_S, name="hanging-worker")
            asking = lambda: client.request_sample(timeout_ms=100)  # noqa: E731 (the stale slots are asked again)
            _wait_for("the new worker never got to its first batch", busy_file.exists, 60, asking)
            hung_at = time.monotonic()
            _wait_for("the hung first batch was not given up on", lambda: broker.stats.overdue == 1, 15)
            waited = time.monotonic() - hung_at
        stats = broker.stats
    finally:
        fast.stop()
        broker.stop()
    assert stats.quarantined >= 1 and stats.workers == 0, stats
    assert WORK_TIMEOUT_MIN_BEATS * HEARTBEAT_S - HEARTBEAT_S <= waited < 10, waited
    lines = [r.getMessage() for r in caplog.records if "past its deadline" in r.getMessage()]
    assert len(lines) == 1 and "first batch measured in its run" in lines[0], lines
