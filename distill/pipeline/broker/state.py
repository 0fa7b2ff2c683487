"""Everything one broker knows, in one object its parts share (no part owns a copy).

The tables (runs, students, workers), the request ledger, the batch clock and the
counters live here; the handlers (``frontend``, ``backend``, ``control``) and the
dispatcher change them, and only :class:`Sockets` sends. Nothing in here is touched
by two threads at once: the broker's loop holds ``lock`` while it works, and
``Broker.stats`` takes it to read a snapshot.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from distill.pipeline import protocol
from distill.pipeline.broker.config import BrokerConfig
from distill.pipeline.broker.deadline import BatchClock
from distill.pipeline.broker.limits import EchoBudget
from distill.pipeline.broker.records import StudentTable, WorkerTable
from distill.pipeline.broker.runs import RequestLedger, RunTable
from distill.pipeline.protocol import Command
from distill.pipeline.stats import BrokerStats, RateMeter


@dataclass(slots=True)
class Sockets:
    """The broker's four sockets, once bound; every message the broker sends goes here."""

    frontend: zmq.Socket
    backend: zmq.Socket
    control: zmq.Socket
    pub: zmq.Socket

    def all(self) -> tuple[zmq.Socket, ...]:
        return self.frontend, self.backend, self.control, self.pub

    def to_student(self, identity: bytes, command: Command, body: dict[str, Any]) -> None:
        protocol.send(self.frontend, command, body, identity=identity)

    def to_worker(self, identity: bytes, command: Command, body: dict[str, Any]) -> None:
        protocol.send(self.backend, command, body, identity=identity)

    def to_leader(self, identity: bytes, command: Command, body: dict[str, Any]) -> None:
        protocol.send(self.control, command, body, identity=identity)

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

    def snapshot(self) -> BrokerStats:
        c = self.counters
        runs = self.runs.runs.values()
        per_run = {r.run_id: {"generation": r.generation, "model_id": r.model_id, "queued": r.queued,
                              "completed": r.completed, "discarded": r.discarded} for r in runs}
        in_flight = sum(w.num_slots for p in self.workers.peers.values() for w in p.in_flight.values())
        return BrokerStats(
            queued=self.runs.queued, in_flight=in_flight,
            requested=c.requested, dispatched=c.dispatched, completed=c.completed, notified=c.notified,
            direct=c.direct, discarded=c.discarded, requeued=c.requeued, quarantined=c.quarantined,
            released=c.released, failed=c.failed, refused=c.refused, bad_messages=c.bad_messages,
            foreign=c.foreign, overdue=c.overdue, errors=c.errors, throttled=c.throttled,
            workers=len(self.workers), students=len(self.students), runs=len(self.runs),
            completed_per_s=self.completed_rate.rate(), requested_per_s=self.requested_rate.rate(),
            uptime_s=time.monotonic() - self.started_at, per_run=per_run,
        )
