"""The workers' socket: READY, DONE, HEARTBEAT, BYE, ERROR; and the workers' liveness.

A worker that misses its heartbeats or its deadline (``deadline.py``) may be frozen
rather than dead, so its in-flight slots are never handed to another worker: the
students are told QUARANTINE (with its process token) and RELEASE once its late DONE
shows it is done. A worker that says BYE has finished writing, so its unstarted work
is simply re-queued. See docs/pipeline.md, section Faults.

Numbers a worker sends are capped where they are read (``limits.worker_credit``,
``limits.worker_batch``); credit a DONE returns never lifts a worker above the credit
of its READY.
"""

from __future__ import annotations

import logging
import time

from distill.pipeline.broker import limits
from distill.pipeline.broker.dispatch import Dispatcher, parts
from distill.pipeline.broker.records import Impostor, Work, WorkerPeer, check_key
from distill.pipeline.broker.state import BrokerState
from distill.pipeline.liveness import beat_identity
from distill.pipeline.protocol import Command
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)


class Backend:
    """Worker handlers, and what happens to a worker given up on."""

    def __init__(self, state: BrokerState, dispatcher: Dispatcher) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self._worker_errors = LogThrottle(log)

    def on_ready(self, identity: bytes, key: str | None, body: dict) -> None:
        state = self.state
        now = time.monotonic()
        peer = state.workers.bound(identity, body["peer_id"], key, "READY")
        if peer is None:
            peer = state.workers.add(identity, body["peer_id"], key, now)
            log.info("worker %s joined (credit %d)", peer.peer_id, body["credit"])
        peer.last_seen = peer.progress_at = now
        peer.process = body.get("process")
        peer.direct = limits.direct_counts(body.get("direct"))  # the baseline: fills before we knew it
        peer.capacity = peer.credit = limits.worker_credit(state.config, body["credit"])
        peer.max_batch = limits.worker_batch(body["max_batch"])

    def on_heartbeat(self, identity: bytes, key: str | None, body: dict) -> None:
        """From the worker's heartbeat socket, whose routing identity is its work
        connection's with a suffix (``liveness.beat_identity``), or from that connection
        itself: a beat from any other connection keeps no worker alive and reports no
        progress for it (one socket beating for a hung worker would hide it from its
        deadline for ever); with keys it carries the worker's."""
        state = self.state
        peer = state.workers.peers.get(body["peer_id"])
        if peer is None:
            state.send.to_worker(identity, Command.RECONNECT, {})
            return
        check_key(f"worker {peer.peer_id[:64]}", peer.key, key)
        if identity not in (peer.identity, beat_identity(peer.identity)):
            raise Impostor(f"HEARTBEAT names worker {peer.peer_id[:64]}, which is bound to another connection: refused")
        peer.last_seen = now = time.monotonic()
        backlog = min(body.get("backlog") or 0, limits.MAX_DIRECT_PER_REPORT)
        if backlog and not peer.backlog:
            peer.backlog_since = now
        peer.backlog = backlog
        batches = body.get("batches")
        if batches is not None and batches != peer.batches:
            peer.batches, peer.progress_at = batches, now
        if body.get("direct"):
            self._count_direct(peer, limits.direct_counts(body["direct"]))
        state.send.to_worker(identity, Command.HEARTBEAT, state.beat_body)

    def on_bye(self, identity: bytes, key: str | None, body: dict) -> None:
        peer = self.state.workers.bound(identity, body["peer_id"], key, "BYE")
        if peer is not None:
            del self.state.workers.peers[peer.peer_id]
            log.info("worker %s left", peer.peer_id)
            self._requeue(peer)

    def on_error(self, identity: bytes, key: str | None, body: dict) -> None:
        self._worker_errors.warning("worker %r refused a message: %s", identity[:32], body["reason"])

    def on_done(self, identity: bytes, key: str | None, body: dict) -> None:
        state = self.state
        zombie = state.workers.exhume(identity, body["peer_id"], body["work_id"])
        if zombie is not None:  # late: its slots went to no one, and now they are safe
            self._release(zombie)
            return
        peer = state.workers.bound(identity, body["peer_id"], key, "DONE")
        if peer is None:
            return  # a worker we declared dead: its slots were re-queued already
        now = time.monotonic()
        peer.last_seen = now
        work = peer.in_flight.pop(body["work_id"], None)
        if work is None:  # work from before a broker restart
            peer.credit = min(peer.credit + body["num_items"], peer.capacity)
            return
        state.clock.observe(peer, work, now)
        peer.last_done_at = peer.progress_at = now
        peer.last_model, peer.last_run = work.model_id, work.run_id
        peer.credit = min(peer.credit + (work.num_slots if work.credit is None else work.credit), peer.capacity)
        if body.get("unknown_cfg"):  # it lost the config (its cache, or a WORK that never came)
            peer.models.pop(work.run_id, None)  # the next WORK carries it; its slots were "stale"
        failed = {idx: reason for idx, reason in body["failed"] if 0 <= idx < work.num_slots}
        self.dispatcher.complete_parts(work, failed, frozenset(body.get("notified") or ()))

    def _count_direct(self, peer: WorkerPeer, counts: dict[str, tuple[int, int]]) -> None:
        """Add the slots a worker filled for DIRECT requests since its last report to the
        statistics (completed, failed, per run) as if this broker had dispatched them."""
        state = self.state
        for run_id, (filled, failed) in counts.items():
            seen_filled, seen_failed = peer.direct.get(run_id, (0, 0))
            # Clamped: a report is untrusted input, and the counters must stay encodable.
            new_filled = min(max(0, filled - seen_filled), limits.MAX_DIRECT_PER_REPORT)
            new_failed = min(max(0, failed - seen_failed), limits.MAX_DIRECT_PER_REPORT)
            if not new_filled and not new_failed:
                continue
            state.counters.completed += new_filled
            state.counters.direct += new_filled
            state.counters.failed += new_failed
            run = state.runs.get(run_id)
            if run is not None:
                run.completed += new_filled + new_failed
            state.completed_rate.add(new_filled + new_failed)
        peer.direct = counts

    # ------------------------------------------------------------------ liveness
    def purge(self, now: float) -> None:
        """Quarantine workers that missed their heartbeats, are past a WORK's deadline, or
        hold DIRECT work without finishing a batch within their deadline."""
        config = self.state.config
        silent_since = now - config.heartbeat_interval_s * config.heartbeat_liveness
        for peer in list(self.state.workers.peers.values()):
            if peer.last_seen < silent_since:
                log.warning("worker %s missed %d heartbeats: quarantining its %d slot(s)", peer.peer_id,
                            config.heartbeat_liveness, sum(w.num_slots for w in peer.in_flight.values()))
                self._give_up(peer)
            elif (late := self.state.clock.overdue(peer, now)) is not None:
                work, elapsed, deadline, why = late
                log.warning("worker %s: work %d (%d slot(s) of model %s) unanswered after %.1fs, past its "
                            "deadline of %.1fs (%s): quarantining its %d slot(s) as if it were silent",
                            peer.peer_id, work.work_id, work.num_slots, work.model_id, elapsed, deadline, why,
                            sum(w.num_slots for w in peer.in_flight.values()))
                self.state.counters.overdue += 1
                self._give_up(peer)
            elif (stuck := self.state.clock.stalled(peer, now)) is not None:
                elapsed, deadline, why = stuck
                log.warning("worker %s: holds %d direct slot(s) and has finished no batch for %.1fs, past its "
                            "deadline of %.1fs (%s): quarantining them as if it were silent", peer.peer_id,
                            peer.backlog, elapsed, deadline, why)
                self.state.counters.overdue += 1
                self._give_up(peer)

    def _give_up(self, peer: WorkerPeer) -> None:
        del self.state.workers.peers[peer.peer_id]
        self._quarantine(peer)

    def _requeue(self, peer: WorkerPeer) -> None:
        state = self.state
        for work in parts(peer.in_flight.values()):
            run = state.runs.get(work.run_id)
            if run is None:
                continue
            requests = [r for r in work.requests if r.owner.peers]  # of students still here
            state.runs.requeue_front(run, requests)
            state.counters.requeued += sum(len(r.slots) for r in requests)
        peer.in_flight.clear()

    def _quarantine(self, peer: WorkerPeer) -> None:
        """A silent worker may still write its slots: tell their students not to reuse them.

        It may also hold slots students asked of it directly, which we never saw: every
        live student hears ``direct`` for its process (a local worker: it has a token)."""
        state = self.state
        for work in peer.in_flight.values():
            state.ledger.settle(work.requests, answered=False)
            by_student: dict[bytes, list[list[int]]] = {}
            for request in work.requests:
                if request.owner.peers:
                    by_student.setdefault(request.student, []).extend(request.slots)
            for student, rows in by_student.items():
                state.send.to_student(student, Command.QUARANTINE, {"slots": rows, "process": peer.process})
                state.counters.quarantined += len(rows)
        state.workers.bury(peer)
        if peer.process is not None:
            for student in list(state.students.connections):
                state.send.to_student(student, Command.QUARANTINE,
                                      {"slots": [], "process": peer.process, "direct": True})

    def _release(self, work: Work) -> None:
        """The late DONE of a quarantined work: its slots may be filled again (its data is not used)."""
        log.warning("late DONE of work %d from a worker declared dead: releasing its %d slot(s)",
                    work.work_id, work.num_slots)
        by_student: dict[bytes, list[list[int]]] = {}
        for request in work.requests:
            by_student.setdefault(request.student, []).extend(request.slots)
        for student, rows in by_student.items():
            self.state.send.to_student(student, Command.RELEASE, {"slots": rows})
            self.state.counters.released += len(rows)
