"""Rate-limited logging, for messages that untrusted input can trigger at will.

A peer that floods the broker with garbage must not flood its log as well (disk,
CPU, and the one useful line lost among millions). :class:`LogThrottle` writes the
first ``burst`` messages of each ``interval_s`` window and then, once the window is
over, one line saying how many it held back.
"""

from __future__ import annotations

import logging
import time

LOG_INTERVAL_S = 5.0
LOG_BURST = 10


class LogThrottle:
    """At most ``burst`` warnings per ``interval_s``, then a count of the rest."""

    def __init__(self, logger: logging.Logger, *, interval_s: float = LOG_INTERVAL_S,
                 burst: int = LOG_BURST) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.burst = burst
        self._window_start = float("-inf")
        self._logged = 0
        self._held_back = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.interval_s:
            if self._held_back:
                self.logger.warning("... and %d more like these in %.0fs (not logged)", self._held_back,
                                    now - self._window_start)
            self._window_start, self._logged, self._held_back = now, 0, 0
        if self._logged < self.burst:
            self._logged += 1
            self.logger.warning(msg, *args)
        else:
            self._held_back += 1
