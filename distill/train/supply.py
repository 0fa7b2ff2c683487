"""How well the teachers fed a stage, and what the log advises when they did not.

A stage's supply figures (``stage_end`` in metrics.jsonl) come from the student's clock and
from the broker's heartbeat answers: the share of the steps spent waiting, the samples/s
delivered and needed, and how many live workers delivered them. When the students waited,
the advice names those figures and says what would help, by how much: more workers at the
stage's own rate per worker, the running job's ``add_worker.sh``, and enough slots for the
added workers' full batches (``bench/scaling.py --app`` measures that the advice holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

STARVED_FRACTION = 0.05
"""Warn when students spend more than this share of their steps waiting for samples
(the first batch of a stage, which waits for the teachers to switch, not counted)."""


def data_supply(wait_s: float, step_s: float, samples: int, startup_wait_s: float = 0.0) -> dict[str, float]:
    """How well the teachers fed a stage, from the student's clock.

    ``step_s`` is the time of the training steps, waiting for data included;
    ``samples`` those the steps consumed (all ranks). Delivered is what arrived per
    second of steps; needed is what the students would have taken had they never
    waited. Their ratio is how many times more teacher throughput the stage lacked.
    The first batch of a stage (``startup_wait_s``: the teachers switching layers) is
    reported apart, not as starvation.
    """
    compute_s = max(step_s - wait_s, 1e-9)
    return {"wait_fraction": wait_s / step_s if step_s > 0 else 0.0,
            "delivered_samples_per_s": samples / step_s if step_s > 0 else 0.0,
            "needed_samples_per_s": samples / compute_s,
            "startup_wait_s": startup_wait_s}


class WorkersSeen:
    """The fewest and most live teacher workers the broker reported while a stage trained.

    Why: a stage's delivered samples/s means little without how many teachers delivered them;
    with both, the teacher-bound advice can say how many more would close the gap, and a stage
    trained after a worker joined can be told from one that trained before.
    """

    def __init__(self) -> None:
        self.fewest: int | None = None
        self.most: int | None = None

    def note(self, workers: int | None) -> None:
        if workers is None:  # the broker has not answered a heartbeat yet
            return
        self.fewest = workers if self.fewest is None else min(self.fewest, workers)
        self.most = workers if self.most is None else max(self.most, workers)

    def record(self) -> dict[str, int | None]:
        return {"workers_min": self.fewest, "workers_max": self.most}


def workers_short(supply: dict[str, float | int | None]) -> int | None:
    """How many more workers, each as fast as the stage's own were on average, would have
    delivered what the students needed (None: the number of workers is not known)."""
    workers = supply.get("workers_max")
    delivered = supply["delivered_samples_per_s"]
    if not workers or delivered <= 0:
        return None
    per_worker = delivered / workers
    return max(math.ceil(supply["needed_samples_per_s"] / per_worker - 1e-9) - workers, 1)


@dataclass(frozen=True)
class Slots:
    """The students' slots, as the advice weighs them against the workers' batches."""

    per_consumer: int
    """``pipeline.slot_count``: slots of each consumer process."""
    consumers: int
    """Consumer processes of the run: ranks x loader workers (the training process when none)."""
    worker_max_batch: int

    def for_full_batches(self, workers: int) -> int | None:
        """``pipeline.slot_count`` at which ``workers`` can all run full batches at once (None:
        it already can). Each worker fills its share of the slots, so with fewer slots than
        workers x batch the workers run partial batches, and a GPU teacher's batch takes about
        as long half full: more workers would then split the same slots, not add samples."""
        needed = math.ceil(workers * self.worker_max_batch / self.consumers)
        return needed if needed > self.per_consumer else None


def teacher_bound_advice(stage: int, supply: dict[str, float | int | None], add_worker: Path,
                         slots: Slots | None = None) -> str:
    """What the log says of a teacher-bound stage: the figures it rests on (the stage's
    ``stage_end`` record in metrics.jsonl, named), and what would help, by how much.

    More workers help in proportion while each brings a device of its own (a GPU teacher)
    and has slots enough for full batches; ``bench/scaling.py --app`` measures it through this
    application. ``add_worker``: the running job's script that adds one (mode=local), named
    when it exists."""
    delivered, needed = supply["delivered_samples_per_s"], supply["needed_samples_per_s"]
    workers, more = supply.get("workers_max"), workers_short(supply)
    fed = (f" by {workers} worker(s), {delivered / workers:.0f} samples/s each" if workers else "")
    how = f"about {more} more worker(s) (each on a device of its own)" if more else "more teacher workers"
    where = f"sh {add_worker} adds one to this running job, " if add_worker.exists() else ""
    slot_count = slots.for_full_batches(workers + more) if slots is not None and workers and more else None
    fill = (f"; with pipeline.slot_count >= {slot_count} (now {slots.per_consumer}), or the new workers run "
            f"partial batches" if slot_count else "")
    return (f"stage {stage} was teacher-bound: students waited {100 * supply['wait_fraction']:.0f}% of their "
            f"steps for data; they needed {needed:.0f} samples/s, the teachers delivered {delivered:.0f}{fed} "
            f"({needed / max(delivered, 1e-9):.2f}x short; stage_end in metrics.jsonl: wait_fraction, "
            f"needed_samples_per_s, delivered_samples_per_s, workers_max). To close the gap: {how}; "
            f"{where}local.num_workers or more mode=worker next time{fill}; or raise pipeline.worker_max_batch")
