"""What a pool does about slots whose fill is in other hands, or lost.

A PENDING slot waits on someone: the broker (and a worker it picked), a worker asked
directly (DIRECT, ``notices.py``), or a writer known to claim the slot. This module
decides what happens when that someone does not come through:

- DISCARDED, DECLINED, a failed fill: asked for again, unless a live writer claims the
  slot (asking again could put a second writer on it; ``worker/claims.py``);
- QUARANTINE (the broker gave up on a worker that may still write): slots it claims are
  taken out of use until it is done or gone, their requests asked for in other slots;
  slots it never claimed are asked for again at once, with new fills, so it can no
  longer write them;
- a broker restart: the same, for everything the broker held;
- the lane deadline (``LaneClock``): a worker asked by DIRECT that has answered nothing
  for longer than its deadline is given up on as the broker gives up on a worker;
- the pending deadline: a slot PENDING past ``deadline_s()``, once the pool has made
  progress without it (or after ``STALL_DEADLINES`` deadlines without any), is looked
  at once: a commit whose notice never came is taken, a wrong one refused, a live
  writer's claim waited on, anything else asked for again; one log line per kind and
  interval;
- the fair share: no writer may claim more than ``ceil(slots / max(2, writers seen))``
  of the pool's slots at once (the segment header's ``max_claims``), and no worker may
  hold more than ``ceil(slots / live workers)`` of them by DIRECT (``direct_share``).

See docs/pipeline.md, sections Direct requests and Faults.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distill.pipeline.liveness import process_alive, writer_alive
from distill.pipeline.slot import check_slot, read_claim
from distill.pipeline.student.delivery import BACKOFF_MAX_S, Delivery, SlotAccess
from distill.pipeline.student.slots import PENDING, QUARANTINED, Route, SlotRecord
from distill.pipeline.throttle import LogThrottle

if TYPE_CHECKING:
    from distill.pipeline.liveness import Heartbeater

log = logging.getLogger(__name__)

DEADLINE_LATENCIES = 8
"""An automatic pending deadline is this many times the typical fill time ..."""
DEADLINE_HEARTBEATS = 2
"""... and at least this many times the broker's liveness window (interval x liveness)."""
MAX_DEADLINE_DOUBLINGS = 4
"""A slot found overdue n times in a row is looked at again 2**n deadlines after its request
(at most 2**4)."""
STALL_DEADLINES = 4
"""A slot counts as overdue once a fill asked after it has been accepted (the pool makes
progress without it); with no progress at all (no worker yet, a slow start), only after
``STALL_DEADLINES`` deadlines: asking again sooner would only pile requests up at the
broker."""
WRITER_WINDOW_HEARTBEATS = 30
"""Writers whose commits came within this many heartbeat intervals count for the fair share."""
LANE_DEADLINE_FACTOR = 10.0
"""A lane that has answered nothing for this many times its slowest recent wait between
answers (the broker's WORK_TIMEOUT_FACTOR) ..."""
LANE_DEADLINE_MIN_BEATS = 10
"""... and at least this many heartbeat intervals (a GC pause is not a hang) is given up on."""
LANE_HISTORY = 32
"""Waits between answers remembered per lane."""
MAX_LANES = 1024
"""Lanes whose clocks are kept (idle ones are forgotten first beyond this)."""


@dataclass(slots=True)
class LaneClock:
    """How one worker's lane answers our DIRECT requests (its batch times, as we see them).

    ``busy_since`` is when we last sent it a request while it owed us nothing; from then
    or from its last answer, whichever is later, we wait on it. Each notice that ends
    such a wait adds the wait to ``waits``: its deadline is LANE_DEADLINE_FACTOR times
    the slowest of them."""

    busy_since: float = 0.0
    last_sent: float = 0.0
    last_answer: float = 0.0
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=LANE_HISTORY))

    @property
    def waiting(self) -> bool:
        """Whether we sent it a request that it has not answered (nor anything since)."""
        return self.last_sent > self.last_answer

    def since(self) -> float:
        return max(self.busy_since, self.last_answer)


