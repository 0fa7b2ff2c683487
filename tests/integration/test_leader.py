"""Only the leader switches a run's model, and a stale leader (older epoch) is refused."""

from __future__ import annotations

import pytest

from distill.pipeline import Broker, StudentClient
from tests import peers


def _client(endpoints: dict[str, str], rank: int = 0, epoch: int | None = None) -> StudentClient:
    return StudentClient(rank, 2, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], leader_epoch=epoch)


@pytest.mark.timeout(60)
def test_a_stale_leader_is_refused_and_the_newest_one_wins(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    with _client(endpoints, epoch=10) as old, _client(endpoints, epoch=20) as new, \
            _client(endpoints, epoch=20) as twin:
        assert old.set_model("layer_0") == 1
        assert new.set_model("layer_1") == 2  # a newer leader (say, the job restarted) takes over
        with pytest.raises(RuntimeError, match="epoch 10.*not the leader"):
            old.set_model("layer_9")
        with pytest.raises(RuntimeError, match="not the leader"):
            twin.set_model("layer_9")  # same epoch, another process: refused too
        assert new.set_model("layer_2") == 3
        stats = broker.stats
        assert stats.per_run["default"]["model_id"] == "layer_2"
        assert stats.per_run["default"]["generation"] == 3
    broker.stop()


def test_a_follower_rank_cannot_switch_the_model(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs).start()
    with _client(endpoints, rank=1) as follower, pytest.raises(RuntimeError, match="rank 1 is not the leader"):
        follower.set_model("layer_0")
    assert broker.stats.per_run == {}
    broker.stop()
