"""A worker's request lane: DIRECT requests from local students, past the broker.

Students on this machine ask the worker that filled a slot to fill it again with a
DIRECT datagram on the worker's lane (``notices.py``). The worker fills it like the
WORK the broker would have sent, with the model of the run's last plain WORK, and
answers with a notice; one it cannot fill as the broker would is declined. Broker
WORK comes first: what waits is filled before the DIRECTs, which are all declined if
it was for another student (``Worker._serve_direct``). Answers that cannot be
delivered now are kept and sent again for ``ANSWER_RETRY_S``.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections import deque
from collections.abc import Callable

from distill.pipeline.mediums.shm import is_our_name
from distill.pipeline.mediums.tcp import is_tcp_medium
from distill.pipeline.notices import (
    ANSWER_RETRY_S,
    Delivery,
    NoticeOutbox,
    RequestLane,
    encode_datagram,
    encode_notice,
)
from distill.pipeline.protocol import Command, Message
from distill.pipeline.throttle import LogThrottle
from distill.pipeline.worker.claims import STALE
from distill.pipeline.worker.segments import segment_exists

log = logging.getLogger(__name__)

MAX_QUEUED_DIRECT = 256
"""DIRECT requests a worker takes off its lane before filling them (more wait in the socket)."""

Model = tuple[int, str, dict | None]
"""(generation, model id, model cfg) of a run's last plain WORK: what a DIRECT may ask for."""


class DirectLane:
    """The lane's socket, the DIRECTs taken off it, and the answers not yet delivered; the
    notices announcing a WORK's filled slots go out through it too. Without
    ``direct_requests`` there is no socket (``lane`` None): only the notices."""

    notifies = True
    """Filled slots are announced to their students (:meth:`notice`)."""

    def __init__(self, peer_id: str, outbox: NoticeOutbox, lane: RequestLane | None, token: str | None,
                 max_batch: int) -> None:
        self.peer_id = peer_id
        self._outbox = outbox
        self._lane = lane
        self.name = None if lane is None else os.fspath(lane.path)
        """The lane's path as notices name it (made once, not per notice)."""
        self._token = token
        self._max_batch = max_batch
        self._queue: deque[Message] = deque()
        self._unsent: list[tuple[str, bytes, float]] = []
        """Answers not delivered yet (inbox full or gone): (segment, datagram, give-up time)."""
        self.filled = 0
        """Samples written for DIRECT requests (the broker never saw them)."""
        self.backlog = 0
        """DIRECT slots taken off the lane and not yet answered (filled or declined): the
        load the broker cannot see, reported with every heartbeat."""
        self.counts: dict[str, tuple[int, int]] = {}
        """run -> (filled, failed) DIRECT slots so far, reported to the broker for its statistics."""
        self._refusals = LogThrottle(log)

    def fileno(self) -> int | None:
        return None if self._lane is None else self._lane.fileno()

    @property
    def queued(self) -> bool:
        return bool(self._queue)

    @property
    def busy(self) -> bool:
        """DIRECTs queued, or answers to send again."""
        return bool(self._queue or self._unsent)

    def waiting(self) -> bool:
        """A DIRECT is queued here or on the lane (a batch to overlap a deferred commit with)."""
        if self._queue:
            return True
        return self._lane is not None and bool(select.select([self._lane.fileno()], [], [], 0)[0])

    def report(self) -> dict:
        """DIRECT fills so far, for READY and every heartbeat (the heartbeat thread reads
        it: the counts are replaced, never changed in place, so a copy is consistent)."""
        counts = dict(self.counts)
        report: dict = {"backlog": max(0, self.backlog)}  # never a number the broker refuses
        if counts:
            report["direct"] = {run_id: list(c) for run_id, c in counts.items()}
        return report

    # ------------------------------------------------------------------ requests
    def take(self) -> None:
        """Move the datagrams waiting on the lane into the queue (up to its bound)."""
        if self._lane is None or len(self._queue) >= MAX_QUEUED_DIRECT:
            return
        for msg in self._lane.receive(MAX_QUEUED_DIRECT - len(self._queue)):
            if is_our_name(msg.body["medium"]):  # else there is no student inbox to answer
                self._queue.append(msg)
                self.backlog += len(msg.body["slots"])
            else:
                self._refusals.warning("worker %s: direct request for %r dropped: not a segment of ours",
                                       self.peer_id, msg.body["medium"][:64])

    def others_in(self, works: list[Message]) -> bool:
        """Whether broker ``works`` name a segment that no queued DIRECT names (another
        student is waiting on the broker)."""
        asking = {msg.body["medium"] for msg in self._queue}
        return any(item[0] not in asking for work in works for item in work.body["items"])

    def decline_all(self, why: str) -> None:
        while self._queue:
            body = self._queue.popleft().body
            self.backlog -= len(body["slots"])
            self.decline(body, why)

    def next_batch(self, model_for: Callable[[dict], Model | str]) -> list[Message]:
        """Up to about ``max_batch`` slots of queued DIRECTs as WORK-like messages;
        ``model_for(body)`` gives the model to fill one with, or why not (declined)."""
        works, slots = [], 0
        while self._queue and slots < self._max_batch:
            body = self._queue.popleft().body
            room = self._max_batch - slots
            if len(body["slots"]) > room:  # the rest waits: a batch is at most max_batch slots
                self._queue.appendleft(Message(Command.DIRECT, {**body, "slots": body["slots"][room:]}))
                body = {**body, "slots": body["slots"][:room]}
            model = model_for(body)
            if isinstance(model, str):
                self.backlog -= len(body["slots"])
                self.decline(body, model)
                continue
            works.append(_as_work(body, model, len(works)))
            slots += len(body["slots"])
        return works

    # ------------------------------------------------------------------ answers
    def notice(self, segment: str, generation: int, slots: list[list], shared: bool) -> bool:
        """Announce a WORK's filled ``slots`` to the student of ``segment``; True when it got
        there (else the broker completes them). The notice names our lane, so the student
        asks us directly next time, except for a fan-out run (``shared``): its slots must
        keep going through the broker, which is what lets one teacher pass serve several runs."""
        return self._outbox.send(segment, generation, slots, None if shared else self.name, self._token)

    def answer(self, body: dict, failures: dict[int, str]) -> None:
        """Notify the student of a filled DIRECT (its failed slots too: no broker will);
        slots the worker would not write are declined, so the student asks the broker."""
        self.backlog = max(0, self.backlog - len(body["items"]))
        slots, stale = [], []
        for idx, (_medium, slot_idx, _stride, request_id) in enumerate(body["items"]):
            why = failures.get(idx)
            if why == STALE:
                stale.append([slot_idx, request_id])
            else:
                slots.append([slot_idx, request_id, why is None])
        filled = sum(1 for row in slots if row[2])
        self.filled += filled
        # Slots of a student that has left (its segment unlinked before this batch) are
        # nobody's loss: the broker's statistics count them neither filled nor failed.
        unfilled = len(slots) - filled
        if unfilled and _student_left(body["medium"]):
            unfilled = 0
        done, failed = self.counts.get(body["run_id"], (0, 0))
        self.counts = {**self.counts, body["run_id"]: (done + filled, failed + unfilled)}
        if stale:
            self.decline({**body, "slots": stale}, "not written (another fill, or another writer)")
        if slots:
            self.post(body["medium"], encode_notice(body["generation"], slots, self.name, self._token))

    def decline(self, body: dict, why: str) -> None:
        self.post(body["medium"], encode_datagram(Command.DECLINED, {
            "generation": body["generation"], "slots": body["slots"], "reason": why[:200]}))

    def post(self, segment: str, data: bytes, give_up: float | None = None) -> None:
        """Send an answer to a DIRECT; kept and sent again for ``ANSWER_RETRY_S`` while it
        cannot be delivered (see ``notices.py``)."""
        delivery = self._outbox.post(segment, data)
        if delivery is Delivery.SENT or (delivery is Delivery.GONE and not segment_exists(segment)):
            return  # sent, or its student is gone (it unlinks its segment after its inbox)
        now = time.monotonic()
        give_up = now + ANSWER_RETRY_S if give_up is None else give_up
        if now < give_up:
            self._unsent.append((segment, data, give_up))
        else:
            log.info("worker %s: gave up answering a direct request of %s (its inbox is gone)",
                     self.peer_id, segment)

    def retry_unsent(self) -> None:
        unsent, self._unsent = self._unsent, []
        for segment, data, give_up in unsent:
            self.post(segment, data, give_up)

    def shut(self) -> None:
        """Stopping: decline every DIRECT still queued (here or on the lane), and try
        once more for answers that could not be sent (a full inbox may have room now)."""
        if self._lane is None:
            return
        self._queue.extend(self._lane.shut())
        self._lane = self.name = None
        self.decline_all("the worker is stopping")
        deadline = time.monotonic() + 0.2  # short: a student that is gone makes us wait it all
        while self._unsent and time.monotonic() < deadline:
            self.retry_unsent()
            if self._unsent:
                time.sleep(0.01)


