"""How long a worker may take: measured batch times, and the deadlines derived from them.

A worker's heartbeats come from a thread of their own and beat on while its batch
function hangs, so the broker times two things and quarantines a worker past either
deadline exactly like one that missed its heartbeats:

- each worker's oldest in-flight WORK, from its sending or from the worker's last DONE
  if that came later (a worker does its WORKs in order) (:meth:`BatchClock.overdue`);
- a worker that holds DIRECT slots (``backlog``) and whose finished ``batches`` count
  has not moved for longer than its model's deadline (:meth:`BatchClock.stalled`).

Each model is measured on its own (a deeper layer takes longer), and a worker's first
batch of a model (weights to load, kernels to compile) is measured against the run's
slowest first batch. The deadline formula
(``WORK_TIMEOUT_FACTOR``, ``WORK_TIMEOUT_MIN_BEATS``, ``work_timeout_s``,
``first_work_timeout_s``): docs/pipeline.md, section Direct requests ("A worker that
hangs on the direct path").
"""

from __future__ import annotations

from collections import OrderedDict, deque

from distill.pipeline.broker.config import WORK_TIMEOUT_FACTOR, WORK_TIMEOUT_MIN_BEATS, BrokerConfig
from distill.pipeline.broker.records import Work, WorkerPeer

HISTORY = 32
"""Batch times remembered per model (and first batches per run)."""
MAX_MODELS = 256
"""Models (and runs) whose batch times are remembered (least recently measured forgotten first)."""

Deadline = tuple[float, str]
"""Seconds allowed, and how they were chosen (for the log)."""


class BatchClock:
    """Batch times per model and first batches per run, and the deadlines of each worker."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self._times: OrderedDict[str | None, deque[float]] = OrderedDict()
        self._firsts: OrderedDict[str, deque[float]] = OrderedDict()
        """run -> how long workers' first batches of a model took (loading, compiling included)."""

    def observe(self, worker: WorkerPeer, work: Work, now: float) -> None:
        """A DONE for ``work`` came at ``now``: note how long the worker spent on it (as a
        first batch too, when it was the worker's first of its model)."""
        seconds = max(0.0, now - max(work.sent_at, worker.last_done_at))
        _remember(self._times, work.model_id, seconds)
        if work.model_id != worker.last_model:
            _remember(self._firsts, work.run_id, seconds)

    def deadline_s(self, model_id: str | None, run_id: str | None = None, *, first: bool = False) -> Deadline:
        """The deadline of a batch of ``model_id`` (of run ``run_id``; ``first``: the
        worker's first of that model), and how it was chosen."""
        config = self.config
        if config.work_timeout_s is not None:
            return config.work_timeout_s, "work_timeout_s"
        times = self._times.get(model_id)
        steady = self._derived(max(times), "its slowest recent batch") if times else None
        firsts = self._firsts.get(run_id) if first else None
        if firsts:
            derived = self._derived(max(firsts), "the slowest first batch measured in its run")
            return derived if steady is None or derived[0] >= steady[0] else steady
        if steady is not None:
            return steady
        floor = config.heartbeat_interval_s * WORK_TIMEOUT_MIN_BEATS
        return max(floor, config.first_work_timeout_s), "first_work_timeout_s: nothing measured yet"

    def _derived(self, slowest: float, what: str) -> Deadline:
        floor = self.config.heartbeat_interval_s * WORK_TIMEOUT_MIN_BEATS
        if WORK_TIMEOUT_FACTOR * slowest <= floor:
            return floor, f"{WORK_TIMEOUT_MIN_BEATS} heartbeats; {what} took {slowest:.3f}s"
        return WORK_TIMEOUT_FACTOR * slowest, f"{WORK_TIMEOUT_FACTOR:g} x {what}"

    def overdue(self, worker: WorkerPeer, now: float) -> tuple[Work, float, float, str] | None:
        """The worker's oldest WORK if it is past its deadline: (work, seconds on it,
        deadline, why that deadline); None when it is on time or idle."""
        oldest = next(iter(worker.in_flight.values()), None)
        if oldest is None:
            return None
        elapsed = now - max(oldest.sent_at, worker.last_done_at)
        deadline, why = self.deadline_s(oldest.model_id, oldest.run_id, first=oldest.model_id != worker.last_model)
        return (oldest, elapsed, deadline, why) if elapsed > deadline else None

    def stalled(self, worker: WorkerPeer, now: float) -> tuple[float, float, str] | None:
        """(seconds without progress, deadline, why that deadline) when the worker holds
        DIRECT slots and has finished no batch for longer than its deadline; None
        otherwise (no DIRECT held, progress made, or a worker that does not report it).
        WORK in flight is timed by :meth:`overdue`."""
        if worker.in_flight or worker.backlog <= 0 or worker.batches is None:
            return None
        elapsed = now - max(worker.progress_at, worker.backlog_since)
        deadline, why = self.deadline_s(worker.last_model, worker.last_run)
        return (elapsed, deadline, why) if elapsed > deadline else None


def _remember(table: OrderedDict, key: str | None, seconds: float) -> None:
    """Add a batch time under ``key``, keeping HISTORY per key and MAX_MODELS keys."""
    times = table.get(key)
    if times is None:
        times = table[key] = deque(maxlen=HISTORY)
        while len(table) > MAX_MODELS:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    times.append(seconds)
