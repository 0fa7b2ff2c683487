"""Dispatch: queued slots into WORKs for workers with credit; finished WORKs into answers.

Invariants to keep when editing:

- credit: READY says how many slots a worker can hold (absolute, capped by
  ``max_worker_credit``), each WORK spends credit, each DONE returns it (a shared WORK
  spends one credit per sample computed);
- a WORK holds slots of one run (one model) up to the worker's ``max_batch`` (at most
  ``MAX_WORK_ITEMS``), runs are served round robin, and each WORK goes to the least
  loaded worker (credit less its reported DIRECT ``backlog``), at most its fair part of
  the run's slots (``spread``);
- a slot is stamped with the run's *current* generation when it is handed out and
  completed only if that generation is still current, else DISCARDED;
- a fan-out WORK is kept as one part per run, each with its own generation, so a
  switch in one run discards only that run's part;
- a WORK is encoded before any state changes: one that could not be sent leaves its
  slots queued where they were (and the error to the loop's guard).

See docs/pipeline.md, sections Flow and Direct requests ("Load that follows the
workers"); fan-out: docs/cluster.md, section Fan-out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Container, Iterable, Iterator
from typing import Any

from distill.pipeline import protocol
from distill.pipeline.broker.config import MAX_WORK_ITEMS
from distill.pipeline.broker.records import SlotRequests, Work, WorkerPeer, medium_label
from distill.pipeline.broker.runs import RunState, cfg_fields, note_cfg_sent
from distill.pipeline.broker.state import BrokerState
from distill.pipeline.protocol import Command
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

MAX_SHARED_RUNS = 64
"""Runs one fan-out WORK serves at most (each gets at least one slot of it)."""


class Dispatcher:
    """Hands queued slots to workers and answers finished WORKs (see module docstring)."""

    def __init__(self, state: BrokerState) -> None:
        self.state = state
        self._failures = LogThrottle(log)

    # ------------------------------------------------------------------ WORK
    def dispatch(self) -> None:
        """Hand queued slots to workers with credit: one WORK per run in turn, to the
        least loaded worker with credit, until a whole turn serves no run. The turn goes on
        from where the last one stopped, so runs with equal demand get equal shares
        (a full rotation per call would let the first run take every freed credit)."""
        state = self.state
        workers, order = state.workers.peers, state.runs.order
        idle = 0
        while workers and idle < len(order):
            run = state.runs.runs[order[0]]
            order.rotate(-1)
            if run.model_id is None or not run.queued:
                idle += 1
                continue
            placed = spread(workers.values(), run)
            if placed is None:
                return
            if not self._send_next(*placed, run):
                idle += 1
                continue
            idle = 0

    def _send_next(self, worker: WorkerPeer, part: int, run: RunState) -> bool:
        """One WORK of at most ``part`` samples for ``worker``: ``run`` alone, or with the
        runs it shares its model with. False when the slots wait for a partner run (see
        ``_waits``)."""
        count = min(worker.credit, worker.max_batch, part)
        if not run.fan_out:
            self._send_work(worker, run, count)
            return True
        if self._waits(worker, run):
            return False
        partners = self._partners(run)
        if partners:
            runs = [run, *partners[:MAX_SHARED_RUNS - 1]]
            self._send_shared_work(worker, runs, min(count, MAX_WORK_ITEMS // len(runs)))
        else:
            self._send_work(worker, run, count)
        return True

    def _waits(self, worker: WorkerPeer, run: RunState) -> bool:
        """Hold a sharing run's slots while the worker is busy anyway and another live
        run of its model has no slots queued yet (its student is re-requesting): sent
        now, they would be computed for this run alone. An idle worker never waits."""
        if not worker.in_flight:
            return False
        waiting_for = {other.run_id for other in self.state.runs.runs.values()
                       if other is not run and other.fan_out and not other.queued and run.same_model(other)}
        return bool(waiting_for & {student.run_id for student in self.state.students.peers.values()})

    def _partners(self, run: RunState) -> list[RunState]:
        """Other opted-in runs with queued slots and exactly ``run``'s model."""
        return [other for other in self.state.runs.runs.values()
                if other is not run and other.fan_out and other.queued and run.same_model(other)]

    def _send_work(self, worker: WorkerPeer, run: RunState, count: int) -> None:
        """A plain WORK (one run). A run opted in to fan-out is marked ``shared``, so its
        slots keep coming through us (no direct requests) and can be shared later."""
        state = self.state
        requests = state.runs.take(run, count)
        num_slots = sum(len(r.slots) for r in requests)
        work = Work(state.next_work_id, worker.identity, run.run_id, run.generation, requests, num_slots,
                    model_id=run.model_id, sent_at=time.monotonic())
        body = {
            "work_id": work.work_id, "run_id": run.run_id, "generation": run.generation,
            "model_id": run.model_id, **cfg_fields(worker.models, run),
            "items": [[r.medium, slot_idx, r.stride, request_id]
                      for r in requests for slot_idx, request_id in r.slots],
        }
        if run.fan_out:
            body["shared"] = True
        frames = self._encode(run, requests, body)
        self._commit(worker, work, num_slots, num_slots)
        note_cfg_sent(worker.models, run, state.config.max_runs)  # (a worker that lost it says so: DONE.unknown_cfg)
        protocol.send_frames(state.send.backend, frames, identity=worker.identity)

    def _send_shared_work(self, worker: WorkerPeer, runs: list[RunState], samples: int) -> None:
        """A fan-out WORK: up to ``samples`` slots of each run; slot j of every run gets
        sample j, computed once for the first run that has a j-th slot."""
        state = self.state
        parts = []
        for run in runs:
            requests = state.runs.take(run, samples)
            parts.append(Work(0, worker.identity, run.run_id, run.generation, requests,
                              sum(len(r.slots) for r in requests), model_id=run.model_id))
        items, groups, copies, source_of = [], [], [], {}
        for part in parts:
            groups.append([part.run_id, part.generation, part.num_slots])
            for j, (request, slot_idx, request_id) in enumerate(_slots(part.requests)):
                if j in source_of:
                    copies.append([len(items), source_of[j]])
                else:
                    source_of[j] = len(items)
                items.append([request.medium, slot_idx, request.stride, request_id])
        first = runs[0]
        work = Work(state.next_work_id, worker.identity, first.run_id, first.generation,
                    [r for part in parts for r in part.requests], len(items), parts, len(source_of),
                    model_id=first.model_id, sent_at=time.monotonic())
        try:
            frames = protocol.encode(Command.WORK, {
                "work_id": work.work_id, "run_id": work.run_id, "generation": work.generation,
                "model_id": first.model_id, **cfg_fields(worker.models, first), "items": items,
                "runs": groups, "copies": copies,
            })
        except BaseException:
            for part, run in zip(parts, runs, strict=True):
                state.runs.requeue_front(run, part.requests)
            raise
        self._commit(worker, work, len(items), len(source_of))
        note_cfg_sent(worker.models, first, state.config.max_runs)
        protocol.send_frames(state.send.backend, frames, identity=worker.identity)

    def _encode(self, run: RunState, requests: list[SlotRequests], body: dict[str, Any]) -> list[bytes]:
        """The frames of a WORK, or its slots back in the queue and the error raised."""
        try:
            return protocol.encode(Command.WORK, body)
        except BaseException:
            self.state.runs.requeue_front(run, requests)
            raise

    def _commit(self, worker: WorkerPeer, work: Work, num_items: int, credit: int) -> None:
        state = self.state
        state.next_work_id += 1
        worker.in_flight[work.work_id] = work
        worker.credit -= credit
        state.counters.dispatched += num_items

    # ------------------------------------------------------------------ answers
    def complete_parts(self, work: Work, failed: dict[int, str], notified: frozenset[str]) -> None:
        """Complete a WORK, each run's part against its own run's generation."""
        if not work.parts:
            self.complete(work, failed, notified)
            return
        start = 0
        for part in work.parts:
            end = start + part.num_slots
            self.complete(part, {idx - start: why for idx, why in failed.items() if start <= idx < end}, notified)
            start = end

    def complete(self, work: Work, failed: dict[int, str], notified: frozenset[str] = frozenset()) -> None:
        """Answer a finished WORK: COMPLETE (filled or failed) or DISCARDED (stale) to
        each student; filled slots of ``notified`` segments were announced by the worker
        itself (``notices.py``) and are only counted."""
        state = self.state
        state.ledger.settle(work.requests)
        run = state.runs.get(work.run_id)
        stale = run is None or work.generation != run.generation
        by_student: dict[bytes, list[list]] = {}
        discarded: dict[bytes, list[list[int]]] = {}
        num_notified = num_abandoned = 0
        if not stale and not failed:  # the common case: every slot filled
            for request in work.requests:
                if request.medium in notified:
                    num_notified += len(request.slots)
                    continue
                by_student.setdefault(request.student, []).extend(
                    [slot_idx, request_id, True] for slot_idx, request_id in request.slots)
        else:
            num_abandoned = _sort_outcomes(work, stale, failed, by_student, discarded, self._failures,
                                           state.students.mediums)
            if notified and not stale:
                num_notified = _drop_notified(work, notified, by_student)
        self._count_outcomes(run, by_student, discarded, num_notified, num_abandoned, bool(failed))
        send = state.send
        for student, rows in by_student.items():
            if rows:
                send.to_student(student, Command.COMPLETE, {"generation": work.generation, "slots": rows})
        for student, rows in discarded.items():
            send.to_student(student, Command.DISCARDED, {"generation": run.generation if run else 0, "slots": rows})

    def _count_outcomes(self, run: RunState | None, by_student: dict[bytes, list[list]],
                        discarded: dict[bytes, list[list[int]]], num_notified: int, num_abandoned: int,
                        any_failed: bool) -> None:
        """Count a finished WORK's slots. ``num_abandoned`` of the failed rows were in the
        segment of a student that has left (``_sort_outcomes``): counted as discarded, not
        as completed or failed, since no student is waiting for them."""
        counters = self.state.counters
        num_failed = sum(not ok for rows in by_student.values() for *_, ok in rows) if any_failed else 0
        num_failed -= num_abandoned
        num_rows = sum(len(v) for v in by_student.values()) + num_notified - num_abandoned
        num_discarded = sum(len(v) for v in discarded.values()) + num_abandoned
        counters.completed += num_rows - num_failed
        counters.notified += num_notified
        counters.failed += num_failed
        counters.discarded += num_discarded
        if run is not None:
            run.completed += num_rows
            run.discarded += num_discarded - num_abandoned
            run.abandoned += num_abandoned
        self.state.completed_rate.add(num_rows)