class NoLane:
    """A worker without notices (``notices=False``): no lane, no DIRECT, no
    notice; the broker completes every slot. It stands in for :class:`DirectLane`, so that
    the worker's loop and its batches have no branches for the case."""

    notifies = False
    name = None
    filled = 0
    backlog = 0
    queued = False
    busy = False

    def fileno(self) -> None:
        return None

    def waiting(self) -> bool:
        return False

    def report(self) -> dict:
        return {}

    def take(self) -> None:
        pass

    def others_in(self, works: list[Message]) -> bool:
        return False

    def decline_all(self, why: str) -> None:
        pass

    def next_batch(self, model_for: Callable[[dict], Model | str]) -> list[Message]:
        return []

    def answer(self, body: dict, failures: dict[int, str]) -> None:
        raise AssertionError("a DIRECT was filled by a worker that has no lane")

    def notice(self, segment: str, generation: int, slots: list[list], shared: bool) -> bool:
        return False

    def retry_unsent(self) -> None:
        pass

    def shut(self) -> None:
        pass


def why_not(body: dict, model: Model | None, shared: bool, newest: int) -> str | None:
    """Why a DIRECT cannot be filled as the broker would fill it (None: it can)."""
    generation = body["generation"]
    return ("no WORK of this run seen" if model is None
            else "fan-out run" if shared
            else "network medium" if is_tcp_medium(body["medium"])
            else "another generation" if model[0] != generation or generation < newest
            else None)


def _as_work(body: dict, model: Model, number: int) -> Message:
    """A DIRECT as the WORK the broker would have sent (``work_id`` -1 - ``number``:
    unique in its batch, never a broker's)."""
    medium, stride = body["medium"], body["stride"]
    return Message(Command.DIRECT, {
        "work_id": -1 - number, "run_id": body["run_id"], "generation": body["generation"],
        "model_id": model[1], "model_cfg": model[2], "medium": medium,
        "items": [[medium, slot_idx, stride, request_id] for slot_idx, request_id in body["slots"]]})


def _student_left(medium: str) -> bool:
    """A shared-memory medium whose segment is gone: its student closed it and left."""
    return not is_tcp_medium(medium) and not segment_exists(medium)
