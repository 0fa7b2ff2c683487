"""Several runs (the jobs of a sweep) on one broker and one worker pool: each has its
own model and generation, and neither sees, nor waits for, the other's work."""

from __future__ import annotations

import pytest

from distill.pipeline import Broker
from tests import peers
from tests.conftest import MP

SPAWN_TIMEOUT_S = 120


@pytest.mark.timeout(150)
def test_two_runs_at_different_layers_share_two_workers(procs, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    workers = [procs.start(peers.run_layer_worker, endpoints, name=f"worker{i}") for i in range(2)]
    results = MP.Queue()
    # Run a switches layer three times while run b trains on one layer all along.
    switching = procs.start(peers.run_layer_student, endpoints, "run-a", [1, 2, 3], 100, results, name="a")
    steady = procs.start(peers.run_layer_student, endpoints, "run-b", [5], 400, results, name="b")
    got = {r["run_id"]: r for r in procs.collect(results, 2, [switching, steady, *workers], SPAWN_TIMEOUT_S)}
    procs.join(switching, 30)
    procs.join(steady, 30)
    per_run = broker.stats.per_run
    broker.stop()
    for run_id, result in got.items():
        assert result["foreign"] == 0, f"{run_id} got samples of another run or layer: {result}"
        assert result["corrupt"] == 0, result
    assert got["run-a"]["generations"] == [1, 2, 3]
    assert got["run-b"]["generations"] == [1]  # a's switches did not bump b's generation
    assert per_run["run-b"]["discarded"] == 0, f"a's switches discarded b's work: {per_run}"
    assert got["run-b"]["counts"]["discarded"] == got["run-b"]["counts"]["stale"] == 0
    assert per_run["run-a"]["model_id"] == "layer_3" and per_run["run-b"]["model_id"] == "layer_5"
