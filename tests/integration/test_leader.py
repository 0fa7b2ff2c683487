"""Only the leader switches a run's model: the holder of the run's secret, at the newest
epoch; a stale leader (older epoch), a twin (same epoch, another process), an epoch that
jumps, and a stranger (no secret) are refused."""

from __future__ import annotations

import pytest

from distill.pipeline import Broker, StudentClient
from tests import peers

SECRET = "the-job's-leader-secret"


def _client(endpoints: dict[str, str], rank: int = 0, epoch: int | None = None,
            secret: str | None = SECRET) -> StudentClient:
    return StudentClient(rank, 2, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], leader_epoch=epoch, leader_secret=secret)


@pytest.mark.timeout(60)
def test_a_stale_leader_is_refused_and_the_newest_one_wins(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    with _client(endpoints, epoch=10) as old, _client(endpoints, epoch=11) as new, \
            _client(endpoints, epoch=11) as twin, _client(endpoints, epoch=13) as jumper:
        assert old.set_model("layer_0") == 1
        assert new.set_model("layer_1") == 2  # a newer leader (say, the job restarted) takes over
        with pytest.raises(RuntimeError, match="epoch 10.*not the leader"):
            old.set_model("layer_9")
        with pytest.raises(RuntimeError, match="not the leader"):
            twin.set_model("layer_9")  # same epoch, another process: refused too
        with pytest.raises(RuntimeError, match="leader epoch 13 jumps past 12"):
            jumper.set_model("layer_9")  # epochs move by one step, never by a peer's choice
        assert new.set_model("layer_2") == 3
        stats = broker.stats
        assert stats.per_run["default"]["model_id"] == "layer_2"
        assert stats.per_run["default"]["generation"] == 3
    broker.stop()


@pytest.mark.timeout(60)
def test_a_restarted_leader_with_the_secret_takes_over_and_a_stranger_cannot(endpoints, broker_kwargs) -> None:
    """Default epochs: the broker counts them, and a new process holding the secret takes
    over at the next one; the process it replaced is stale from then on."""
    broker = Broker(**broker_kwargs).start()
    with _client(endpoints, secret=None) as first:
        assert first.set_model("layer_0") == 1
        assert first.leader_epoch == 1
        with _client(endpoints, secret=first.leader_secret) as restarted, \
                _client(endpoints, secret=None) as stranger:
            assert restarted.set_model("layer_1") == 2
            assert restarted.leader_epoch == 2
            with pytest.raises(RuntimeError, match="epoch 1.*not the leader"):
                first.set_model("layer_9")
            with pytest.raises(RuntimeError, match="leader secret does not match"):
                stranger.set_model("layer_9")
            with pytest.raises(RuntimeError, match="not its secret"):
                stranger.stop_workers()
            assert restarted.set_model("layer_2") == 3
    assert broker.stats.per_run["default"]["model_id"] == "layer_2"
    broker.stop()


def test_a_follower_rank_cannot_switch_the_model(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    with _client(endpoints, rank=1) as follower, pytest.raises(RuntimeError, match="rank 1 is not the leader"):
        follower.set_model("layer_0")
    assert broker.stats.per_run == {}
    broker.stop()
