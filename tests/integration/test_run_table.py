"""Issue 37, item 4: the run table cannot be filled for the broker's life, a refusal is
said at once, and a client dropped without close() blocks no thread.

1,024 SET_MODELs for made-up run ids (about a second) used to fill the table (max_runs)
for good: every new run, ``default`` included, was refused while the broker lived, and
the refused client waited for an answer that had already come (an ERROR it only logged),
then blamed a dead broker. A StudentClient dropped without close() left a
``zmq.Context`` whose garbage collection waited for ever on the client's own socket,
in whichever thread collected it. A real broker, real clients and real sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from distill.pipeline import Broker, BrokerRefusal, StudentClient
from distill.pipeline.protocol import Command
from tests import peers
from tests.conftest import MP
from tests.hostile import Peer, fetch_stats, set_model

pytestmark = pytest.mark.timeout(60)

BEAT_S = 0.2
"""The broker's heartbeat interval: a run without live peers is forgotten 10 beats (2 s) on."""


def _client(endpoints: dict[str, str], run_id: str, **kwargs: object) -> StudentClient:
    return StudentClient(0, 2, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], run_id=run_id, heartbeat_interval_s=BEAT_S,
                         **{"broker_wait_s": 5.0, **kwargs})


def _wait_stats(endpoints: dict[str, str], ok: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = fetch_stats(endpoints["frontend"])
        assert stats is not None, "the broker no longer answers STATS"
        if ok(stats):
            return stats
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s: {stats['runs']} runs, " \
                                            f"{stats['students']} students"
        time.sleep(BEAT_S)


def test_made_up_runs_leave_room_for_a_new_run_and_are_forgotten(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=BEAT_S).start()
    attacker = Peer(endpoints["control"])
    try:
        max_runs = broker.config.max_runs
        for i in range(max_runs):
            attacker.send(Command.SET_MODEL, set_model(run_id=f"made-up-{i}", peer_id="attacker"))
        answered, deadline = 0, time.monotonic() + 60  # a loaded machine pauses the broker for seconds
        while answered < max_runs and time.monotonic() < deadline:
            answered += len(attacker.collect(Command.MODEL_SET, quiet_s=1.0))
        assert answered == max_runs
        with _client(endpoints, "default") as client:
            started = time.monotonic()
            assert client.hello()["generation"] == 0  # used to wait, refused, then blame the broker
            assert client.set_model("m") == 1
            assert time.monotonic() - started < 3.0
            # The made-up runs (no live peer ever) are forgotten; the live one keeps its model.
            stats = _wait_stats(endpoints, lambda s: s["runs"] == 1, 10.0, "the made-up runs not forgotten")
            assert stats["per_run"]["default"]["model_id"] == "m"
            assert stats["per_run"]["default"]["generation"] == 1
    finally:
        attacker.close()
        broker.stop()


def test_a_run_is_forgotten_once_its_peers_are_gone_and_kept_while_its_leader_beats(
        endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=BEAT_S).start()
    try:
        with _client(endpoints, "kept") as leader:
            assert leader.set_model("m") == 1  # no HELLO: only its heartbeats say it is alive
            with _client(endpoints, "left") as gone:
                gone.hello()
                assert gone.set_model("m") == 1
            stats = _wait_stats(endpoints, lambda s: "left" not in s["per_run"], 10.0,
                                "a run whose student and leader left is not forgotten")
            assert stats["per_run"]["kept"]["model_id"] == "m"
            time.sleep(3.0)  # past the grace: the leader's heartbeats alone keep its run
            stats = _wait_stats(endpoints, lambda s: True, 1.0, "")
            assert stats["per_run"]["kept"] == {**stats["per_run"]["kept"], "model_id": "m", "generation": 1}
    finally:
        broker.stop()


def test_a_refused_hello_or_set_model_fails_at_once_with_the_brokers_reason(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=BEAT_S, max_runs=1).start()
    try:
        with _client(endpoints, "a") as first, _client(endpoints, "b", broker_wait_s=8.0) as second:
            first.hello()  # a live run fills the table: it is never given up for a new one
            started = time.monotonic()
            with pytest.raises(BrokerRefusal, match=r"refused HELLO: .*over the broker's max_runs"):
                second.hello()
            with pytest.raises(BrokerRefusal, match=r"refused SET_MODEL: .*over the broker's max_runs"):
                second.set_model("m")
            assert time.monotonic() - started < 2.0
    finally:
        broker.stop()


def test_a_client_dropped_without_close_blocks_no_thread_and_stops_beating(
        procs, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=BEAT_S, max_runs=1).start()
    results, done = MP.Queue(), MP.Event()
    try:
        with _client(endpoints, "a") as live:
            live.hello()
            child = procs.start(peers.run_dropped_clients, endpoints, "b", "a", results, done, name="dropper")
            (got,) = procs.collect(results, 1, [child], 60)
            assert got["gc_s"] is not None, "collecting the dropped clients blocked its thread"
            assert got["gc_s"] < 5.0, got
            refused, welcomed = got["outcomes"]
            assert refused.startswith("BrokerRefusal") and "max_runs" in refused, refused
            assert welcomed == "welcomed"
            # The dropped clients beat no more: the broker forgets them while their process lives.
            _wait_stats(endpoints, lambda s: s["students"] == 1, 5.0, "a dropped client still beats")
            assert child.is_alive()
            done.set()
            procs.join(child, 30)
    finally:
        done.set()
        broker.stop()
