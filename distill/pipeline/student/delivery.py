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
from typing import TYPE_CHECKING, Protocol, cast

from distill.pipeline.liveness import process_alive, writer_alive
from distill.pipeline.slot import check_slot, read_claim, read_header
from distill.pipeline.student.slots import AWAITING, PENDING, SlotRecord
from distill.pipeline.throttle import LogThrottle

if TYPE_CHECKING:
    import zmq

    from distill.pipeline.mediums.shm import SharedMemoryManager
    from distill.pipeline.mediums.tcp import TcpMedium
    from distill.pipeline.slot import HeaderTable
    from distill.pipeline.student.slots import SlotTable

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


class LaneCustody(Protocol):
    """What a :class:`Delivery` asks of its pool's custody (``custody.py``, which imports us)."""

    def lane_answered(self, process: str | int | None, now: float, *, measure: bool = True) -> None: ...

    def settle_late(self, slot: int, req: int) -> bool: ...


class PoolParts(Protocol):
    """What both helpers of a :class:`~distill.pipeline.student.pool.SlotPool` (this module's
    :class:`Delivery` and ``custody.py``'s ``Custody``) use of it: ``pool.py`` imports them,
    so the pool is named by its parts."""

    @property
    def peer_id(self) -> str: ...
    @property
    def payload_bytes(self) -> int: ...
    @property
    def counts(self) -> dict[str, int]: ...
    @property
    def slots(self) -> SlotTable: ...
    @property
    def headers(self) -> HeaderTable: ...
    @property
    def medium(self) -> SharedMemoryManager: ...

    def ask(self, slots: list[int]) -> None: ...

    def ask_again(self, record: SlotRecord, *, keep_request: bool = False) -> None: ...

    def unsend(self, record: SlotRecord) -> None: ...


class DeliveryPool(PoolParts, Protocol):
    """What a :class:`Delivery` uses of its pool beyond :class:`PoolParts`."""

    @property
    def direct_requests(self) -> bool: ...
    @property
    def data_socket(self) -> zmq.Socket | None: ...
    @property
    def custody(self) -> LaneCustody: ...


