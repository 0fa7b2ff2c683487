"""The load that follows the workers, its two decisions in isolation: which worker the
broker hands a WORK to (its credit less the DIRECT backlog it reported), and what the
heartbeats that carry the numbers may hold (``backlog``, ``workers``)."""

from __future__ import annotations

import msgpack
import pytest

from distill.pipeline.broker.dispatch import least_loaded
from distill.pipeline.broker.records import WorkerPeer
from distill.pipeline.protocol import PROTOCOL_TAG, Command, ProtocolError, decode, encode


def _peer(name: str, credit: int, backlog: int = 0) -> WorkerPeer:
    return WorkerPeer(name.encode(), name, None, credit, 64, 32, 0.0, backlog=backlog)


def test_a_worker_busy_with_direct_requests_is_passed_over_for_an_idle_one() -> None:
    """Both have all their broker credit (direct work spends none); the one that reported
    a backlog of 16 DIRECT slots is the more loaded, whatever their order."""
    busy, idle = _peer("busy", 64, backlog=16), _peer("idle", 64)
    assert least_loaded([busy, idle]) is idle
    assert least_loaded([idle, busy]) is idle


def test_credit_still_rules_and_a_worker_without_credit_is_never_picked() -> None:
    assert least_loaded([_peer("a", 10), _peer("b", 40, backlog=8)]).peer_id == "b"
    assert least_loaded([_peer("full", 0), _peer("late", 1, backlog=100)]).peer_id == "late"
    assert least_loaded([_peer("full", 0, backlog=0)]) is None
    assert least_loaded([]) is None


def test_heartbeats_carry_backlog_and_workers() -> None:
    beat = {"peer_id": "w", "role": "worker", "backlog": 12}
    assert decode(encode(Command.HEARTBEAT, beat)).body == beat
    answer = {"peer_id": "broker-1", "role": "broker", "interval_ms": 200, "workers": 3}
    assert decode(encode(Command.HEARTBEAT, answer)).body == answer


@pytest.mark.parametrize("field", ["backlog", "workers"])
@pytest.mark.parametrize("value", [-1, "3", 2**63, 1.5])
def test_a_bad_backlog_or_worker_count_is_refused(field: str, value: object) -> None:
    body = {"peer_id": "w", "role": "worker", field: value}
    with pytest.raises(ProtocolError):
        decode([PROTOCOL_TAG, Command.HEARTBEAT.value, msgpack.packb(body)])