def spread(workers: Collection[WorkerPeer], run: RunState) -> tuple[WorkerPeer, int] | None:
    """The worker that gets ``run``'s next WORK and how many slots it may take (None: no
    worker has credit).

    A worker's load is the run's slots it holds in WORKs from us plus the DIRECT slots its
    last heartbeat said it holds (``backlog``: a worker busy with, or hung on, students'
    direct requests is loaded though it spends no credit here). The run's queued slots and
    those loads are split evenly among the workers that can take some now (credit) or are
    loaded, and the least loaded worker still below its part gets the rest of it. So a
    student's first request, sent while every worker idles, is split among all of them,
    and slots taken back from a hung lane go to the others. When every worker with credit
    holds its part already (the others are busy with other runs), the least loaded takes
    what is queued: a slot never waits while a worker has credit for it."""
    able = [worker for worker in workers if worker.credit > 0]
    if not able:
        return None
    if len(workers) == 1:
        return _whole(able, run)
    load = {worker.identity: _held(worker, run.run_id) + worker.backlog for worker in workers}
    takers = sum(1 for worker in workers if worker.credit > 0 or load[worker.identity])
    fair = math.ceil((run.queued + sum(load.values())) / takers)
    below = least_loaded(worker for worker in able if load[worker.identity] < fair)
    if below is None:
        return _whole(able, run)
    return below, fair - load[below.identity]


