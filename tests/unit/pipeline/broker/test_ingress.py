"""The broker's ingress: large messages wait their turn while small ones come, not on an idle broker."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from distill.pipeline.broker.ingress import BULK_BYTES, PARKED_SHARE, QUIET_S, Ingress
from distill.pipeline.stats import BrokerStats

LARGE_S = 0.02
"""What handling one large message costs here (the route sleeps)."""


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://ingress")
    dealer.connect("inproc://ingress")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _ingress(handled: list[int]) -> Ingress:
    def route(sock: zmq.Socket, identity: bytes, frames: list[bytes], key: str | None) -> None:
        handled.append(len(frames[-1]))
        if len(frames[-1]) > BULK_BYTES:
            time.sleep(LARGE_S)
    return Ingress(route, BrokerStats(), keyed=False)


def _send(dealer: zmq.Socket, router: zmq.Socket, ingress: Ingress, size: int) -> None:
    dealer.send_multipart([b"tag", b"cmd", bytes(size)])
    assert router.poll(1000)
    ingress.drain(router)


def test_large_messages_run_back_to_back_once_small_ones_stop(pair) -> None:
    router, dealer = pair
    handled: list[int] = []
    ingress = _ingress(handled)
    for _ in range(3):
        _send(dealer, router, ingress, 2 * BULK_BYTES)
    started = time.perf_counter()
    while ingress.waiting_s is not None and time.perf_counter() - started < 5:
        time.sleep(ingress.waiting_s)
        ingress.serve_parked()
    took = time.perf_counter() - started
    assert handled == [2 * BULK_BYTES] * 3
    # Their turns alone would be 3 x LARGE_S + 2 x LARGE_S x 9 = 0.42 s; no small message
    # came for QUIET_S, so nothing waits behind them.
    assert took < 3 * LARGE_S + 2 * QUIET_S + 0.1, took


def test_large_messages_get_their_share_while_small_ones_come(pair) -> None:
    router, dealer = pair
    handled: list[int] = []
    ingress = _ingress(handled)
    for _ in range(2):
        _send(dealer, router, ingress, 2 * BULK_BYTES)
    ingress.serve_parked()
    assert handled == [2 * BULK_BYTES]
    turn = LARGE_S * (1 / PARKED_SHARE - 1)
    started = time.perf_counter()
    while time.perf_counter() - started < turn * 0.8:  # small messages keep coming
        other = router.context.socket(zmq.DEALER)  # another peer: not behind the parked ones
        other.connect("inproc://ingress")
        _send(other, router, ingress, 16)
        other.close(0)
        ingress.serve_parked()
        time.sleep(0.005)
    assert handled.count(2 * BULK_BYTES) == 1, "a large message jumped the small ones' turn"
    time.sleep(max(0.0, ingress.waiting_s or 0.0))
    ingress.serve_parked()
    assert handled.count(2 * BULK_BYTES) == 2
