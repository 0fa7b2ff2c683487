"""Fan-out: runs of the same model share teacher samples (one forward, several runs'
slots), never at the cost of a run's own generation; and runs are served fairly."""

from __future__ import annotations

import pytest

from distill.pipeline import Broker
from tests import peers
from tests.conftest import MP

SPAWN_TIMEOUT_S = 120


def _start_runs(procs, endpoints, plans: dict[str, dict], *, fan_out: bool, workers: int = 1,
                **student_kwargs) -> dict[str, dict]:
    """Start ``workers`` workers and one student per run (plans: run id -> kwargs of
    the student); all runs start asking at once. Returns each run's result."""
    started = [procs.start(peers.run_layer_worker, endpoints, name=f"worker{i}") for i in range(workers)]
    results, start = MP.Queue(), MP.Barrier(len(plans))
    students = [procs.start(peers.run_sharing_student, endpoints, run_id, plan["layers"], plan["samples"],
                            results, start, fan_out=fan_out, name=run_id, **student_kwargs)
                for run_id, plan in plans.items()]
    got = {r["run_id"]: r for r in procs.collect(results, len(plans), students + started, SPAWN_TIMEOUT_S)}
    for student in students:
        procs.join(student, 30)
    for result in got.values():
        assert result["foreign"] == 0, f"a sample of another layer or generation was yielded: {result['run_id']}"
        assert result["corrupt"] == 0, f"a torn or mixed-up sample was yielded: {result['run_id']}"
    return got


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fan_out", [True, False])
def test_one_teacher_sample_feeds_every_sharing_run(procs, endpoints, broker_kwargs, fan_out) -> None:
    """Two runs of one model, both opted in: most samples are computed once for both
    (about half as many distinct samples as delivered); not opted in: none is."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    plans = {"a": {"layers": [0], "samples": 240}, "b": {"layers": [0], "samples": 240}}
    got = _start_runs(procs, endpoints, plans, fan_out=fan_out)
    broker.stop()
    delivered = sum(len(r["tags"]) for r in got.values())
    distinct = len(set(got["a"]["tags"]) | set(got["b"]["tags"]))
    both = len(set(got["a"]["tags"]) & set(got["b"]["tags"]))
    if fan_out:
        assert distinct <= 0.75 * delivered, f"fan-out computed {distinct} samples for {delivered} delivered"
        assert both >= 0.5 * min(len(r["tags"]) for r in got.values())
    else:
        assert distinct == delivered and both == 0


@pytest.mark.timeout(150)
def test_a_switch_in_one_run_never_discards_a_sharing_runs_samples(procs, endpoints, broker_kwargs) -> None:
    """Run a leaves the shared layer and comes back while b trains on it all along:
    b loses nothing, a only ever gets samples of its current layer and generation."""
    # Runs are kept long after their students leave: b may finish seconds before a, and the
    # broker's statistics of it are read only once both have.
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2, run_grace_s=120.0).start()
    plans = {"a": {"layers": [0, 1, 0], "samples": 100}, "b": {"layers": [0], "samples": 400}}
    got = _start_runs(procs, endpoints, plans, fan_out=True, workers=2)
    per_run = broker.stats.per_run
    broker.stop()
    assert got["a"]["generations"] == [1, 2, 3] and got["b"]["generations"] == [1]
    # (slots b's student left in flight at its end are counted apart, as ``abandoned``)
    assert per_run["b"]["discarded"] == 0, f"a's switches discarded b's shared work: {per_run}"
    assert got["b"]["counts"]["discarded"] == got["b"]["counts"]["stale"] == 0
    # a's slots vanish when it leaves: b's copies of them are made in b's own slots, not failed.
    assert got["b"]["counts"]["failed"] == 0, got["b"]["counts"]
    assert set(got["a"]["tags"]) & set(got["b"]["tags"]), "the runs never shared a sample"


@pytest.mark.timeout(120)
def test_two_runs_with_equal_demand_get_equal_shares(procs, endpoints, broker_kwargs) -> None:
    """One worker, the bottleneck (its batches take 20 ms); two runs that always ask
    for more get between 35% and 65% each of what it makes in a 3 s window."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    plans = {"a": {"layers": [0], "samples": 0}, "b": {"layers": [0], "samples": 0}}
    got = _start_runs(procs, endpoints, plans, fan_out=False, seconds=3.0, delay_s=0.02)
    broker.stop()
    counts = {run_id: len(r["tags"]) for run_id, r in got.items()}
    assert min(counts.values()) > 0, counts
    share = counts["a"] / sum(counts.values())
    assert 0.35 <= share <= 0.65, f"unfair shares over 3 s: {counts}"