class Custody:
    """The waiting side of one pool (see module docstring).

    It moves the pool's slot table only; ``delivery`` (which accepts and refuses fills)
    is where it learns how long fills take and who writes them, and ``heart`` (the
    pool's heartbeats) how often the broker is heard and how many workers it has."""

    def __init__(self, slots: SlotAccess, delivery: Delivery, heart: Heartbeater, *,
                 pending_deadline_s: float | None = None) -> None:
        self.slots = slots
        self.delivery = delivery
        self.heart = heart
        self.pending_deadline_s = pending_deadline_s
        """``PoolConfig.pending_deadline_s`` (None: automatic, ``deadline_s``)."""
        self.share = 0
        """The fair share last written into the segment header (``max_claims``)."""
        self._failure_logged = 0.0
        self._overdue_log = LogThrottle(log, burst=4)
        self._lanes: dict[str, LaneClock] = {}
        """process token of a worker asked by DIRECT -> its lane's clock."""

    # ------------------------------------------------------------------ answers
    def on_discarded(self, rows: list[list[int]]) -> None:
        """Fills the broker dropped (stale) or a worker would not make: asked for again,
        unless a live writer claims the slot (the pool notes the broker's generation)."""
        slots = self.slots
        for slot, req in rows:
            record = slots.table.pending(slot, req)
            if record is not None:
                slots.counts["discarded"] += 1
                self.delivery.wait_or_ask(record, "discarded")

    def on_refused(self, rows: list[list[int]], reason: str) -> None:
        """The broker is over a limit and did not queue these requests: back off, ask again."""
        slots = self.slots
        again = [record for slot, req in rows if (record := slots.table.pending(slot, req)) is not None]
        slots.counts["refused"] += len(again)
        if time.monotonic() - self._failure_logged > 5:
            self._failure_logged = time.monotonic()
            log.warning("%s: broker refused %d request(s) (%s); asking again after a pause",
                        slots.peer_id, len(again), reason)
        time.sleep(BACKOFF_MAX_S)
        slots.table.send_again(again)

    def on_declined(self, rows: list[list[int]], reason: str) -> None:
        """A worker will not fill these DIRECT slots: the broker gets them, same request ids."""
        slots = self.slots
        table = slots.table
        now = time.monotonic()
        for slot, req in rows:
            if table.release_late(slot, req, now):
                slots.counts["released"] += 1
                continue
            record = table.pending(slot, req)
            if record is not None and record.route is Route.DIRECT:
                slots.counts["declined"] += 1
                self.lane_answered(record.holder, now, measure=False)
                if not self.delivery.left_to_writer(record, slots.view(slot)):
                    table.resend(record)
        log.debug("%s: %d direct request(s) declined: %s", slots.peer_id, len(rows), reason)

    def on_quarantine(self, rows: list[list[int]], process: str | None, *, direct: bool = False) -> None:
        """A worker declared dead may still write these slots: those it has claimed stay
        out of use (their samples are asked for in other slots); those it never claimed
        are asked for again at once (it can no longer write them: their fill changes).
        With ``direct``, the same for what we asked of it by DIRECT."""
        slots = self.slots
        table = slots.table
        if direct and process is not None:
            self._quarantine_direct(process)
        if not rows:
            return
        remote = process_alive(process) is None
        taken = 0
        now = time.monotonic()
        for slot, req in rows:
            record = table.pending(slot, req)
            if record is None:
                continue
            claim, fill = read_claim(slots.view(slot))
            if remote or not claim or fill != req or writer_alive(claim) is False:
                # Not being written: over the network medium a remote writer reaches our
                # slots only through receive(), which takes data for pending requests only.
                slots.counts["discarded"] += 1
                table.renew(record, now, keep_request=True)
                continue
            table.quarantine(record, claim)
            taken += 1
        if taken:
            self._quarantined(taken, "their worker stopped answering and may still write them")

    def _quarantine_direct(self, process: str) -> None:
        """Slots asked of a silent worker by DIRECT: those it claimed are out of use until it
        answers them late (``SlotTable.release_late``) or is gone; the rest are asked for
        again. No more requests go to its lane."""
        slots = self.slots
        table = slots.table
        self._lanes.pop(process, None)  # given up on: its clock starts again with our next request
        taken = 0
        now = time.monotonic()
        table.drop_lanes(process)
        for record in table.records:
            if record.state is not PENDING or record.route is not Route.DIRECT or record.holder != process:
                continue
            claim, fill = read_claim(slots.view(record.idx))
            if claim and fill == record.request_id and writer_alive(claim) is not False:
                table.quarantine(record, process, late_request=record.request_id)
                taken += 1
            else:
                table.renew(record, now, keep_request=True)
        if taken:
            self._quarantined(taken, "asked of a silent worker directly")

    def _quarantined(self, count: int, why: str) -> None:
        slots = self.slots
        table = slots.table
        slots.counts["quarantined"] += count
        usable = sum(record.state is not QUARANTINED for record in table.records)
        log.warning("%s: %d slot(s) quarantined (%s); %d of %d slots left in use", slots.peer_id, count, why,
                    usable, len(table))
        table.reissue_free(time.monotonic())

    def on_release(self, rows: list[list[int]]) -> None:
        """The worker's late DONE: it is done with these slots."""
        table = self.slots.table
        for slot, _req in rows:
            record = table.record(slot)
            if record is not None and record.state is QUARANTINED:
                self._release(record)

    def _release(self, record: SlotRecord) -> None:
        self.slots.counts["released"] += 1
        self.slots.table.release(record, time.monotonic())

    def on_broker_restart(self, pending: list[SlotRecord]) -> None:
        """The broker forgot what it held: slots a live writer claims are left to it; the
        others are asked for with new requests (a WORK of the old broker still waiting in
        a worker's socket then finds another fill in the slot and writes nothing), their
        requests re-issued in the next slots asked."""
        for record in pending:
            if record.state is PENDING and record.route is Route.BROKER:
                self.delivery.wait_or_ask(record, "lost with the broker", keep_request=True)

    # ------------------------------------------------------------------ lanes
    def lane_sent(self, process: str, now: float) -> None:
        """We sent DIRECT requests to the lane of ``process`` (its clock starts if it owed us nothing)."""
        clock = self._lanes.get(process)
        if clock is None:
            if len(self._lanes) >= MAX_LANES:
                self._forget_idle_lanes()
            clock = self._lanes[process] = LaneClock()
        if not clock.waiting:
            clock.busy_since = now
        clock.last_sent = now

    def lane_answered(self, process: str | int | None, now: float, *, measure: bool = True) -> None:
        """The lane of ``process`` answered (a notice; a DECLINED with ``measure=False``):
        it is alive, and how long we waited on it is one of its batch times."""
        clock = self._lanes.get(process) if isinstance(process, str) else None
        if clock is None:
            return
        if measure and clock.waiting:
            clock.waits.append(now - clock.since())
        clock.last_answer = now

    def lane_deadline_s(self, clock: LaneClock) -> tuple[float, str]:
        """How long a lane may leave us waiting, and how that was chosen (for the log)."""
        floor = LANE_DEADLINE_MIN_BEATS * self.heart.interval_s
        if not clock.waits:
            return max(floor, self.deadline_s()), "nothing measured yet: the pending deadline"
        slowest = max(clock.waits)
        if LANE_DEADLINE_FACTOR * slowest <= floor:
            return floor, f"{LANE_DEADLINE_MIN_BEATS} heartbeats; its slowest recent answer took {slowest:.3f}s"
        return LANE_DEADLINE_FACTOR * slowest, f"{LANE_DEADLINE_FACTOR:g} x its slowest recent answer"

    def _check_lanes(self, alive: dict[Any, bool], now: float) -> None:
        """Give up on the lanes that left us waiting past their deadline."""
        for process, clock in list(self._lanes.items()):
            if not clock.waiting:
                continue
            if not _holder_alive(process, alive):  # gone: its slots went to the broker already
                del self._lanes[process]
                continue
            deadline, why = self.lane_deadline_s(clock)
            elapsed = now - clock.since()
            if elapsed <= deadline:
                continue
            held = self.slots.table.direct_held().get(process, 0)
            log.warning("%s: worker process %s has answered none of our direct requests for %.1fs (it holds %d "
                        "slot(s)), past its deadline of %.1fs (%s): asking the broker for them and this worker "
                        "nothing more", self.slots.peer_id, process.rsplit(":", 2)[-2], elapsed, held, deadline,
                        why)
            del self._lanes[process]
            self.slots.counts["hung_lanes"] += 1
            self._quarantine_direct(process)

    def _forget_idle_lanes(self) -> None:
        for process in [p for p, clock in self._lanes.items() if not clock.waiting]:
            del self._lanes[process]

    # ------------------------------------------------------------------ once per heartbeat
    def beat_checks(self, now: float) -> None:
        """Quarantined slots whose writer is gone come back; DIRECT or WRITER slots whose
        holder is gone go to the broker; lanes past their deadline are given up on;
        overdue PENDING slots are looked at."""
        table = self.slots.table
        alive: dict[Any, bool] = {}
        overdue: list[SlotRecord] = []
        if self._lanes:
            self._check_lanes(alive, now)
        deadline = self.deadline_s()
        stalled = now - STALL_DEADLINES * deadline
        progress = self.delivery.progress_asked
        for record in table.records:
            state = record.state
            if state is QUARANTINED:
                if not _holder_alive(record.holder, alive):
                    self._release(record)
            elif state is PENDING:
                if record.route is not Route.BROKER and not _holder_alive(record.holder, alive):
                    table.resend(record)
                elif (now - record.asked > deadline * 2 ** min(record.overdue, MAX_DEADLINE_DOUBLINGS)
                      and (record.asked < progress or record.asked < stalled)):
                    overdue.append(record)
        if overdue:
            self._look_at_overdue(overdue, now)

    def _look_at_overdue(self, records: list[SlotRecord], now: float) -> None:
        """PENDING past their deadline: take a commit whose notice never came, refuse a
        wrong one, leave a live writer's claim alone, ask again for the rest."""
        slots = self.slots
        delivery = self.delivery
        slots.counts["overdue"] += len(records)
        asked, waiting, taken = [], 0, 0
        for record in records:
            record.overdue += 1
            view = slots.view(record.idx)
            header = slots.headers.header(record.idx)
            if header is not None and header.request_id == record.request_id:
                if check_slot(view, header.generation, record.request_id, slots.payload_bytes) is None:
                    delivery.accept([record], header.generation)  # committed; its notice was lost
                    taken += 1
                else:
                    delivery.refuse(record, header.generation, notice=False)
                continue
            if delivery.left_to_writer(record, view):  # looked at again 2**overdue deadlines after its ask
                waiting += 1
                continue
            asked.append(record)
        if taken:
            self._overdue_log.warning("%s: %d slot(s) committed but never announced; taken", slots.peer_id, taken)
        if waiting:
            self._overdue_log.warning("%s: %d slot(s) overdue are still being written by a live writer; "
                                      "waiting on it", slots.peer_id, waiting)
        if asked:
            self._overdue_log.warning("%s: %d slot(s) pending for more than %.1fs with nobody writing them "
                                      "(a lost or unanswered request); asking again", slots.peer_id, len(asked),
                                      self.deadline_s())
            for record in asked:
                slots.table.renew(record, now, keep_request=True)  # keeps its overdue count: the next wait doubles

    def deadline_s(self) -> float:
        """How long a slot may stay PENDING (``PoolConfig.pending_deadline_s``)."""
        if self.pending_deadline_s is not None:
            return self.pending_deadline_s
        heart = self.heart
        floor = DEADLINE_HEARTBEATS * heart.interval_s * heart.liveness
        return max(floor, DEADLINE_LATENCIES * (self.delivery.latency_s or 0.0))

    def fair_share(self) -> int | None:
        """The fair share of one writer, when it changed (the pool writes it into the
        segment header, ``max_claims``); None when it did not."""
        writers = self.delivery.writers
        window = WRITER_WINDOW_HEARTBEATS * self.heart.interval_s
        now = time.monotonic()
        for writer in [w for w, seen in writers.items() if now - seen > window]:
            del writers[writer]
        share = math.ceil(len(self.slots.table) / max(2, len(writers)))
        if share == self.share:
            return None
        self.share = share
        return share

    def direct_share(self) -> int:
        """Slots one worker may hold by DIRECT: its share among the live workers.

        A lane is sticky (a slot goes back to the worker that filled it last), so a worker
        that never filled one of our slots would never get any if we split them only
        among the writers we have seen. The broker tells us with every heartbeat answer
        how many live workers it has: past a worker's share, its slots go through the
        broker, which hands them to the least loaded worker (a newcomer first), and its
        fills make them that worker's lanes. A worker that leaves or is given up on is
        no longer counted, and the others take its share back. Each worker then fills
        its share at its own pace, so the samples split in proportion to fill rates.
        Without an answer yet (an old broker), the writers seen are counted."""
        workers = self.heart.workers
        if not workers:
            workers = len(self.delivery.writers)
        return math.ceil(len(self.slots.table) / max(1, workers))


def _holder_alive(holder: str | int | None, alive: dict[Any, bool]) -> bool:
    """Whether a slot's holder (a process token or a writer id) may still write it."""
    if holder not in alive:
        state = writer_alive(holder) if isinstance(holder, int) else process_alive(holder)
        alive[holder] = state is not False
    return alive[holder]
