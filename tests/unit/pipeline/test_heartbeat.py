"""Early heartbeats: a worker whose DIRECT backlog empties tells the broker at once
(``Heartbeater.beat_soon``) rather than up to an interval later, and never more often than
``liveness.EARLY_BEAT_GAP_S``."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from distill.pipeline import protocol
from distill.pipeline.liveness import EARLY_BEAT_GAP_S, Heartbeater
from distill.pipeline.protocol import Command

INTERVAL_S = 5.0


def _beat_times(router: zmq.Socket, count: int, timeout_s: float) -> list[float]:
    """When each of the next ``count`` HEARTBEATs reached ``router`` (fewer if ``timeout_s`` passes)."""
    times, deadline = [], time.monotonic() + timeout_s
    while len(times) < count and (left := deadline - time.monotonic()) > 0:
        if router.poll(left * 1000):
            _identity, msg = protocol.recv_routed(router)
            assert not isinstance(msg, Exception) and msg.command is Command.HEARTBEAT
            times.append(time.monotonic())
    return times


def test_beat_soon_sends_the_next_beat_early_but_not_twice_within_the_gap(tmp_path: Path) -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/beat.sock"
    router.bind(endpoint)
    values = iter(range(1000))
    heart = Heartbeater(endpoint, "w", "worker", interval_s=INTERVAL_S, first_beat_now=True,
                        extra=lambda: {"backlog": next(values)}).start()
    try:
        assert len(_beat_times(router, 1, 10)) == 1  # the first beat, at once
        asked = time.monotonic()
        heart.beat_soon()
        (early,) = _beat_times(router, 1, INTERVAL_S / 2)
        assert early - asked < 1.0  # not the interval's 5 s
        heart.beat_soon()
        heart.beat_soon()  # asked twice: one beat, after the gap
        beats = _beat_times(router, 2, INTERVAL_S / 2)
        assert len(beats) == 1 and beats[0] - early >= EARLY_BEAT_GAP_S * 0.9
        assert _beat_times(router, 1, 1.0) == []  # and back to the interval
    finally:
        heart.stop(wait=False)
        router.close(linger=0)
