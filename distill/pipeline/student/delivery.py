"""How a pool takes completed fills in: checked, accepted, or refused with the reason.

A completion (the broker's COMPLETE, a worker's notice in the pool's inbox, or data on
the network medium's socket) is only a hint: it is accepted for a slot PENDING with
that request id, and only with a header committed by the slot's claimed writer for
that fill (``slot.py``). What fails the quick check gets the slow one (checksum, and the
reason to log); a slot a live writer still claims is left to it; a wrong commit means
its writer is done, and the slot is asked for again. Accepted fills teach the pool how
long fills take (its deadline, ``custody.py``) and which writers serve it (their fair
share). The generation a completion names never moves the pool's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from distill.pipeline.liveness import process_alive, writer_alive
from distill.pipeline.slot import HeaderTable, check_slot, read_claim, read_header
from distill.pipeline.student.slots import AWAITING, PENDING, SlotRecord, SlotTable
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

FAILURES_BEFORE_BACKOFF = 16
"""Failed fills in a row before re-requests slow down (exponential, up to BACKOFF_MAX_S)."""
BACKOFF_MAX_S = 0.5
MAX_CONSECUTIVE_FAILURES = 200
"""Failed fills in a row after which the student gives up with an error instead of spinning."""
DATA_WAIT_S = 30.0
"""Network medium: how long (from its request) a COMPLETE slot waits for its data before it
is asked for again."""
MAX_KNOWN_PROCESSES = 1024
LATENCY_WEIGHT = 0.1
"""Weight of each new fill time in the moving average of fill times."""


@dataclass(slots=True)
class SlotAccess:
    """What a pool's helpers (:class:`Delivery`, ``custody.py``'s ``Custody``) work on: the
    table they move, the headers and bytes they read, the counts they keep. Not the pool:
    what their moves leave to do (headers to ask, requests to send, the fair share to
    write) waits in the table's queues, and the pool carries it out."""

    table: SlotTable
    headers: HeaderTable
    view: Callable[[int], memoryview]
    """One whole slot (header and payload) of the medium."""
    payload_bytes: int
    peer_id: str
    """The pool's, for the log."""
    counts: dict[str, int]
    """What happened to fills, by kind (the pool's ``counts``, read by its stats)."""


