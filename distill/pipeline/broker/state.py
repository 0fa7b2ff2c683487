"""Everything one broker knows, in one object its parts share (no part owns a copy).

The tables (runs, students, workers), the request ledger, the batch clock and the
counters live here; the handlers (``frontend``, ``backend``, ``control``) and the
dispatcher change them, and only :class:`Sockets` sends. Nothing in here is touched
by two threads at once: the broker's loop holds ``lock`` while it works, and
``Broker.stats`` takes it to read a snapshot.
"""

from __future__ import annotations

import heapq
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from distill.pipeline import protocol
from distill.pipeline.broker.config import BrokerConfig
from distill.pipeline.broker.deadline import BatchClock
from distill.pipeline.broker.limits import EchoBudget
from distill.pipeline.broker.records import StudentTable, WorkerTable
from distill.pipeline.broker.runs import RequestLedger, RunState, RunTable
from distill.pipeline.protocol import Command
from distill.pipeline.stats import BrokerStats, RateMeter


@dataclass(slots=True)
class Sockets:
    """The broker's four sockets, once bound; every message the broker sends goes here.

    Replies to students and leaders never wait: their sockets are ROUTER_MANDATORY with no
    send timeout, so a reply to a connection with BROKER_REPLY_HWM unread ones is dropped
    here and its connection noted in ``unread`` (the loop then forgets its students,
    ``service.py``); a reply to a connection that is gone is dropped as before.
    """

    frontend: zmq.Socket
    backend: zmq.Socket
    control: zmq.Socket
    pub: zmq.Socket
    unread: dict[tuple[str, bytes], int] = field(default_factory=dict)
    """(socket name, identity) -> replies dropped since the loop last looked: peers that do not read."""

    def all(self) -> tuple[zmq.Socket, ...]:
        return self.frontend, self.backend, self.control, self.pub

    def to_student(self, identity: bytes, command: Command, body: dict[str, Any]) -> None:
        self.reply(self.frontend, identity, protocol.encode(command, body))

    def to_worker(self, identity: bytes, command: Command, body: dict[str, Any]) -> None:
        protocol.send(self.backend, command, body, identity=identity)

    def to_leader(self, identity: bytes, command: Command, body: dict[str, Any]) -> None:
        self.reply(self.control, identity, protocol.encode(command, body))

    def reply(self, sock: zmq.Socket, identity: bytes, frames: list[bytes]) -> None:
        """Send ``frames`` (made by ``protocol.encode``) to a student or leader, or drop them
        when its connection does not read (see the class docstring)."""
        try:
            protocol.send_frames(sock, frames, identity=identity)
        except zmq.Again:
            key = ("frontend" if sock is self.frontend else "control", identity)
            self.unread[key] = self.unread.get(key, 0) + 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:  # gone: nobody to answer
                raise

    def publish(self, command: Command, body: dict[str, Any], topic: bytes) -> None:
        protocol.send(self.pub, command, body, topic=topic)


class BrokerState:
    """Tables, counters and sockets of one broker instance (see the module docstring)."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.runs = RunTable(config)
        self.students = StudentTable(config)
        self.workers = WorkerTable(config)
        self.ledger = RequestLedger()
        self.clock = BatchClock(config)
        self.echo = EchoBudget(2 * config.max_queued_per_student)
        self.counters = BrokerStats()
        self.completed_rate = RateMeter()
        self.requested_rate = RateMeter()
        self.started_at = time.monotonic()
        self.instance_id = f"broker-{uuid.uuid4().hex[:12]}"  # changes on restart
        # Our answer to every heartbeat; peers that beat slower than we expect speed up.
        self.beat_body = {"peer_id": self.instance_id, "role": "broker",
                          "interval_ms": max(1, round(config.heartbeat_interval_s * 1000))}
        self.next_work_id = 1
        self.sockets: Sockets | None = None
        self.lock = threading.Lock()

    @property
    def send(self) -> Sockets:
        assert self.sockets is not None, "the broker sends only while it serves"
        return self.sockets

    def busy_runs(self) -> set[str]:
        """Runs with a student connected or a WORK in flight (never forgotten for room)."""
        busy = {s.run_id for s in self.students.peers.values()}
        busy.update(w.run_id for p in self.workers.peers.values() for w in p.in_flight.values())
        return busy

    def forget_abandoned_runs(self, now: float) -> list[str]:
        """Forget the runs that have had no live peer for the grace period (``runs.py``)."""
        return self.runs.forget_abandoned(now, self.busy_runs())

    def snapshot(self, top_runs: int | None = None) -> BrokerStats:
        """The counters now; ``per_run`` of every run, or of the ``top_runs`` busiest (most
        queued, then most completed: what STATS answers, ``report.py``)."""
        c = self.counters
        runs = self.runs.runs.values()
        if top_runs is not None and len(runs) > top_runs:
            runs = heapq.nlargest(top_runs, runs, key=lambda r: (r.queued, r.completed))
        per_run = {r.run_id: run_entry(r) for r in runs}
        in_flight = sum(w.num_slots for p in self.workers.peers.values() for w in p.in_flight.values())
        return BrokerStats(
            queued=self.runs.queued, in_flight=in_flight,
            requested=c.requested, dispatched=c.dispatched, completed=c.completed, notified=c.notified,
            direct=c.direct, discarded=c.discarded, requeued=c.requeued, quarantined=c.quarantined,
            released=c.released, failed=c.failed, refused=c.refused, bad_messages=c.bad_messages,
            foreign=c.foreign, overdue=c.overdue, errors=c.errors, throttled=c.throttled,
            dropped_replies=c.dropped_replies,
            workers=len(self.workers), students=len(self.students), runs=len(self.runs),
            completed_per_s=self.completed_rate.rate(), requested_per_s=self.requested_rate.rate(),
            uptime_s=time.monotonic() - self.started_at, per_run=per_run,
        )


def run_entry(run: RunState) -> dict[str, Any]:
    """What STATS says of one run (its entry in ``per_run``)."""
    return {"generation": run.generation, "model_id": run.model_id, "queued": run.queued,
            "completed": run.completed, "discarded": run.discarded, "abandoned": run.abandoned}
