"""A consumer's slots: one record per slot, moved by an explicit state machine.

Every slot of a :class:`~distill.pipeline.student.pool.SlotPool` is exactly one
:class:`SlotRecord`, and its :class:`SlotState` says who may touch it::

    FREE --ask--> PENDING --accept--> READY --take--> OUT --ask--> PENDING ...
                  |  ^  |                |
                  |  |  +--complete early (network medium)--> AWAITING --data--> READY
                  |  +---- ask again (failed, discarded, overdue, stale) ----+
                  +--quarantine--> QUARANTINED --its writer is done or gone--> PENDING

- FREE: never asked for (the pool's start).
- PENDING: asked for with ``request_id`` (the pool's ``fill`` number ``fill``); the fill
  is expected by ``route``: from the broker, from a worker's lane (DIRECT, ``holder`` is
  that worker's process token) or from a writer known to hold the slot's claim (WRITER,
  ``holder`` is its writer id: it was writing when the broker restarted or gave up).
  ``asked`` is when its request went out; past the pool's deadline from then (doubled
  each time it was found overdue in a row, ``overdue``) it is looked at (``custody.py``).
- AWAITING: completed, but its data has not come yet (network medium).
- READY: checked, waiting in the ready queue for the consumer (``generation`` of it).
- OUT: handed to the consumer; its views are valid until it is given back.
- QUARANTINED: a writer that the broker gave up on may still write it (``holder``); its
  request was asked for in another slot, and it comes back once that writer is done
  (a late answer to ``late_request``, RELEASE) or gone.

The table is all the pool's helpers (``delivery.py``, ``custody.py``) change: every move,
route, holder and lane is set by a method here, and what the moves leave for the pool to
carry out waits in two queues, ``to_ask`` (headers to ask before anything else) and
``to_send`` (requests to send on the next flush).

Each record also knows what served it last (``writer``, the writer id of its last
accepted commit, and ``lane``, the local worker's request lane), which is where its
next fill is asked for, and ``asked``, when its current request went out.
:meth:`SlotTable.check` verifies every invariant between the records and the
queues; tests call it.
"""

from __future__ import annotations

import enum
import secrets
from collections import deque
from dataclasses import dataclass

import numpy as np


class SlotState(enum.Enum):
    FREE = "free"
    PENDING = "pending"
    AWAITING = "awaiting"
    READY = "ready"
    OUT = "out"
    QUARANTINED = "quarantined"


class Route(enum.Enum):
    """Where a PENDING slot's fill is expected from."""

    BROKER = "broker"
    DIRECT = "direct"
    WRITER = "writer"


FREE, PENDING, AWAITING, READY, OUT, QUARANTINED = (SlotState.FREE, SlotState.PENDING, SlotState.AWAITING,
                                                    SlotState.READY, SlotState.OUT, SlotState.QUARANTINED)
TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    FREE: frozenset({PENDING}),
    PENDING: frozenset({PENDING, AWAITING, READY, QUARANTINED}),
    AWAITING: frozenset({READY, PENDING}),
    READY: frozenset({OUT, PENDING}),
    OUT: frozenset({PENDING}),
    QUARANTINED: frozenset({PENDING}),
}
"""Every move a slot may make (the diagram in the module docstring)."""
_TO_PENDING = frozenset(state for state, allowed in TRANSITIONS.items() if PENDING in allowed)


class SlotStateError(AssertionError):
    """A move the state machine does not allow: a bug in the pool, never bad input."""


@dataclass(slots=True, eq=False)
class SlotRecord:
    """One slot's whole state (module docstring)."""

    idx: int
    state: SlotState = FREE
    request_id: int = 0
    fill: int = 0
    generation: int = 0
    route: Route = Route.BROKER
    holder: str | int | None = None
    asked: float = 0.0
    overdue: int = 0
    """How often in a row this slot's fill was overdue (each time, the next deadline doubles)."""
    late_request: int = 0
    """QUARANTINED after a DIRECT: the request its silent writer may still answer (0: none)."""
    lane: tuple[str, str] | None = None
    """(path, process token) of the local worker that filled it last, where it is asked next."""
    writer: int = 0
    """Writer id of its last accepted commit."""