class Delivery:
    """The accepting side of one pool (see module docstring)."""

    def __init__(self, pool: DeliveryPool) -> None:
        self.pool = pool
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
                    lane: tuple[str, str] | None = None) -> None:
        """Accept completed slots that check out, with the generation their checked header
        carries. A notice's ``lane`` (path, process token) is where its slots are asked
        for next."""
        pool = self.pool
        if pool.data_socket is not None:
            self.receive_data()  # the data of these slots may be waiting on the data socket
        if lane is not None:  # its worker is alive (the lane's deadline, ``custody.py``)
            pool.custody.lane_answered(lane[1], time.monotonic())
        table = pool.slots
        known, count = table.records, len(table.records)
        records, reqs = [], []
        for slot, req, ok in rows:
            record = known[slot] if slot < count else None  # (slot >= 0: checked by the protocol)
            if record is None or record.state is not PENDING or record.request_id != req:
                if not (notice and pool.custody.settle_late(slot, req)):
                    pool.counts["rejected"] += 1  # not what we asked for (late or foreign)
                continue
            if not ok:
                self.on_failed_fill(record)
                continue
            records.append(record)
            reqs.append(req)
        if not records:
            return
        self._consecutive_failures = 0
        matches = pool.headers.check([record.idx for record in records], generation, reqs, pool.payload_bytes)
        if all(matches):
            self.accept(records, generation)
        else:
            self.accept([r for r, match in zip(records, matches, strict=True) if match], generation)
            for record, match in zip(records, matches, strict=True):
                if not match:
                    self.refuse(record, generation, notice=notice)
        if notice and pool.direct_requests:
            self._note_lanes([r for r in records if r.state is not PENDING], lane)

    def accept(self, records: list[SlotRecord], generation: int) -> None:
        """Checked slots become READY; their fill time and writer are noted."""
        if not records:
            return
        pool = self.pool
        now = time.monotonic()
        first = records[0]
        self.progress_asked = max(self.progress_asked, max(record.asked for record in records))
        sample = now - first.asked
        self.latency_s = sample if self.latency_s is None else \
            (1 - LATENCY_WEIGHT) * self.latency_s + LATENCY_WEIGHT * sample
        header = pool.headers.header(first.idx)
        writer = header.writer if header is not None else 0
        if writer:
            self.writers[writer] = now
        pool.counts["accepted"] += len(records)
        pool.slots.accept(records, generation, writer)

    def refuse(self, record: SlotRecord, generation: int, *, notice: bool) -> None:
        """A completed slot whose header did not pass the quick check: the slow check
        (checksum, and the reason to log) decides; a slot a live writer is still writing
        is left to it."""
        pool = self.pool
        view = pool.medium.slot_view(record.idx)
        problem = check_slot(view, generation, record.request_id, pool.payload_bytes)
        if problem is None:
            self.accept([record], generation)
            return
        if self.left_to_writer(record, view):
            return
        if pool.headers.header(record.idx) is None:
            self._uncommitted(record, generation, notice=notice)
            return
        # Committed, but not what we asked for: its writer is done with the slot.
        pool.counts["rejected"] += 1
        self._refusals.warning("%s: slot %d refused (%s); asking again", pool.peer_id, record.idx, problem)
        pool.ask_again(record)

    def _uncommitted(self, record: SlotRecord, generation: int, *, notice: bool) -> None:
        """Completed, but no commit in the header (yet), and no live writer on it."""
        pool = self.pool
        if pool.data_socket is not None and not notice:  # its data is on its way
            pool.slots.move(record, AWAITING)
            record.generation = generation
            return
        pool.counts["rejected"] += 1
        if notice:  # a notice before its commit, or forged: the deadline looks at it again
            self._refusals.warning("%s: notice for slot %d ignored (no commit in its header); it stays "
                                   "pending", pool.peer_id, record.idx)
            return
        log.debug("%s: slot %d completed without a commit; asking again", pool.peer_id, record.idx)
        pool.ask_again(record)

    def left_to_writer(self, record: SlotRecord, view: memoryview) -> bool:
        """True (and the slot now waits on it) when a live writer claims this slot's fill
        and has not committed it: asking again could put a second writer on the slot."""
        claim, fill = read_claim(view)
        if not claim or fill != record.request_id or writer_alive(claim) is False:
            return False
        header = read_header(view)
        if header is not None and header.writer == claim and header.request_id == record.request_id:
            return False  # it has committed: it is done with the slot
        self.pool.slots.left_to_writer(record, claim)
        self.pool.unsend(record)
        return True

    def wait_or_ask(self, record: SlotRecord, why: str, *, keep_request: bool = False) -> None:
        """A PENDING slot its fill did not reach: left to a live writer that claims it,
        else asked for again."""
        if self.left_to_writer(record, self.pool.medium.slot_view(record.idx)):
            return
        log.debug("%s: slot %d %s; asking again", self.pool.peer_id, record.idx, why)
        self.pool.ask_again(record, keep_request=keep_request)

    def on_failed_fill(self, record: SlotRecord) -> None:
        """A worker could not fill the slot: ask again, backing off while failures persist."""
        pool = self.pool
        pool.counts["failed"] += 1
        self._consecutive_failures += 1
        n = self._consecutive_failures
        if n >= MAX_CONSECUTIVE_FAILURES:
            raise RuntimeError(f"{pool.peer_id}: workers failed {n} fills in a row; their logs say why "
                               "(generator errors, a sample size that is not the students', or a segment "
                               "they cannot map)")
        if n >= FAILURES_BEFORE_BACKOFF:
            if time.monotonic() - self._failure_logged > 5:
                self._failure_logged = time.monotonic()
                log.warning("%s: %d fills in a row failed (see the worker logs); retrying with back-off",
                            pool.peer_id, n)
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
        self.pool.slots.set_lanes(records, lane)

    # ------------------------------------------------------------------ network medium
    def receive_data(self) -> None:
        """Copy arrived DATA into the slots that wait for it; check those already completed."""
        pool = self.pool
        medium = cast("TcpMedium", pool.medium)  # a data socket is a network medium's
        for slot in medium.receive(self.expected_request):
            record = pool.slots.records[slot]
            if record.state is AWAITING:
                self.refuse(record, record.generation, notice=False)

    def expected_request(self, slot: int) -> int | None:
        record = self.pool.slots.record(slot)
        if record is None or record.state not in (PENDING, AWAITING):
            return None
        return record.request_id

    def expire_awaiting(self) -> None:
        pool = self.pool
        now = time.monotonic()
        for record in [r for r in pool.slots.records if r.state is AWAITING and now - r.asked > DATA_WAIT_S]:
            pool.counts["rejected"] += 1
            self._refusals.warning("%s: slot %d completed but its data never came in %.0fs; asking again",
                                   pool.peer_id, record.idx, DATA_WAIT_S)
            pool.ask([record.idx])
