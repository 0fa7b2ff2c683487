"""Runs and their queues: the only code that moves slots in or out of a run's queue.

State per run (``RunState``): model, generation, and the requested slots: one FIFO per
student connection, served round robin. Every change to a queue goes through
:class:`RunTable`, which keeps three counts in step with it: the run's ``queued``, the
broker's total, and each connection's (its ``Connection.queued``), so the limits never
sum over tables and no count drifts from the queues it describes. The table also keeps
what the runs' ``model_cfg`` weigh together (``retained_cfg_bytes``), bounded by
``max_retained_cfg_bytes``.

Fair shares of ``max_queued`` (taken back by :meth:`RunTable.make_room`, newest slots
first) and runs forgotten without live peers (:meth:`RunTable.forget_abandoned`): see
docs/pipeline.md, section Limits, and docs/security.md, section Fair shares of the
broker's queue (issue 37).

:class:`RequestLedger` remembers which slot requests are outstanding or were just
answered, so that a repeated REQUEST (a student re-asking after our restart while its
first REQUEST was still on the way) never has one slot dispatched twice.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from distill.pipeline import protocol
from distill.pipeline.broker.config import BrokerConfig
from distill.pipeline.broker.limits import over_limit
from distill.pipeline.broker.records import Connection, SlotRequests

RECENTLY_SETTLED = 16_384
"""Slot requests remembered after they were answered, so that a repeat still on its way
(sent again by a student that saw us restart) is not filled a second time."""


@dataclass(slots=True, eq=False)
class RunState:
    run_id: str
    generation: int = 0
    model_id: str | None = None
    model_cfg: dict | None = None
    cfg_cost: int = 0
    """What keeping ``model_cfg`` costs (``limits.cfg_cost``), counted in the table's total."""
    cfg_digest: str | None = None
    """``protocol.cfg_digest(model_cfg)``: what WELCOME says instead of a cfg the student has."""
    queues: OrderedDict[Connection, deque[SlotRequests]] = field(default_factory=OrderedDict)
    """Per student connection, its requests in order; the first connection is served next."""
    queued: int = 0
    """Slots in ``queues``."""
    completed: int = 0
    discarded: int = 0
    """Slots answered DISCARDED: computed for a generation the run has left (stale)."""
    abandoned: int = 0
    """Slots in flight when their student left (its segment gone): nobody waits for them."""
    leader_epoch: int = 0
    leader_id: str | None = None
    leader_key: bytes | None = None
    """Hash of the run's leader secret (``control.py``); None: no leader has claimed it here."""
    fan_out: bool = False
    """Fan-out opt-in: its slots may get samples computed for other runs of the same model."""
    last_live: float = field(default_factory=time.monotonic)
    """When a live peer of the run was last seen (monotonic; until one is, when it was made)."""

    def same_model(self, other: RunState) -> bool:
        """Whether ``other`` asks for exactly this run's model (both depth-bounded by the protocol)."""
        return other.model_id == self.model_id and other.model_cfg == self.model_cfg


def cfg_fields(sent: dict[str, str], run: RunState) -> dict[str, Any]:
    """What a WELCOME or WORK says of ``run``'s model_cfg to a peer that was sent the
    configs in ``sent`` (run id -> digest): the digest always, the config itself only if
    this peer does not have it yet. A model_cfg may weigh up to ``protocol.MAX_CFG_BYTES``;
    sent with every HELLO's answer or every WORK, one SET_MODEL would be copied over and over."""
    if run.model_cfg is None:
        return {}
    if sent.get(run.run_id) == run.cfg_digest:
        return {"model_digest": run.cfg_digest}
    return {"model_digest": run.cfg_digest, "model_cfg": run.model_cfg}


def note_cfg_sent(sent: dict[str, str], run: RunState, max_runs: int) -> None:
    """Note in ``sent`` that the peer now has ``run``'s model_cfg (the oldest runs' entries
    go first past ``max_runs``)."""
    if run.model_cfg is None or sent.get(run.run_id) == run.cfg_digest:
        return
    sent.pop(run.run_id, None)
    sent[run.run_id] = run.cfg_digest
    if len(sent) > max_runs:
        del sent[next(iter(sent))]