def random_request_ids(count: int) -> list[int]:
    """``count`` unguessable request ids (63 random bits, never 0)."""
    if count == 0:
        return []
    raw = np.frombuffer(secrets.token_bytes(8 * count), dtype=np.uint64)
    return ((raw >> np.uint64(1)) | np.uint64(1)).tolist()


class SlotTable:
    """The records of a pool's slots and the queues that index them."""

    def __init__(self, slot_count: int) -> None:
        self.records = [SlotRecord(idx) for idx in range(slot_count)]
        self.free: deque[int] = deque(range(slot_count))
        """FREE slots, in order."""
        self.ready: deque[tuple[int, int, int]] = deque()
        """READY slots in arrival order: (slot, generation, request id)."""
        self.to_send: list[int] = []
        """PENDING slots whose request has not been sent yet (sent on the pool's flush)."""
        self.to_ask: list[int] = []
        """PENDING slots with a new request whose header still shows the old one: the pool
        asks these headers (``HeaderTable.ask``) right after the move, before any request
        leaves, so that an old writer of the slot finds another fill there."""
        self.reissue: deque[tuple[int, int]] = deque()
        """(request id, fill) of quarantined slots' requests, to be asked for in other slots."""
        self.next_fill = 1

    def __len__(self) -> int:
        return len(self.records)

    def record(self, slot: int) -> SlotRecord | None:
        """The record of ``slot`` (None outside the table: slots in messages are untrusted)."""
        return self.records[slot] if 0 <= slot < len(self.records) else None

    def pending(self, slot: int, request_id: int) -> SlotRecord | None:
        """The record of ``slot`` if it is PENDING with ``request_id``, else None."""
        record = self.records[slot] if 0 <= slot < len(self.records) else None
        return record if record is not None and record.state is PENDING and record.request_id == request_id \
            else None

    def in_state(self, state: SlotState) -> list[SlotRecord]:
        return [record for record in self.records if record.state is state]

    # ------------------------------------------------------------------ moves
    def ask(self, slots: list[int], now: float, *, from_free: bool = False,
            handed_out: bool = False) -> list[SlotRecord]:
        """Move the slots to PENDING with fresh requests (quarantined ones' first), queued
        to be sent through the broker or a lane (``from_free``: they were FREE;
        ``handed_out``: they must be OUT, IndexError otherwise, before any moves). Returns
        their records. The hot path of every fill: no call per slot."""
        records = self.records
        count = len(records)
        if handed_out:
            bad = [slot for slot in slots if not 0 <= slot < count or records[slot].state is not OUT]
            if bad:
                raise IndexError(f"slot {bad[0]} is not a slot handed out by this pool")
        asked = [records[slot] for slot in slots]
        reissue = self.reissue
        reissued = min(len(reissue), len(asked)) if reissue else 0
        fresh = random_request_ids(len(asked) - reissued)
        first = self.next_fill
        self.next_fill = first + len(fresh)
        broker, allowed, pending = Route.BROKER, _TO_PENDING, PENDING
        for record in asked[:reissued]:
            record.request_id, record.fill = reissue.popleft()
            if record.state not in allowed:
                raise SlotStateError(f"slot {record.idx}: {record.state.name} -> PENDING")
            record.state, record.route, record.holder, record.asked = pending, broker, None, now
        for record, request_id, fill in zip(asked[reissued:], fresh, range(first, first + len(fresh)), strict=True):
            if record.state not in allowed:
                raise SlotStateError(f"slot {record.idx}: {record.state.name} -> PENDING")
            record.state, record.request_id, record.fill = pending, request_id, fill
            record.route, record.holder, record.asked = broker, None, now
        if from_free:
            self.free = deque(slot for slot in self.free if records[slot].state is FREE)
        self.to_send.extend(slots)
        self.to_ask.extend(slots)
        return asked

    def renew(self, record: SlotRecord, now: float, *, keep_request: bool) -> None:
        """Ask for a slot again with a fresh request (never a re-issued one: its header's
        fill must change, so an old writer of the slot finds another fill there). With
        ``keep_request``, its old request is re-issued in the next slot asked for (a FREE
        one at once)."""
        if record.state is not PENDING and PENDING not in TRANSITIONS[record.state]:
            raise SlotStateError(f"slot {record.idx}: {record.state.name} -> PENDING")
        if record.state is PENDING:
            self.unsend(record)
        if keep_request:
            self.reissue.append((record.request_id, record.fill))
        record.state = PENDING
        record.request_id, record.fill = random_request_ids(1)[0], self.next_fill
        self.next_fill += 1
        record.route, record.holder = Route.BROKER, None
        record.asked = now
        self.to_send.append(record.idx)
        self.to_ask.append(record.idx)
        if keep_request:
            self.reissue_free(now)

    def reissue_free(self, now: float) -> None:
        """Slots still FREE (never asked for) carry re-issued requests at once."""
        while self.reissue and self.free:
            self.ask([self.free[0]], now, from_free=True)

    def release(self, record: SlotRecord, now: float) -> None:
        """A QUARANTINED slot's writer is done with it or gone: back in use, asked for."""
        if record.state is not QUARANTINED:
            raise SlotStateError(f"slot {record.idx}: {record.state.name} released")
        record.late_request = 0
        self.ask([record.idx], now)

    def release_late(self, slot: int, request_id: int, now: float) -> bool:
        """A late answer (a notice or a DECLINED) to the DIRECT request ``request_id`` of a
        slot quarantined while its worker was silent: that worker is done with the slot,
        which is released. True when it was one (slots in messages are untrusted)."""
        record = self.record(slot)
        if record is None or record.state is not QUARANTINED or not record.late_request \
                or record.late_request != request_id:
            return False
        self.release(record, now)
        return True

    def await_data(self, record: SlotRecord, generation: int) -> None:
        """A completed slot whose data has not come yet (network medium)."""
        self.move(record, AWAITING)
        record.generation = generation

    def expected_request(self, slot: int) -> int | None:
        """The request id whose data ``slot`` takes (network medium; None: it takes none)."""
        record = self.record(slot)
        if record is None or record.state not in (PENDING, AWAITING):
            return None
        return record.request_id

    def unsend(self, record: SlotRecord) -> None:
        """Its request is not sent after all (the slot is someone else's now)."""
        if record.idx in self.to_send:
            self.to_send = [slot for slot in self.to_send if slot != record.idx]

    def move(self, record: SlotRecord, state: SlotState) -> None:
        """Move one record, checked against :data:`TRANSITIONS`."""
        if state not in TRANSITIONS[record.state]:
            raise SlotStateError(f"slot {record.idx}: {record.state.name} -> {state.name}")
        record.state = state

    def accept(self, records: list[SlotRecord], generation: int, writer: int = 0) -> None:
        """PENDING (or AWAITING) slots checked out, committed by ``writer``: READY, in this order."""
        ready = self.ready
        for record in records:
            state = record.state
            if state is not PENDING and state is not AWAITING:
                raise SlotStateError(f"slot {record.idx}: {state.name} -> READY")
            record.state = READY
            record.generation, record.writer = generation, writer
            if record.overdue:
                record.overdue = 0
            ready.append((record.idx, generation, record.request_id))

    def take_many(self, max_count: int, current: int) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Hand out up to ``max_count`` READY slots (now OUT), oldest first: the entries of
        generation ``current`` or newer, and the slots of older ones (stale: to ask again)."""
        ready, records = self.ready, self.records
        got, stale = [], []
        while ready and len(got) < max_count:
            entry = ready.popleft()
            record = records[entry[0]]
            if record.state is not READY:
                raise SlotStateError(f"slot {record.idx}: {record.state.name} -> OUT")
            record.state = OUT
            if entry[1] >= current:
                got.append(entry)
            else:
                stale.append(entry[0])
        return got, stale

    def quarantine(self, record: SlotRecord, holder: str | int | None, late_request: int = 0) -> None:
        """A PENDING slot a silent writer may still write: out of use, its request asked
        for in another slot."""
        self.move(record, QUARANTINED)
        self.unsend(record)
        self.reissue.append((record.request_id, record.fill))
        record.holder, record.late_request = holder, late_request

    # ------------------------------------------------------------------ routes and lanes
    def resend(self, record: SlotRecord) -> None:
        """A PENDING slot's request sent again, same id, through the broker: no holder, no
        lane (the worker whose lane it was will not fill it)."""
        record.route, record.holder, record.lane = Route.BROKER, None, None
        self.to_send.append(record.idx)

    def send_again(self, records: list[SlotRecord]) -> None:
        """PENDING slots whose request the broker refused: sent again as they are."""
        self.to_send.extend(record.idx for record in records)

    def asked_directly(self, record: SlotRecord, process: str) -> None:
        """A PENDING slot asked of the worker ``process`` by DIRECT."""
        record.route, record.holder = Route.DIRECT, process

    def left_to_writer(self, record: SlotRecord, claim: int) -> None:
        """A PENDING slot a live writer claims: it is that writer's to fill (its request is
        not sent again)."""
        record.route, record.holder = Route.WRITER, claim
        self.unsend(record)

    def direct_held(self) -> dict[str, int]:
        """process token -> how many PENDING slots that worker holds by DIRECT."""
        held: dict[str, int] = {}
        for record in self.records:
            if record.state is PENDING and record.route is Route.DIRECT:
                held[record.holder] = held.get(record.holder, 0) + 1
        return held

    # ------------------------------------------------------------------ checks

    def set_lanes(self, records: list[SlotRecord], lane: tuple[str, str] | None) -> None:
        """Where ``records`` are asked next: the local worker that filled them (None: the broker)."""
        for record in records:
            record.lane = lane

    def drop_lanes(self, process: str | None = None) -> None:
        """Forget the lanes of the worker ``process`` (every lane, when None)."""
        for record in self.records:
            if record.lane is not None and (process is None or record.lane[1] == process):
                record.lane = None

    def check(self) -> list[str]:
        """Every broken invariant between records and queues (empty when all hold)."""
        problems = []
        records = self.records
        for idx, record in enumerate(records):
            if record.idx != idx:
                problems.append(f"record {idx} says it is slot {record.idx}")
            if record.state in (PENDING, AWAITING, READY, OUT, QUARANTINED) and not record.request_id:
                problems.append(f"slot {idx} is {record.state.name} without a request id")
            if record.state is PENDING and record.route is not Route.BROKER and record.holder is None:
                problems.append(f"slot {idx} is PENDING by {record.route.name} without a holder")
            if record.state is QUARANTINED and record.holder is None and not record.late_request:
                problems.append(f"slot {idx} is QUARANTINED without a holder")
            if record.state is PENDING and not _holder_fits(record):
                problems.append(f"slot {idx} is PENDING by {record.route.name} held by {record.holder!r}")
            if record.lane is not None and not (len(record.lane) == 2 and all(isinstance(p, str) for p in record.lane)):
                problems.append(f"slot {idx} has a lane that is not (path, process): {record.lane!r}")
        free = list(self.free)
        if len(set(free)) != len(free) or set(free) != {r.idx for r in records if r.state is FREE}:
            problems.append(f"free queue {sorted(free)} != FREE slots")
        ready = [entry[0] for entry in self.ready]
        if len(set(ready)) != len(ready) or set(ready) != {r.idx for r in records if r.state is READY}:
            problems.append(f"ready queue {sorted(ready)} != READY slots")
        for slot, generation, request_id in self.ready:
            record = records[slot]
            if (record.generation, record.request_id) != (generation, request_id):
                problems.append(f"ready entry of slot {slot} does not match its record")
        if not {slot for slot in self.to_send} <= {r.idx for r in records if r.state is PENDING}:
            problems.append("a slot to send is not PENDING")
        if not set(self.to_ask) <= {r.idx for r in records if r.state is PENDING}:
            problems.append("a slot whose header is to be asked is not PENDING")
        live = [r.request_id for r in records if r.state in (PENDING, AWAITING, READY, OUT)]
        if len(set(live)) != len(live):
            problems.append("two slots hold the same request id")
        if {req for req, _ in self.reissue} & set(live):
            problems.append("a request to re-issue is still held by a slot")
        return problems


def _holder_fits(record: SlotRecord) -> bool:
    """A PENDING slot's holder is what its route says: none (broker), a worker's process
    token (DIRECT), a writer id (WRITER)."""
    if record.route is Route.BROKER:
        return record.holder is None
    if record.route is Route.DIRECT:
        return isinstance(record.holder, str)
    return isinstance(record.holder, int)
