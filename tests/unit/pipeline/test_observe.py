"""The operator's one-shot calls (``pipeline/observe.py``) against a real broker and a
real worker process: STATS answers, a STOP ends the workers, and neither waits on a
broker that is not there."""

from __future__ import annotations

import time

from distill.pipeline import Broker
from distill.pipeline.observe import fetch_stats, send_stop
from tests import peers
from tests.hostile import stats_when


def test_stats_and_stop_reach_the_broker_and_its_workers(procs, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    try:
        worker = procs.start(peers.run_readme_worker, endpoints, 1024, name="worker")
        assert stats_when(endpoints["frontend"], lambda s: s["workers"] == 1, 60)["workers"] == 1
        stats = fetch_stats(endpoints["frontend"])
        assert stats is not None and stats["workers"] == 1 and "completed_per_s" in stats
        assert send_stop(endpoints["control"]) is True
        worker.join(timeout=30)
        assert worker.exitcode == 0  # it stopped on the broadcast, not on a signal
    finally:
        broker.stop()


def test_no_broker_is_an_answer_within_the_timeout(endpoints) -> None:
    started = time.monotonic()
    assert fetch_stats(endpoints["frontend"], timeout_ms=300) is None
    assert time.monotonic() - started < 2.0