def _whole(able: list[WorkerPeer], run: RunState) -> tuple[WorkerPeer, int]:
    """The least loaded worker with credit, for all the run's queued slots."""
    worker = least_loaded(able)
    assert worker is not None
    return worker, run.queued


def _held(worker: WorkerPeer, run_id: str) -> int:
    """Slots of ``run_id`` the worker holds in WORKs from us."""
    return sum(part.num_slots for part in parts(worker.in_flight.values()) if part.run_id == run_id)


def least_loaded(workers: Iterable[WorkerPeer]) -> WorkerPeer | None:
    """The worker with credit that is least loaded: the most credit once its DIRECT
    backlog is counted against it. A worker kept busy by students' direct requests
    still has all its broker credit; picked by credit alone it would get the slots a
    student sends us so that an idle worker (one that joined later) takes them."""
    best, best_free = None, None
    for worker in workers:
        if worker.credit <= 0:
            continue
        free = worker.credit - worker.backlog
        if best_free is None or free > best_free:
            best, best_free = worker, free
    return best


def parts(works: Any) -> list[Work]:
    """The one-run parts of ``works`` (a fan-out WORK has one per run)."""
    return [part for work in works for part in (work.parts or [work])]


def _slots(requests: list[SlotRequests]) -> Iterator[tuple[SlotRequests, int, int]]:
    """(request, slot_idx, request_id) of every slot of ``requests``, in order."""
    return ((request, slot_idx, request_id) for request in requests for slot_idx, request_id in request.slots)


