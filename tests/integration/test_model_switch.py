"""Model switching under load on 2 gloo DDP ranks with DataLoader workers: no stale
sample is ever yielded after set_model returned, and no slot stays stuck."""

from __future__ import annotations

from distill.pipeline import Broker
from tests import peers
from tests.conftest import MP

SWITCHES = 12


def test_switching_under_load_two_ddp_ranks(procs, endpoints, broker_kwargs, tmp_path) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2,
                    # the run is read after its students left: kept longer than the
                    # test's teardown (its 2 s default grace at this heartbeat, under load)
                    run_grace_s=120).start()
    for _ in range(2):
        procs.start(peers.run_worker, endpoints, name="worker", max_batch=8)
    results = MP.Queue()
    init_file = str(tmp_path / "dist_init")
    ranks = [procs.start(peers.run_switch_rank, rank, 2, init_file, endpoints, SWITCHES, results,
                         name=f"rank{rank}") for rank in range(2)]
    reports = procs.collect(results, 2, ranks, timeout_s=240)
    for proc in ranks:
        procs.join(proc, 60)
    for report in reports:
        assert report["violations"] == 0, report
        assert report["corrupt"] == 0, report
        assert report["generation"] == SWITCHES, report
    stats = broker.stats
    assert stats.per_run["default"]["generation"] == SWITCHES
    assert stats.failed == 0
    broker.stop()
