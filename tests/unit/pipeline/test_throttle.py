"""LogThrottle: a flood of refusals logs a few lines and a count, not one line each."""

from __future__ import annotations

import logging
import time

import pytest

from distill.pipeline.stats import RATE_BUCKET_S, RATE_WINDOW_S, RateMeter
from distill.pipeline.throttle import LogThrottle


def test_log_throttle_keeps_a_burst_then_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("distill.test_throttle")
    throttle = LogThrottle(logger, interval_s=0.2, burst=3)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for i in range(1000):
            throttle.warning("refused %d", i)
        time.sleep(0.25)
        throttle.warning("refused again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["refused 0", "refused 1", "refused 2"]
    assert lines[3].startswith("... and 997 more like these")
    assert lines[4] == "refused again" and len(lines) == 5


def test_rate_meter_holds_one_entry_per_bucket_whatever_the_event_count() -> None:
    meter = RateMeter()
    for i in range(100_000):
        meter.add(1, now=i * 1e-4)  # 100,000 events in 10 s
    assert len(meter._events) <= RATE_WINDOW_S / RATE_BUCKET_S + 1
    assert meter.rate(now=10.0) == pytest.approx(10_000, rel=0.05)