class RunTable:
    """Runs by id, the round-robin order they are served in, and their queues' counts."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.runs: dict[str, RunState] = {}
        self.order: deque[str] = deque()
        """Round robin: the run served next is ``order[0]``."""
        self.queued = 0
        """Slots queued over all runs."""
        self.asking = 0
        """Runs with slots queued (their number divides ``max_queued`` into fair shares)."""
        self.retained_cfg_bytes = 0
        self.unclaimed: dict[str, None] = {}
        """Runs no live peer has ever shown up for, oldest first (an insertion-ordered set)."""
        self.leaders: dict[str, str] = {}
        """Leader peer id -> the one run its heartbeats keep alive (its latest SET_MODEL's)."""

    def __len__(self) -> int:
        return len(self.runs)

    def get(self, run_id: str) -> RunState | None:
        return self.runs.get(run_id)

    def get_or_add(self, run_id: str, busy: Callable[[], set[str]]) -> RunState:
        """The run ``run_id``, made if new (forgetting another at ``max_runs``, see :meth:`_make_room`)."""
        run = self.runs.get(run_id)
        if run is None:
            self._make_room(run_id, busy)
            run = self.runs[run_id] = RunState(run_id)
            self.order.append(run_id)
            self.unclaimed[run_id] = None
        return run

    def _make_room(self, run_id: str, busy: Callable[[], set[str]]) -> None:
        """At ``max_runs``, forget the oldest run no live peer ever showed up for, else an
        idle one (no model, queue, student or work), else refuse."""
        if len(self.runs) < self.config.max_runs:
            return
        victim = next(iter(self.unclaimed), None)
        if victim is None:
            in_use = busy()
            victim = next((r.run_id for r in self.runs.values()
                           if r.model_id is None and not r.queued and r.run_id not in in_use), None)
        if victim is None:
            raise over_limit(f"{len(self.runs)} runs known, cannot add run {run_id[:40]}", "max_runs")
        self.forget(victim)

    # ------------------------------------------------------------------ liveness
    def mark_live(self, run_id: str, now: float) -> None:
        """A live peer of ``run_id`` showed up (a student's message, its leader's heartbeat)."""
        run = self.runs.get(run_id)
        if run is not None:
            run.last_live = now
            if self.unclaimed:
                self.unclaimed.pop(run_id, None)

    def heard_leader(self, peer_id: str, now: float) -> None:
        """A heartbeat from ``peer_id``: if it leads a run, that run has a live peer."""
        run_id = self.leaders.get(peer_id)
        if run_id is not None:
            self.mark_live(run_id, now)

    def set_leader(self, run: RunState, epoch: int, peer_id: str, leader_key: bytes | None = None) -> None:
        """``peer_id`` (epoch ``epoch``, holding the secret hashed to ``leader_key``) leads
        ``run`` now (None: the key it has); its heartbeats keep this run alive, and no other
        (a peer id leads one run: one beat cannot keep many alive)."""
        if run.leader_id is not None and self.leaders.get(run.leader_id) == run.run_id:
            del self.leaders[run.leader_id]
        run.leader_epoch, run.leader_id = epoch, peer_id
        if leader_key is not None:
            run.leader_key = leader_key
        self.leaders[peer_id] = run.run_id

    def forget_abandoned(self, now: float, busy: set[str]) -> list[str]:
        """Forget the runs without a live peer for ``run_grace_s`` (``busy``: runs with a
        student or a WORK in flight, alive now); returns their ids."""
        for run_id in busy:
            self.mark_live(run_id, now)
        since = now - self.config.run_grace
        gone = [run.run_id for run in self.runs.values() if run.last_live < since and not run.queued]
        if gone:
            for run_id in gone:
                self._drop(run_id)
            kept = [run_id for run_id in self.order if run_id in self.runs]  # one pass, not one per run
            self.order.clear()
            self.order.extend(kept)
        return gone

    def forget(self, run_id: str) -> None:
        """Drop run ``run_id`` (nothing queued in it) and all it keeps: model, generation, leader."""
        self._drop(run_id)
        self.order.remove(run_id)

    def _drop(self, run_id: str) -> None:
        run = self.runs.pop(run_id)
        assert not run.queued, f"run {run_id} forgotten with {run.queued} slots queued"
        self.unclaimed.pop(run_id, None)
        if run.leader_id is not None and self.leaders.get(run.leader_id) == run_id:
            del self.leaders[run.leader_id]
        self.retained_cfg_bytes -= run.cfg_cost

    def set_model(self, run: RunState, model_id: str, model_cfg: dict | None, cost: int) -> None:
        """Switch ``run``'s model, within the bytes all runs' configs may keep."""
        total = self.retained_cfg_bytes - run.cfg_cost + cost
        if total > self.config.max_retained_cfg_bytes:
            raise over_limit(f"run {run.run_id}: its model_cfg would bring what all runs keep to "
                             f"{total} bytes", "max_retained_cfg_bytes")
        self.retained_cfg_bytes = total
        run.model_id, run.model_cfg, run.cfg_cost = model_id, model_cfg, cost
        run.cfg_digest = None if model_cfg is None else protocol.cfg_digest(model_cfg)

    # ------------------------------------------------------------------ queues
    def make_room(self, run: RunState, connection: Connection, wanted: int) -> Room:
        """How many of ``wanted`` slots ``connection`` may queue in ``run`` now, and the
        limit that binds. Room this connection is owed (within its share) but that another
        connection of the run, or another run, holds beyond its own share is taken back
        from them first: the caller answers the ``reclaimed`` requests as refused."""
        config = self.config
        run_share = max(1, config.max_queued // (self.asking + (not run.queued)))
        run_cap = min(config.max_queued_per_run, run_share)
        connection_cap = max(1, run_cap // (len(run.queues) + (connection not in run.queues)))
        owed = min(wanted, config.max_queued_per_student - connection.queued, connection_cap - connection.queued)
        reclaimed: list[SlotRequests] = []
        if owed > 0 and (short := owed - (run_cap - run.queued)) > 0:
            reclaimed += self._reclaim(((run, c) for c in run.queues if c is not connection), connection_cap, short)
        if owed > 0 and (short := owed - (config.max_queued - self.queued)) > 0:
            reclaimed += self._reclaim(((r, c) for r in self.runs.values() if r is not run and r.queued > run_share
                                        for c in r.queues), run_share, short, by_run=True)
        hard, limit = min((config.max_queued_per_student - connection.queued, "max_queued_per_student"),
                          (config.max_queued - self.queued, "max_queued"),
                          (config.max_queued_per_run - run.queued, "max_queued_per_run"))
        share = min(connection_cap - connection.queued, run_cap - run.queued)
        if share < hard:
            return Room(max(0, share), "max_queued", reclaimed, share=True)
        return Room(max(0, hard), limit, reclaimed)

    def _reclaim(self, holders: Iterable[tuple[RunState, Connection]], share: int, count: int, *,
                 by_run: bool = False) -> list[SlotRequests]:
        """Up to ``count`` queued slots taken back from ``holders`` beyond ``share`` (a
        connection's, or with ``by_run`` a run's), the one holding most first, each
        holder's newest slots first."""
        key = (lambda h: (h[0].queued, h[1].queued)) if by_run else (lambda h: h[1].queued)
        taken: list[SlotRequests] = []
        for run, owner in sorted(holders, key=key, reverse=True):
            excess = (run.queued if by_run else owner.queued) - share
            if count <= 0:
                break
            if excess > 0:
                got = self._take_back(run, owner, min(count, excess))
                taken += got
                count -= sum(len(r.slots) for r in got)
        return taken

    def _take_back(self, run: RunState, owner: Connection, count: int) -> list[SlotRequests]:
        """Up to ``count`` slots from the tail of ``owner``'s queue in ``run`` (the last group split)."""
        queue = run.queues.get(owner)
        taken: list[SlotRequests] = []
        left = count
        while left > 0 and queue:
            tail = queue[-1]
            if len(tail.slots) <= left:
                taken.append(queue.pop())
            else:
                taken.append(SlotRequests(tail.owner, tail.run_id, tail.medium, tail.stride, tail.slots[-left:]))
                del tail.slots[-left:]
            left -= len(taken[-1].slots)
        if queue is not None and not queue:
            del run.queues[owner]
        self._count(run, taken, -1)
        return taken

    def enqueue(self, run: RunState, request: SlotRequests) -> None:
        queue = run.queues.get(request.owner)
        if queue is None:
            queue = run.queues[request.owner] = deque()
        queue.append(request)
        self._count(run, (request,), +1)

    def requeue_front(self, run: RunState, requests: list[SlotRequests]) -> None:
        """Put ``requests`` back at the head of their connections' queues, in their order,
        and those connections first in turn (their slots were waiting longest)."""
        by_owner: dict[Connection, list[SlotRequests]] = {}
        for request in requests:
            by_owner.setdefault(request.owner, []).append(request)
        for owner, group in reversed(by_owner.items()):
            queue = run.queues.get(owner)
            if queue is None:
                queue = run.queues[owner] = deque()
            queue.extendleft(reversed(group))
            run.queues.move_to_end(owner, last=False)
        self._count(run, requests, +1)

    def take(self, run: RunState, count: int) -> list[SlotRequests]:
        """Up to ``count`` queued slots, shared out among the run's connections in turn
        (each connection's oldest first; a group split where a share ends)."""
        taken: list[SlotRequests] = []
        left, queues = count, run.queues
        while left > 0 and queues:
            share = max(1, left // len(queues))
            for owner in list(queues):
                if left <= 0:
                    break
                got = _take_from(queues[owner], min(share, left))
                taken.extend(got)
                left -= sum(len(r.slots) for r in got)
                if not queues[owner]:
                    del queues[owner]
        if queues:
            queues.move_to_end(next(iter(queues)))  # the next take starts with another connection
        self._count(run, taken, -1)
        return taken

    def drop(self, run: RunState, connection: Connection) -> list[SlotRequests]:
        """Take every queued request of ``connection`` out of ``run``; returns them."""
        dropped = list(run.queues.pop(connection, ()))
        self._count(run, dropped, -1)
        return dropped

    def _count(self, run: RunState, requests: Iterable[SlotRequests], sign: int) -> None:
        total = 0
        for request in requests:
            count = len(request.slots)
            request.owner.queued += sign * count
            total += count
        was_asking = run.queued > 0
        run.queued += sign * total
        self.queued += sign * total
        self.asking += (run.queued > 0) - was_asking


def _take_from(queue: deque[SlotRequests], count: int) -> list[SlotRequests]:
    """Up to ``count`` slots from the head of one connection's queue (the last group split)."""
    taken: list[SlotRequests] = []
    left = count
    while left > 0 and queue:
        head = queue[0]
        if len(head.slots) <= left:
            taken.append(queue.popleft())
        else:
            taken.append(SlotRequests(head.owner, head.run_id, head.medium, head.stride, head.slots[:left]))
            del head.slots[:left]
        left -= len(taken[-1].slots)
    return taken


@dataclass(slots=True)
class Room:
    """What :meth:`RunTable.make_room` decided for one REQUEST."""

    slots: int
    """Slots that may be queued now."""
    limit: str
    """The setting that binds (``max_queued`` also for a fair share of it)."""
    reclaimed: list[SlotRequests]
    """Requests taken back from those over their share (to be answered as refused)."""
    share: bool = False
    """Whether a fair share binds rather than the limit itself."""


class RequestLedger:
    """(medium, slot, request id) of every slot request queued or in flight, and of the
    last RECENTLY_SETTLED answered: a REQUEST repeating one of them is dropped, so no slot
    is ever dispatched twice. Bounded by the queue limits and workers' credit."""

    def __init__(self) -> None:
        self._outstanding: set[tuple[str, int, int]] = set()
        self._recent: deque[tuple[str, int, int]] = deque()
        self._recent_set: set[tuple[str, int, int]] = set()

    def admit(self, medium: str, slots: list[list[int]]) -> list[list[int]]:
        """The slots not already outstanding or just answered; marks them outstanding."""
        out, recent = self._outstanding, self._recent_set
        keys = [(medium, slot, req) for slot, req in slots]
        key_set = set(keys)
        if len(key_set) == len(keys) and out.isdisjoint(key_set) and recent.isdisjoint(key_set):
            out.update(key_set)
            return slots
        fresh, seen = [], set()
        for row, key in zip(slots, keys, strict=True):
            if key not in out and key not in recent and key not in seen:
                fresh.append(row)
                seen.add(key)
        out.update(seen)
        return fresh

    def settle(self, requests: Iterable[SlotRequests], answered: bool = True) -> None:
        """These slot requests are answered (remembered for a while: a repeat of one is
        dropped) or dropped (a student may ask for them again: quarantine, purge)."""
        out, recent, recent_set = self._outstanding, self._recent, self._recent_set
        for request in requests:
            medium = request.medium
            keys = [(medium, slot, req) for slot, req in request.slots]
            out.difference_update(keys)
            if answered:
                recent.extend(keys)
                recent_set.update(keys)
        while len(recent) > RECENTLY_SETTLED:
            recent_set.discard(recent.popleft())
