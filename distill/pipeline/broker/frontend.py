"""The students' socket: HELLO, REQUEST, HEARTBEAT, BYE (STATS is the service's).

Each handler takes the sender's routing identity, its CurveZMQ key (None without
authentication) and the validated body; it refuses by raising ``ProtocolError``
(``Impostor`` for another connection's peer id or medium), which the loop answers
with an ERROR. A REQUEST is checked against the limits (``limits.check_request``),
its medium claimed for the sender's connection, split at the queue limits (the slots
that fit are queued, the rest named back in the ERROR so the student asks again) and
dropped where it repeats a request already outstanding.
"""

from __future__ import annotations

import logging
import time

from distill.pipeline.broker import limits
from distill.pipeline.broker.limits import over_limit
from distill.pipeline.broker.records import (
    Impostor,
    SlotRequests,
    StudentPeer,
    check_key,
    medium_label,
)
from distill.pipeline.broker.runs import cfg_fields, note_cfg_sent
from distill.pipeline.broker.state import BrokerState
from distill.pipeline.liveness import beat_identity
from distill.pipeline.protocol import Command, ProtocolError
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)


class Frontend:
    """Student handlers and the students' liveness."""

    def __init__(self, state: BrokerState) -> None:
        self.state = state
        self._repeats = LogThrottle(log)
        self._reclaims = LogThrottle(log)

    def _touch(self, identity: bytes, key: str | None, peer_id: str, run_id: str, command: str) -> StudentPeer:
        """The student ``peer_id`` (registered at its first HELLO or REQUEST), bound to this connection."""
        students, now = self.state.students, time.monotonic()
        peer = students.bound(identity, peer_id, key, command)
        if peer is None:
            peer = students.add(identity, peer_id, key, run_id, now)
        elif peer.run_id != run_id:
            raise ProtocolError(f"student {peer_id} belongs to run {peer.run_id}, not {run_id}: "
                                "use one peer id per run")
        peer.last_seen = now
        self.state.runs.mark_live(run_id, now)
        return peer

    def on_hello(self, identity: bytes, key: str | None, body: dict) -> None:
        state = self.state
        run = state.runs.get_or_add(body["run_id"], state.busy_runs)
        connection = self._touch(identity, key, body["peer_id"], run.run_id, "HELLO").connection
        welcome = {"run_id": run.run_id, "generation": run.generation, "model_id": run.model_id,
                   "heartbeat_interval_ms": int(state.config.heartbeat_interval_s * 1000)}
        welcome.update(cfg_fields(connection.models, run))  # once per connection and model:
        note_cfg_sent(connection.models, run, state.config.max_runs)  # a HELLO buys no large answer
        state.send.to_student(identity, Command.WELCOME, welcome)

    def on_request(self, identity: bytes, key: str | None, body: dict) -> None:
        state = self.state
        stride, slots, medium = body["stride"], body["slots"], body["medium"]
        limits.check_request(state.config, stride, slots)
        run = state.runs.get_or_add(body["run_id"], state.busy_runs)
        peer = self._touch(identity, key, body["peer_id"], run.run_id, "REQUEST")
        state.students.claim_medium(peer.connection, medium, stride)
        room = state.runs.make_room(run, peer.connection, len(slots))
        if room.reclaimed:
            self._give_back(room.reclaimed)
        refused = None
        if len(slots) > room.slots:
            share = " (its fair share: other runs or connections ask too)" if room.share else ""
            refused = over_limit(f"{len(slots)} slots asked, room for {room.slots} more{share}", room.limit)
            refused.slots = slots[room.slots:]  # type: ignore[attr-defined]  # named in the ERROR reply
            state.counters.refused += len(slots) - room.slots
            slots = slots[:room.slots]
        fresh = state.ledger.admit(medium, slots)
        if len(fresh) < len(slots):
            self._repeats.warning("dropped %d repeated request(s) for slots of %s", len(slots) - len(fresh),
                                  medium_label(medium))
        if fresh:
            state.runs.enqueue(run, SlotRequests(peer.connection, run.run_id, medium, stride, fresh))
        state.counters.requested += len(fresh)
        state.requested_rate.add(len(fresh))
        if refused is not None:
            raise refused

    def on_heartbeat(self, identity: bytes, key: str | None, body: dict) -> None:
        """Heartbeats come from the student's heartbeat socket, whose routing identity is
        its connection's with a suffix (``liveness.beat_identity``), or from the connection
        itself: a beat from any other connection keeps no peer alive (one socket beating
        for many peer ids kept their queues for ever), and with keys it carries the peer's.
        A leader's beats keep its run alive the same way (its peer id is its identity)."""
        state = self.state
        students = state.students
        peer = students.peers.get(body["peer_id"])
        if identity in (peer_id := body["peer_id"].encode(), beat_identity(peer_id)):
            state.runs.heard_leader(body["peer_id"], time.monotonic())  # a leader that never said HELLO
        if peer is None and body["peer_id"] in students.purged:
            # We dropped its requests: it must ask again. (Unknown but never purged
            # means its first REQUEST is still on the way: nothing to do.)
            del students.purged[body["peer_id"]]
            state.send.to_student(identity, Command.RECONNECT, {})
            return
        if peer is not None:
            check_key(f"student {peer.peer_id[:64]}", peer.connection.key, key)
            if identity not in (peer.identity, beat_identity(peer.identity)):
                raise Impostor(f"HEARTBEAT names student {peer.peer_id[:64]}, which is bound to another "
                               "connection: refused")
            peer.last_seen = time.monotonic()
            state.runs.mark_live(peer.run_id, peer.last_seen)
        # With how many live workers there are: the student splits its direct requests
        # among that many (a worker that joins later gets its share at once).
        state.send.to_student(identity, Command.HEARTBEAT, {**state.beat_body, "workers": len(state.workers)})

    def on_bye(self, identity: bytes, key: str | None, body: dict) -> None:
        peer = self.state.students.bound(identity, body["peer_id"], key, "BYE")
        if peer is not None:
            self.forget(peer)

    def _give_back(self, reclaimed: list[SlotRequests]) -> None:
        """Requests taken back from those over their fair share: no longer outstanding,
        and their owners told they were refused (to be asked for again, as any refusal)."""
        state = self.state
        state.ledger.settle(reclaimed, answered=False)
        by_owner: dict[bytes, list[list[int]]] = {}
        for request in reclaimed:
            by_owner.setdefault(request.student, []).extend(request.slots)
        state.counters.refused += sum(len(rows) for rows in by_owner.values())
        self._reclaims.warning("took back %d queued slot(s) of %d connection(s) over their fair share of "
                               "max_queued", sum(len(rows) for rows in by_owner.values()), len(by_owner))
        for identity, rows in by_owner.items():
            body = {"reason": over_limit(f"{len(rows)} queued slots taken back for other runs or connections "
                                         "(this one holds more than its fair share)", "max_queued").reason,
                    "command": Command.REQUEST.name}
            if state.echo.take(identity, len(rows)):
                body["slots"] = rows
            else:
                state.counters.throttled += 1
            state.send.to_student(identity, Command.ERROR, body)

    def forget(self, peer: StudentPeer, *, purged: bool = False) -> None:
        """Drop ``peer``'s queued requests and its record (and its connection's, when last)."""
        state = self.state
        run = state.runs.get(peer.run_id)
        if run is not None:
            state.ledger.settle(state.runs.drop(run, peer.connection), answered=False)
        state.students.remove(peer, purged=purged)

    def drop_connection(self, identity: bytes) -> None:
        """Forget the students of a connection that reads none of its replies, as if they
        had missed their heartbeats (``service.py``)."""
        students = self.state.students
        connection = students.connections.get(identity)
        for peer_id in list(connection.peers) if connection is not None else ():
            self.forget(students.peers[peer_id], purged=True)

    def purge(self, now: float) -> None:
        """Forget students that missed their heartbeats (they are told RECONNECT if they beat again)."""
        config = self.state.config
        deadline = now - config.heartbeat_interval_s * config.heartbeat_liveness
        for peer in [s for s in self.state.students.peers.values() if s.last_seen < deadline]:
            log.warning("student %s missed %d heartbeats: dropping its requests", peer.peer_id,
                        config.heartbeat_liveness)
            self.forget(peer, purged=True)
