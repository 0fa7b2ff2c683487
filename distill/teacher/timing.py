"""The teacher worker's share of a run's time: seconds in the batch function, written to a file.

:class:`TimedBatchFn` counts the seconds spent in the batch function (its ``finish``
included) and, through ``copy_s``, how much of that was writing slots;
:class:`TimingWriter` dumps the counters every second to ``teacher_time.<pid>.json`` in the
run directory (a file, not a message: the wire protocol stays the transport's own).
``mode=local`` reads them back (:func:`distill.train.timing.read_teacher_times`) and puts
them beside the students' own figures.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WRITE_EVERY_S = 1.0


class TimedBatchFn:
    """Wraps a worker's batch function: seconds busy, samples, batches, and slot-copy seconds."""

    def __init__(self, batch_fn: Callable, copy_s: Callable[[], float] = lambda: 0.0) -> None:
        self.batch_fn = batch_fn
        self.copy_s = copy_s
        self.busy_s = 0.0
        self.samples = 0
        self.batches = 0
        self.started = time.monotonic()

    def __call__(self, model_id: str, model_cfg: dict | None, targets: list) -> Callable[[], None] | None:
        t0 = time.perf_counter()
        try:
            finish = self.batch_fn(model_id, model_cfg, targets)
        finally:
            self.busy_s += time.perf_counter() - t0
        self.samples += len(targets)
        self.batches += 1
        if finish is None:
            return None

        def timed_finish() -> None:
            t1 = time.perf_counter()
            try:
                finish()
            finally:
                self.busy_s += time.perf_counter() - t1

        return timed_finish

    def snapshot(self) -> dict[str, float]:
        copy_s = self.copy_s()
        return {"pid": os.getpid(), "alive_s": time.monotonic() - self.started, "busy_s": self.busy_s,
                "teacher_s": max(self.busy_s - copy_s, 0.0), "copy_s": copy_s,
                "samples": self.samples, "batches": self.batches}


class TimingWriter:
    """A daemon thread writing ``snapshot()`` to ``path`` every ``interval_s`` (atomically)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], path: Path,
                 interval_s: float = WRITE_EVERY_S) -> None:
        self.snapshot = snapshot
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timing-writer", daemon=True)

    def start(self) -> TimingWriter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.write()

    def write(self) -> None:
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full or read-only run dir must not stop the teacher
            log.debug("could not write %s: %s", self.path, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()
