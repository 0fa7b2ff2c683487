"""Broker statistics: counters, peers and rates, as returned by STATS."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

RATE_WINDOW_S = 10.0
RATE_BUCKET_S = 0.1
"""Events closer than this are added up in one entry: a flood of messages cannot
grow a meter beyond RATE_WINDOW_S / RATE_BUCKET_S entries."""


@dataclass
class RateMeter:
    """Events per second over the last ``RATE_WINDOW_S`` seconds."""

    _events: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._events and now - self._events[-1][0] < RATE_BUCKET_S:
            start, total = self._events[-1]
            self._events[-1] = (start, total + count)
        else:
            self._events.append((now, count))
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return sum(c for _, c in self._events) / max(span, min(RATE_WINDOW_S, 1.0))

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > RATE_WINDOW_S:
            self._events.popleft()


@dataclass
class BrokerStats:
    """A snapshot of the broker's counters (all counts are slots, not messages)."""

    queued: int = 0
    in_flight: int = 0
    requested: int = 0
    dispatched: int = 0
    completed: int = 0
    notified: int = 0
    """Of ``completed``: announced to their students by the worker itself (``notices.py``)."""
    direct: int = 0
    """Of ``completed``: filled for students' DIRECT requests, past the broker (as workers
    report them, up to a heartbeat late)."""
    discarded: int = 0
    requeued: int = 0
    quarantined: int = 0
    """Slots of workers declared dead that may still be written (not handed out again)."""
    released: int = 0
    """Quarantined slots freed by their worker's late DONE."""
    failed: int = 0
    refused: int = 0
    bad_messages: int = 0
    """Messages refused: malformed, over a limit, or naming what is not the sender's."""
    foreign: int = 0
    """Of ``bad_messages``: naming another connection's peer id or medium (an impostor)."""
    overdue: int = 0
    """WORKs past their deadline (``work_timeout_s``): their worker was quarantined."""
    errors: int = 0
    """Messages whose handling raised (a bug, logged with the peer; the broker serves on)."""
    throttled: int = 0
    """Refusals answered without naming their slots (``limits.EchoBudget``)."""
    dropped_replies: int = 0
    """Replies not sent because their connection had BROKER_REPLY_HWM unread ones (a peer
    that does not read: its students were forgotten, ``broker/service.py``)."""
    workers: int = 0
    students: int = 0
    runs: int = 0
    completed_per_s: float = 0.0
    requested_per_s: float = 0.0
    uptime_s: float = 0.0
    per_run: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Run id -> its model, generation and counts. In a STATS_REPLY at most
    ``protocol.STATS_TOP_RUNS`` runs (the busiest, and the one STATS.run_id names); ``runs``
    counts them all."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
