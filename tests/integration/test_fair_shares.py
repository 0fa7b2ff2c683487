"""Issue 37, item 3: one run's peers cannot starve another run.

Free connections used to fill the broker's global ``max_queued`` for a run nobody
serves (no model), kept alive by HEARTBEATs sent for their peer ids from one socket: a
real student of another run got no sample in 10 s (310,888 of its slots refused). Now a
run may queue at most its fair share of ``max_queued`` (what a run over its share holds
is taken back when another run asks), a connection at most its share of its run's, and
a heartbeat keeps alive only the peer ids of the connection it comes from, so a run
whose peers are gone is forgotten. Real broker, worker and student processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from distill.pipeline import Broker, StudentClient
from distill.pipeline.protocol import Command
from tests import hostile, peers
from tests.conftest import MP
from tests.hostile import Peer, fetch_stats, medium_name, request

pytestmark = pytest.mark.timeout(90)

BEAT_S = 0.2
"""The broker's heartbeat interval: a student is given up on 3 beats (0.6 s) after its last
message, its run 10 beats (2 s) after that."""
LIMITS = {"max_queued": 2000}
HOG = {"connections": 8, "peers_per_connection": 4, "slots_per_peer": 250}
"""8 connections x 4 peer ids x 250 slots: 8,000 slots asked for every half second, four
times the broker's max_queued."""


def _until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def _start_broker(procs, endpoints: dict[str, str]):
    """A broker process with LIMITS, once it answers (spawning it takes seconds on a loaded machine)."""
    broker = procs.start(peers.run_limited_broker, endpoints, LIMITS, name="broker")
    _until(lambda: broker.is_alive() and fetch_stats(endpoints["frontend"], timeout_s=1.0) is not None,
           "the broker serves", 60)
    return broker


def _samples_in(client: StudentClient, generation: int, seconds: float, seen: set[int]) -> int:
    """Verified samples the client gets in ``seconds`` (each released at once)."""
    got, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ref = client.request_sample(timeout_ms=left * 1000)
        if ref is None:
            break
        assert ref.generation == generation and ref.request_id not in seen
        seen.add(ref.request_id)
        client.release_slot(ref.slot_id)
        got += 1
    return got


@pytest.mark.alone  # compares a rate with and without the hog
@pytest.mark.parametrize(("hog_run", "floor"), [("hog", 1 / 2), ("default", 1 / 4)], ids=["another_run", "same_run"])
def test_free_connections_that_fill_the_queue_leave_a_good_student_its_share(procs, endpoints, hog_run,
                                                                             floor) -> None:
    """The hog asks for a run nobody serves (its slots stay queued), or for the good
    student's own run: then its slots reach the worker too (and fail: nobody made their
    segments), which serves the run's connections in turn, so the good student keeps
    less (``floor``: the share of its quiet rate it must keep; main gave it 5 and 29 samples/s)."""
    _start_broker(procs, endpoints)
    # Every slot of the good student goes through the broker's queue (no direct requests).
    procs.start(peers.run_worker, endpoints, name="worker", direct_requests=False)
    counts = MP.Queue()
    with StudentClient(0, 16, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=BEAT_S) as client:
        client.hello()
        generation = client.set_model("m")
        seen = peers.consume_verified(client, generation, 20)
        quiet = _samples_in(client, generation, 2.0, seen)
        hog = procs.start(hostile.run_queue_hog, endpoints["frontend"], hog_run, *HOG.values(), 8.0, counts,
                          name="hog")
        _until(lambda: fetch_stats(endpoints["frontend"])["students"] > 1, "the hog asks for slots", 30)
        time.sleep(1.0)  # the hog has asked twice, for four times max_queued each time
        attacked = _samples_in(client, generation, 3.0, seen)
        stats = fetch_stats(endpoints["frontend"])
        procs.join(hog, 30)
    sent = counts.get(timeout=5)
    assert sent["asked"] >= 4 * LIMITS["max_queued"], sent
    assert stats["refused"] > 0 and stats["queued"] <= LIMITS["max_queued"], stats
    quiet_rate, attacked_rate = quiet / 2.0, attacked / 3.0
    assert attacked_rate >= quiet_rate * floor, \
        f"the good student got {attacked_rate:.0f} samples/s under the hog, {quiet_rate:.0f}/s before it"


def test_heartbeats_keep_alive_only_the_peers_of_their_own_connection(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=BEAT_S).start()
    hog, beats = Peer(endpoints["frontend"], "hog-requests"), Peer(endpoints["frontend"], "hog-beats")
    try:
        with StudentClient(0, 2, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=BEAT_S) as client:
            client.hello()  # a real student: its heartbeats (a socket of its own) keep it alive
            for p in range(4):
                hog.send(Command.REQUEST, request(f"hog-{p}", medium_name("hog"), run_id="hog",
                                                  slots=[[10 * p + i, i] for i in range(10)]))
            _until(lambda: broker.stats.students == 5, "the hog's peers are registered", 5)
            refusals: list[str] = []

            def beat_for_the_hog() -> bool:
                for p in range(4):
                    beats.send(Command.HEARTBEAT, {"peer_id": f"hog-{p}", "role": "student"})
                while (msg := beats.recv(0.05)) is not None:
                    if msg.command is Command.ERROR:
                        refusals.append(msg.body["reason"])
                stats = fetch_stats(endpoints["frontend"])
                return stats["students"] == 1 and "hog" not in stats["per_run"]

            _until(beat_for_the_hog, "the hog's peers, beaten for from another connection, are dropped "
                                     "and their run forgotten", 8)
            assert refusals and all("bound to another connection" in r for r in refusals), refusals[:3]
            stats = fetch_stats(endpoints["frontend"])
            assert stats["queued"] == 0 and "default" in stats["per_run"], stats
    finally:
        hog.close()
        beats.close()
        broker.stop()
