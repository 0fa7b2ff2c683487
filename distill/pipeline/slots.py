"""A consumer's slots: one record per slot, moved by an explicit state machine.

Every slot of a :class:`~distill.pipeline.pool.SlotPool` is exactly one
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
  It has a ``deadline`` (``pool.py``: an overdue slot is looked at and asked for again).
- AWAITING: completed, but its data has not come yet (network medium).
- READY: checked, waiting in the ready queue for the consumer (``generation`` of it).
- OUT: handed to the consumer; its views are valid until it is given back.
- QUARANTINED: a writer that the broker gave up on may still write it (``holder``); its
  request was asked for in another slot, and it comes back once that writer is done
  (a late answer to ``late_request``, RELEASE) or gone.

Each record also knows what served it last (``writer``, the writer id of its last
accepted commit, and ``lane``, the local worker's request lane), which is where its
next fill is asked for, and ``asked``, when its current request went out.
:meth:`SlotTable.check` verifies every invariant between the records and the
queues; tests call it.
"""

from __future__ import annotations

import enum
import math
import secrets
from collections import deque
from collections.abc import Iterable
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
    deadline: float = math.inf
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
    def ask(self, slots: Iterable[int], now: float, deadline: float) -> list[SlotRecord]:
        """Move the slots to PENDING with fresh requests (quarantined ones' first), queued
        to be sent through the broker or a lane. Returns their records."""
        slots = list(slots)
        records = self.records
        reissued = min(len(self.reissue), len(slots))
        ids = [self.reissue.popleft() for _ in range(reissued)]
        fresh = random_request_ids(len(slots) - reissued)
        first = self.next_fill
        ids += zip(fresh, range(first, first + len(fresh)), strict=True)
        self.next_fill = first + len(fresh)
        asked = []
        freed = False
        for slot, (request_id, fill) in zip(slots, ids, strict=True):
            record = records[slot]
            if record.state is not PENDING and PENDING not in TRANSITIONS[record.state]:
                raise SlotStateError(f"slot {slot}: {record.state.name} -> PENDING")
            freed |= record.state is FREE
            record.state = PENDING
            record.request_id, record.fill = request_id, fill
            record.route, record.holder = Route.BROKER, None
            record.asked, record.deadline = now, deadline
            asked.append(record)
        if freed:
            self.free = deque(slot for slot in self.free if records[slot].state is FREE)
        self.to_send.extend(slots)
        return asked

    def renew(self, record: SlotRecord, now: float, deadline: float, *, keep_request: bool) -> None:
        """Ask for a slot again with a fresh request (never a re-issued one: its header's
        fill must change, so an old writer of the slot finds another fill there). With
        ``keep_request``, its old request is re-issued in the next slot asked for."""
        if record.state is not PENDING and PENDING not in TRANSITIONS[record.state]:
            raise SlotStateError(f"slot {record.idx}: {record.state.name} -> PENDING")
        if keep_request:
            self.reissue.append((record.request_id, record.fill))
        record.state = PENDING
        record.request_id, record.fill = random_request_ids(1)[0], self.next_fill
        self.next_fill += 1
        record.route, record.holder = Route.BROKER, None
        record.asked, record.deadline = now, deadline
        self.to_send.append(record.idx)

    def move(self, record: SlotRecord, state: SlotState) -> None:
        """Move one record, checked against :data:`TRANSITIONS`."""
        if state not in TRANSITIONS[record.state]:
            raise SlotStateError(f"slot {record.idx}: {record.state.name} -> {state.name}")
        record.state = state

    def accept(self, records: list[SlotRecord], generation: int) -> None:
        """PENDING (or AWAITING) slots checked out: READY, in this order."""
        for record in records:
            if record.state is not PENDING and record.state is not AWAITING:
                raise SlotStateError(f"slot {record.idx}: {record.state.name} -> READY")
            record.state = READY
            record.generation = generation
            record.overdue = 0
        self.ready.extend((record.idx, generation, record.request_id) for record in records)

    def take(self, entry: tuple[int, int, int]) -> None:
        """A READY slot handed to the consumer."""
        record = self.records[entry[0]]
        if record.state is not READY:
            raise SlotStateError(f"slot {record.idx}: {record.state.name} -> OUT")
        record.state = OUT

    def quarantine(self, record: SlotRecord, holder: str | int | None, late_request: int = 0) -> None:
        """A PENDING slot a silent writer may still write: out of use, its request asked
        for in another slot."""
        self.move(record, QUARANTINED)
        self.reissue.append((record.request_id, record.fill))
        record.holder, record.late_request = holder, late_request

    # ------------------------------------------------------------------ checks
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
        live = [r.request_id for r in records if r.state in (PENDING, AWAITING, READY, OUT)]
        if len(set(live)) != len(live):
            problems.append("two slots hold the same request id")
        if {req for req, _ in self.reissue} & set(live):
            problems.append("a request to re-issue is still held by a slot")
        return problems
