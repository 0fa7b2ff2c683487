"""How long a WORK may take: measured batch times, and the deadline derived from them.

A worker's heartbeats come from a thread of their own, so a worker whose batch
function hangs (a deadlocked teacher, a wedged GPU) still beats and would hold its
slots for ever. The broker therefore also times each worker's oldest in-flight WORK:
from its sending, or from the worker's last DONE if that came later (a worker does its
WORKs in order, so the next one only starts then). Past the deadline the worker is
quarantined exactly like one that missed its heartbeats.

The deadline is ``work_timeout_s`` when set; otherwise WORK_TIMEOUT_FACTOR times the
slowest of the last few batches of the WORK's model (a deeper layer takes longer, so
each model is measured on its own), at least WORK_TIMEOUT_MIN_BEATS heartbeats, and
``first_work_timeout_s`` while nothing of that model was measured yet.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from distill.pipeline.broker.config import WORK_TIMEOUT_FACTOR, WORK_TIMEOUT_MIN_BEATS, BrokerConfig
from distill.pipeline.broker.records import Work, WorkerPeer

HISTORY = 32
"""Batch times remembered per model."""
MAX_MODELS = 256
"""Models whose batch times are remembered (least recently measured forgotten first)."""


class BatchClock:
    """Batch times per model, and the deadline of each worker's oldest WORK."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self._times: OrderedDict[str | None, deque[float]] = OrderedDict()

    def observe(self, worker: WorkerPeer, work: Work, now: float) -> None:
        """A DONE for ``work`` came at ``now``: note how long the worker spent on it."""
        seconds = now - max(work.sent_at, worker.last_done_at)
        times = self._times.get(work.model_id)
        if times is None:
            times = self._times[work.model_id] = deque(maxlen=HISTORY)
            while len(self._times) > MAX_MODELS:
                self._times.popitem(last=False)
        else:
            self._times.move_to_end(work.model_id)
        times.append(max(0.0, seconds))

    def deadline_s(self, model_id: str | None) -> tuple[float, str]:
        """The deadline of a WORK of ``model_id``, and how it was chosen (for the log)."""
        config = self.config
        if config.work_timeout_s is not None:
            return config.work_timeout_s, "work_timeout_s"
        floor = config.heartbeat_interval_s * WORK_TIMEOUT_MIN_BEATS
        times = self._times.get(model_id)
        if not times:
            return max(floor, config.first_work_timeout_s), "first_work_timeout_s: nothing measured yet"
        slowest = max(times)
        if WORK_TIMEOUT_FACTOR * slowest <= floor:
            return floor, f"{WORK_TIMEOUT_MIN_BEATS} heartbeats; its slowest recent batch took {slowest:.3f}s"
        return WORK_TIMEOUT_FACTOR * slowest, f"{WORK_TIMEOUT_FACTOR:g} x its slowest recent batch"

    def overdue(self, worker: WorkerPeer, now: float) -> tuple[Work, float, float, str] | None:
        """The worker's oldest WORK if it is past its deadline: (work, seconds on it,
        deadline, why that deadline); None when it is on time or idle."""
        oldest = next(iter(worker.in_flight.values()), None)
        if oldest is None:
            return None
        elapsed = now - max(oldest.sent_at, worker.last_done_at)
        deadline, why = self.deadline_s(oldest.model_id)
        return (oldest, elapsed, deadline, why) if elapsed > deadline else None
