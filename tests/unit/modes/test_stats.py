"""mode=stats: one STATS round trip to a live broker, formatted for the terminal."""

from __future__ import annotations

from distill.modes.stats import STATS_COLUMNS, fetch_stats, format_stats
from distill.pipeline import Broker


def test_fetch_and_format_stats(broker_kwargs, endpoints) -> None:
    broker = Broker(**broker_kwargs).start()
    stats = fetch_stats(endpoints["frontend"])
    broker.stop()
    assert stats is not None and stats["workers"] == 0
    line = format_stats(stats)
    for column in STATS_COLUMNS:
        assert f"{column}=" in line


def test_no_broker_gives_none(endpoints) -> None:
    assert fetch_stats(endpoints["frontend"], timeout_ms=200) is None
