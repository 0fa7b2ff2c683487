"""Where a run's wall time goes: teacher, transport, student compute, waiting.

Why it is split across processes: the teacher works in worker processes, the
transport in the broker and in the copies on both sides, the students in their
ranks. Each side measures what only it can see, and ``mode=local`` (which outlives
them all) puts the parts side by side at the end of the run:

- teacher workers: their batch function's seconds, written every second to
  ``teacher_time.<pid>.json`` in the run directory (:mod:`distill.teacher.timing`) and
  read back here (:func:`read_teacher_times`);
- the broker: its CPU seconds, read from ``/proc`` by the supervisor;
- students: wait and compute seconds in ``result.json``'s ``timings``, and the
  seconds of each phase around the training loops (:data:`STUDENT_PHASES`, timed
  with :func:`timed`), so the student lane's remainder is only what happens outside
  the student process (starting it, tearing the run down).

The teacher and transport rows are parallel lanes (one per worker, the broker's
own), so their share of the wall time is a utilisation; the student lane adds up
to the wall time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from distill.pipeline.liveness import start_time

log = logging.getLogger(__name__)

TEACHER_TIME_GLOB = "teacher_time.*.json"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STUDENT_PHASES = (
    ("student_start_s", "student start (imports, teacher and data loading)"),
    ("stage_setup_s", "student stage setup (replacements, held-out teacher targets)"),
    ("validation_s", "student validation"),
    ("checkpoint_s", "student checkpoints and stage weights"),
    ("hybrid_choice_s", "student: the automatic hybrid's choice (each layer scored alone, the quality curve)"),
    ("export_s", "student assembly and export"),
    ("evaluate_s", "student evaluation"),
    ("decode_s", "student decoding figures (speed and continuations, teacher and student)"),
    ("assist_s", "student assisted-decoding figures"),
)
"""(key in the student's ``timings``, row of the split): the student's phases outside
its training steps, in the order a run goes through them."""


@contextlib.contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds the block takes to ``timings[key]`` (also when it raises)."""
    started = time.monotonic()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.monotonic() - started


def process_age_s() -> float:
    """Seconds since this process started, its interpreter start and imports included
    (what no timer inside the process can see), from ``/proc/self/stat``; 0 where
    there is no ``/proc``."""
    start = start_time(os.getpid())
    if start is None:
        return 0.0
    return max(time.clock_gettime(time.CLOCK_BOOTTIME) - start[0] / CLOCK_TICKS, 0.0)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (all its threads), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def read_teacher_times(run_dir: Path) -> list[dict[str, float]]:
    """The last counters each teacher worker of this run wrote."""
    times = []
    for path in sorted(run_dir.glob(TEACHER_TIME_GLOB)):
        try:
            times.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
    return times


def time_split(wall_s: float, student: dict[str, float], teachers: list[dict[str, float]],
               broker_cpu_s: float | None) -> list[tuple[str, float]]:
    """Rows (part, seconds) of a run's time: per-worker means for the teacher lanes."""
    workers = max(len(teachers), 1)
    rows = [
        ("teacher forward (mean per worker)", sum(t["teacher_s"] for t in teachers) / workers),
        ("transport: slot writes (mean per worker)", sum(t["copy_s"] for t in teachers) / workers),
    ]
    if broker_cpu_s is not None:
        rows.append(("transport: broker CPU", broker_cpu_s))
    student_rows = [
        ("student compute", student.get("student_compute_s", 0.0)),
        ("student waiting for data", student.get("student_wait_s", 0.0)),
        ("student waiting for each stage's first batch (teachers starting or switching layers)",
         student.get("student_startup_wait_s", 0.0)),
        *((name, student.get(key, 0.0)) for key, name in STUDENT_PHASES),
    ]
    accounted = sum(seconds for _, seconds in student_rows)
    return [*rows, *student_rows,
            ("student other (launching the student processes, barriers, tearing the run down)",
             max(wall_s - accounted, 0.0))]


def format_time_split(rows: list[tuple[str, float]], wall_s: float, num_workers: int) -> str:
    """The rows as a markdown table, each with its share of the run's wall time."""
    lines = ["## Where the time went", "",
             f"Run wall time {wall_s:.1f} s, {num_workers} teacher worker(s). Teacher and transport rows "
             "run in parallel with the students (their share is a utilisation); the student rows add "
             "up to the wall time.", "",
             "| part | seconds | share of wall time |", "| --- | --- | --- |"]
    lines += [f"| {name} | {seconds:.1f} | {seconds / wall_s:.0%} |" for name, seconds in rows]
    return "\n".join(lines)
