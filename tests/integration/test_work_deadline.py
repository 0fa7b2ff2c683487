"""Group 6 of the hardening issue (broker side): a WORK that never comes back has a deadline.

A worker whose batch function hangs keeps heartbeating from its own thread, so the
broker never declared it silent: it held its slots for ever, and nothing was logged.
Now its oldest WORK is timed against ten times its model's slowest recent batch (at
least ten heartbeats), and past that the worker is quarantined like a silent one, with
one log line that says so.
"""

from __future__ import annotations

import logging
import time

import pytest

from distill.pipeline import Broker, StudentClient, Worker
from distill.pipeline.broker.config import WORK_TIMEOUT_MIN_BEATS
from tests import peers

pytestmark = pytest.mark.timeout(90)
HEARTBEAT_S = 0.2
SILENT_BEATS = 3 * WORK_TIMEOUT_MIN_BEATS
DISPATCH_SLACK_S = 0.5


def test_a_worker_whose_batch_hangs_is_quarantined_at_the_derived_deadline(procs, endpoints, broker_kwargs,
                                                                          tmp_path, caplog) -> None:
    busy_file = tmp_path / "hanging"
    caplog.set_level(logging.WARNING, logger="distill.pipeline.broker")
    # Silence is allowed far longer than the deadline, so that on a loaded machine a late
    # heartbeat does not quarantine the hanging worker for silence before its deadline does.
    broker = Broker(**broker_kwargs, heartbeat_interval_s=HEARTBEAT_S, heartbeat_liveness=SILENT_BEATS).start()
    procs.start(peers.run_hanging_worker, endpoints, 2, str(busy_file), name="hanging-worker")
    good = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                  direct_requests=False, backend_endpoint=endpoints["backend"],
                  control_pub_endpoint=endpoints["control_pub"], heartbeat_interval_s=HEARTBEAT_S)
    try:
        with StudentClient(0, 12, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=HEARTBEAT_S,
                           direct_requests=False) as client:
            client.hello()
            generation = client.set_model("m")
            deadline = time.monotonic() + 60
            while broker.stats.workers < 1:  # the hanging worker takes the first WORKs alone
                assert time.monotonic() < deadline, "the hanging worker never joined"
                time.sleep(0.05)
            seen = peers.consume_verified(client, generation, 3)  # of its first two batches (2 slots each)
            while not busy_file.exists():
                assert time.monotonic() < deadline, "the worker never got to its hanging batch"
                time.sleep(0.02)
            hung_at = time.monotonic()
            good.start()
            while broker.stats.quarantined == 0:
                assert time.monotonic() - hung_at < 8, "the hanging worker's slots were never quarantined"
                seen = peers.consume_verified(client, generation, len(seen) + 1, seen=seen, timeout_ms=10_000)
            waited = time.monotonic() - hung_at
            peers.consume_verified(client, generation, len(seen) + 30, seen=seen)  # served on by the good worker
        stats = broker.stats
        assert stats.overdue == 1 and stats.quarantined >= 1, stats
        # The broker times the WORK from its dispatch, a little before the test sees the batch
        # start (the busy file), so the quarantine may come up to that much short of the floor.
        assert WORK_TIMEOUT_MIN_BEATS * HEARTBEAT_S - DISPATCH_SLACK_S <= waited < 8
        lines = [r.getMessage() for r in caplog.records if "past its deadline" in r.getMessage()]
        assert len(lines) == 1 and "10 heartbeats" in lines[0], lines
    finally:
        good.stop()
        broker.stop()