class Delivery:
    """The accepting side of one pool (see module docstring)."""

    def __init__(self, slots: SlotAccess, *, network: bool = False) -> None:
        self.slots = slots
        self.network = network
        """The medium is the network one: a completion may come before its data."""
        self.latency_s: float | None = None
        """Typical time from asking for a slot to accepting it (a moving average)."""
        self.progress_asked = 0.0
        """When the most recently asked of the slots accepted so far was asked (progress)."""
        self.writers: dict[int, float] = {}
        """writer id -> when its last commit was accepted (how many writers share our slots)."""
        self._visible: dict[str, bool] = {}
        """process token -> whether this process can see it run (a lane is used only then)."""
        self._consecutive_failures = 0
        self._failure_logged = 0.0
        self._refusals = LogThrottle(log)

    def on_complete(self, generation: int, rows: list[list], *, notice: bool = False,
                    lanes: bool = False, lane: tuple[str, str] | None = None) -> None:
        """Accept completed slots that check out, with the generation their checked header
        carries. With ``lanes`` (the pool asks workers directly), a notice's ``lane`` (path,
        process token) is where its slots are asked for next (None: through the broker)."""
        slots = self.slots
        known, count = slots.table.records, len(slots.table.records)
        records, reqs = [], []
        for slot, req, ok in rows:
            record = known[slot] if slot < count else None  # (slot >= 0: checked by the protocol)
            if record is None or record.state is not PENDING or record.request_id != req:
                if notice and slots.table.release_late(slot, req, time.monotonic()):
                    slots.counts["released"] += 1  # the late answer of a silent worker (``custody.py``)
                else:
                    slots.counts["rejected"] += 1  # not what we asked for (late or foreign)
                continue
            if not ok:
                self.on_failed_fill(record)
                continue
            records.append(record)
            reqs.append(req)
        if not records:
            return
        self._consecutive_failures = 0
        matches = slots.headers.check([record.idx for record in records], generation, reqs, slots.payload_bytes)
        if all(matches):
            self.accept(records, generation)
        else:
            self.accept([r for r, match in zip(records, matches, strict=True) if match], generation)
            for record, match in zip(records, matches, strict=True):
                if not match:
                    self.refuse(record, generation, notice=notice)
        if notice and lanes:
            self._note_lanes([r for r in records if r.state is not PENDING], lane)

    def accept(self, records: list[SlotRecord], generation: int) -> None:
        """Checked slots become READY; their fill time and writer are noted."""
        if not records:
            return
        slots = self.slots
        now = time.monotonic()
        first = records[0]
        self.progress_asked = max(self.progress_asked, max(record.asked for record in records))
        sample = now - first.asked
        self.latency_s = sample if self.latency_s is None else \
            (1 - LATENCY_WEIGHT) * self.latency_s + LATENCY_WEIGHT * sample
        header = slots.headers.header(first.idx)
        writer = header.writer if header is not None else 0
        if writer:
            self.writers[writer] = now
        slots.counts["accepted"] += len(records)
        slots.table.accept(records, generation, writer)

    def refuse(self, record: SlotRecord, generation: int, *, notice: bool) -> None:
        """A completed slot whose header did not pass the quick check: the slow check
        (checksum, and the reason to log) decides; a slot a live writer is still writing
        is left to it."""
        slots = self.slots
        view = slots.view(record.idx)
        problem = check_slot(view, generation, record.request_id, slots.payload_bytes)
        if problem is None:
            self.accept([record], generation)
            return
        if self.left_to_writer(record, view):
            return
        if slots.headers.header(record.idx) is None:
            self._uncommitted(record, generation, notice=notice)
            return
        # Committed, but not what we asked for: its writer is done with the slot.
        slots.counts["rejected"] += 1
        self._refusals.warning("%s: slot %d refused (%s); asking again", slots.peer_id, record.idx, problem)
        slots.table.renew(record, time.monotonic(), keep_request=False)

    def _uncommitted(self, record: SlotRecord, generation: int, *, notice: bool) -> None:
        """Completed, but no commit in the header (yet), and no live writer on it."""
        slots = self.slots
        if self.network and not notice:  # its data is on its way
            slots.table.await_data(record, generation)
            return
        slots.counts["rejected"] += 1
        if notice:  # a notice before its commit, or forged: the deadline looks at it again
            self._refusals.warning("%s: notice for slot %d ignored (no commit in its header); it stays "
                                   "pending", slots.peer_id, record.idx)
            return
        log.debug("%s: slot %d completed without a commit; asking again", slots.peer_id, record.idx)
        slots.table.renew(record, time.monotonic(), keep_request=False)

    def left_to_writer(self, record: SlotRecord, view: memoryview) -> bool:
        """True (and the slot now waits on it) when a live writer claims this slot's fill
        and has not committed it: asking again could put a second writer on the slot."""
        claim, fill = read_claim(view)
        if not claim or fill != record.request_id or writer_alive(claim) is False:
            return False
        header = read_header(view)
        if header is not None and header.writer == claim and header.request_id == record.request_id:
            return False  # it has committed: it is done with the slot
        self.slots.table.left_to_writer(record, claim)
        return True

    def wait_or_ask(self, record: SlotRecord, why: str, *, keep_request: bool = False) -> None:
        """A PENDING slot its fill did not reach: left to a live writer that claims it,
        else asked for again."""
        slots = self.slots
        if self.left_to_writer(record, slots.view(record.idx)):
            return
        log.debug("%s: slot %d %s; asking again", slots.peer_id, record.idx, why)
        slots.table.renew(record, time.monotonic(), keep_request=keep_request)

    def on_failed_fill(self, record: SlotRecord) -> None:
        """A worker could not fill the slot: ask again, backing off while failures persist."""
        slots = self.slots
        slots.counts["failed"] += 1
        self._consecutive_failures += 1
        n = self._consecutive_failures
        if n >= MAX_CONSECUTIVE_FAILURES:
            raise RuntimeError(f"{slots.peer_id}: workers failed {n} fills in a row; their logs say why "
                               "(generator errors, a sample size that is not the students', or a segment "
                               "they cannot map)")
        if n >= FAILURES_BEFORE_BACKOFF:
            if time.monotonic() - self._failure_logged > 5:
                self._failure_logged = time.monotonic()
                log.warning("%s: %d fills in a row failed (see the worker logs); retrying with back-off",
                            slots.peer_id, n)
            time.sleep(min(BACKOFF_MAX_S, 0.001 * 2 ** (n - FAILURES_BEFORE_BACKOFF)))
        self.wait_or_ask(record, "failed")

    def _note_lanes(self, records: list[SlotRecord], lane: tuple[str, str] | None) -> None:
        """Remember where to ask for these slots next: the lane of the worker that filled
        them, when this process can see that worker run (else nobody could tell that it
        died holding a DIRECT); no lane after a fill that named none (fan-out)."""
        if lane is not None:
            visible = self._visible.get(lane[1])
            if visible is None:
                if len(self._visible) >= MAX_KNOWN_PROCESSES:
                    self._visible.clear()
                visible = self._visible[lane[1]] = process_alive(lane[1]) is True
            if not visible:
                lane = None
        self.slots.table.set_lanes(records, lane)

    # ------------------------------------------------------------------ network medium
    def on_data(self, slots: list[int]) -> None:
        """Data arrived for these slots (network medium): those completed already are checked."""
        records = self.slots.table.records
        for slot in slots:
            record = records[slot]
            if record.state is AWAITING:
                self.refuse(record, record.generation, notice=False)

    def expire_awaiting(self) -> None:
        """Completed slots whose data never came are asked for again."""
        slots = self.slots
        now = time.monotonic()
        for record in [r for r in slots.table.records if r.state is AWAITING and now - r.asked > DATA_WAIT_S]:
            slots.counts["rejected"] += 1
            self._refusals.warning("%s: slot %d completed but its data never came in %.0fs; asking again",
                                   slots.peer_id, record.idx, DATA_WAIT_S)
            slots.table.ask([record.idx], now)