def _sort_outcomes(work: Work, stale: bool, failed: dict[int, str], by_student: dict[bytes, list[list]],
                   discarded: dict[bytes, list[list[int]]], failures: LogThrottle,
                   live_mediums: Container[str]) -> int:
    """Slot by slot: completed (ok or failed) or discarded (stale). A failed slot is a
    warning and a failure, except in a segment whose student has left (``live_mediums``
    no longer holds it): a dataset that closed with WORK in flight unlinked it, which is
    expected at the end of every run, so such a slot is counted as discarded, not as
    failed. Its row is still sent: a student forgotten for missed heartbeats may be alive,
    and then asks again. Returns how many such slots there were."""
    idx = abandoned = 0
    for request in work.requests:
        for slot_idx, request_id in request.slots:
            if stale or failed.get(idx) == "stale":
                discarded.setdefault(request.student, []).append([slot_idx, request_id])
            elif idx not in failed:
                by_student.setdefault(request.student, []).append([slot_idx, request_id, True])
            elif request.medium not in live_mediums:
                log.debug("worker failed slot %d of %s, whose student has left: %s", slot_idx,
                          medium_label(request.medium), failed[idx])
                abandoned += 1
                by_student.setdefault(request.student, []).append([slot_idx, request_id, False])
            else:
                failures.warning("worker failed slot %d of %s: %s", slot_idx, medium_label(request.medium),
                                 failed[idx])
                by_student.setdefault(request.student, []).append([slot_idx, request_id, False])
            idx += 1
    return abandoned


def _drop_notified(work: Work, notified: frozenset[str], by_student: dict[bytes, list[list]]) -> int:
    """Take the filled slots of ``notified`` segments out of the COMPLETE rows (their
    students were told directly; failed ones still need the broker). Returns how many."""
    students = {request.student for request in work.requests if request.medium in notified}
    dropped = 0
    for student in students & by_student.keys():
        rows = by_student[student]
        kept = [row for row in rows if not row[2]]
        dropped += len(rows) - len(kept)
        by_student[student] = kept
    return dropped
