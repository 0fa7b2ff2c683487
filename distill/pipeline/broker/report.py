"""STATS answers: what one STATS costs the broker is the same for 1 run or 1,000.

- the answer's ``per_run`` names the ``protocol.STATS_TOP_RUNS`` busiest runs
  (``BrokerState.snapshot``), plus the run a STATS names (``STATS.run_id``);
- the encoded answer is kept and rebuilt only once it is older than REBUILD_FACTOR times
  what building it took, so building takes at most 1 / REBUILD_FACTOR of the broker's
  time however fast STATS come;
- a STATS is handled within the ingress' share for dear messages, charged to its sender
  (``ingress.py``).

Why, with the figures: docs/security.md, section Bounded replies (issue 37).
"""

from __future__ import annotations

import dataclasses
import time

from distill.pipeline import protocol
from distill.pipeline.broker.state import BrokerState, run_entry
from distill.pipeline.protocol import Command
from distill.pipeline.stats import BrokerStats

REBUILD_FACTOR = 20
"""An answer is kept this many times as long as building it took."""
MAX_AGE_S = 0.5
"""... and never longer than this."""


class StatsReport:
    """The broker's answer to STATS, kept encoded (see the module docstring)."""

    def __init__(self, state: BrokerState) -> None:
        self._state = state
        self._stats: BrokerStats | None = None
        self._frames: list[bytes] = []
        self._fresh_until = 0.0

    def frames(self, run_id: str | None = None) -> list[bytes]:
        """The frames of a STATS_REPLY (with ``run_id``'s entry, when that run exists)."""
        now = time.perf_counter()
        if self._stats is None or now >= self._fresh_until:
            self._rebuild(now)
        assert self._stats is not None
        run = self._state.runs.get(run_id) if run_id is not None else None
        if run is None or run.run_id in self._stats.per_run:
            return self._frames
        stats = dataclasses.replace(self._stats, per_run={**self._stats.per_run, run.run_id: run_entry(run)})
        return protocol.encode(Command.STATS_REPLY, {"stats": stats.to_dict()})

    def _rebuild(self, started: float) -> None:
        self._stats = self._state.snapshot(top_runs=protocol.STATS_TOP_RUNS)
        self._frames = protocol.encode(Command.STATS_REPLY, {"stats": self._stats.to_dict()})
        done = time.perf_counter()
        self._fresh_until = done + min(MAX_AGE_S, REBUILD_FACTOR * (done - started))
