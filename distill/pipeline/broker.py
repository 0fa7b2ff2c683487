"""The broker: routes slot addresses from students to workers, and completions back.

Shape of the ZeroMQ guide's Majordomo broker: one poll loop whose timeout is the
heartbeat interval; each message goes to one ``_on_<command>`` handler; then dead
peers are purged. The broker never touches sample data.

State per run (``RunState``): model, generation, a FIFO of requested slots. A
request carries no generation of its own beyond "at least this one": the broker
stamps the run's *current* generation when it hands the slot to a worker, and
completes a slot only if that generation is still current; otherwise the student
is told DISCARDED and asks again. So a switch never strands a slot, and nothing of
an older generation is ever completed after ``SET_MODEL`` was answered.

Workers get credit-based flow control: READY says how many slots a worker can hold
(absolute), each WORK spends credit, each DONE returns it. WORKs hold slots of one
run (one model), up to the worker's ``max_batch``; runs are served round robin.

A worker that misses its heartbeats may be frozen rather than dead (SIGSTOP, a
swapped-out host) and resume writing later, so its in-flight slots are never
handed to another worker: the students are told QUARANTINE (with the worker's
process token) and re-issue those request ids in other slots; the broker sends
RELEASE when the worker's late DONE shows it has finished with them, and a student
frees them itself once the worker process is gone. A worker that says BYE has
finished writing, so its unstarted work is simply re-queued.

Only the leader switches a run's model: SET_MODEL carries the leader's epoch, and
one older than the newest the run has seen (a stale leader) is refused.

Fan-out (opt-in per run, ``SET_MODEL.share_model``): runs with the same model
(equal ``model_id`` and ``model_cfg``) that all opted in are served together. One
WORK takes up to ``max_batch`` queued slots of *each* such run, and the j-th slot of
every run gets the same sample (WORK.copies), so the teacher computes each sample
once for all of them: a sweep of N student configs on one layer costs about one
teacher pass, not N, and its jobs train on the same samples (a paired comparison).
A run with fewer queued slots simply gets fewer copies: nobody waits for a partner.
Such a WORK is kept as one part per run, each with its own generation, so a switch
in one run discards only that run's part. A shared WORK spends one credit per
sample computed (not per slot written): credit is the worker's teacher work.

Slots travel through the broker in the groups they arrived in (a ``SlotRequests``
per REQUEST, split only where a WORK ends), so the per-slot work of the broker is
building the WORK and COMPLETE lists, nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import CurveConfig, ServerKeys, start_authenticator
from distill.pipeline.endpoints import default_endpoint, prepare_endpoint
from distill.pipeline.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS
from distill.pipeline.protocol import Command, Message, ProtocolError
from distill.pipeline.slot import HEADER_BYTES
from distill.pipeline.stats import BrokerStats, RateMeter
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

DEFAULT_RUN = "default"
MAX_QUEUED_PER_RUN = 1_000_000
MAX_PURGED_REMEMBERED = 10_000
RECENTLY_SETTLED = 16_384
"""Slot requests remembered after they were answered, so that a repeat still on its way
(sent again by a student that saw us restart) is not filled a second time."""
MAX_ZOMBIE_WORKS = 10_000
"""In-flight works of purged workers remembered for their late DONE; beyond this the
oldest are forgotten (their students still free the slots when the process dies)."""
# Bounds on what peers can make the broker hold (back-pressure: the excess is refused
# with an ERROR that names the limit). Each is a keyword of Broker and a field of
# PipelineConfig; the defaults leave room for large jobs and cap memory at a few
# hundred MiB whatever peers send.
MAX_QUEUED = 1_000_000
"""Slots queued over all runs (a queued slot costs about 150 bytes)."""
MAX_QUEUED_PER_STUDENT = 8_192
"""Slots one student connection may have queued. A consumer process never needs more
than it owns (pipeline.slot_count); keep it below protocol.BROKER_SNDHWM."""
MAX_STUDENTS = 16_384
"""Student peers: every rank's client and every DataLoader worker is one."""
MAX_WORKERS = 4_096
MAX_RUNS = 1_024
MAX_DIRECT_RUNS = 64
MAX_DIRECT_PER_REPORT = 1 << 32
"""Runs of one worker's DIRECT fill report the broker reads (a worker serves a few)."""
"""Runs (the jobs of a sweep). Runs with no model, queue or student are forgotten
to make room for new ones; runs with a model are kept."""


@dataclass(slots=True)
class SlotRequests:
    """Slots of one medium that a student wants filled (one REQUEST, or part of one)."""

    student: bytes
    run_id: str
    medium: str
    stride: int
    slots: list[list[int]]
    """[[slot_idx, request_id], ...], as on the wire."""


@dataclass
class Work:
    work_id: int
    worker: bytes
    run_id: str
    generation: int
    requests: list[SlotRequests]
    num_slots: int
    parts: list[Work] = field(default_factory=list)
    """Fan-out: one part per run (each with its run's generation); empty for a one-run WORK."""
    credit: int | None = None
    """Credit spent, when not ``num_slots`` (a fan-out WORK spends one per sample computed)."""


@dataclass
class WorkerPeer:
    identity: bytes
    peer_id: str
    credit: int
    max_batch: int
    last_seen: float
    in_flight: dict[int, Work] = field(default_factory=dict)
    process: str | None = None
    """The worker's process token (``liveness.process_token``), passed on in QUARANTINE."""
    direct: dict[str, tuple[int, int]] = field(default_factory=dict)
    """run -> (filled, failed) DIRECT slots the worker reported so far (see _count_direct)."""


@dataclass
class StudentPeer:
    identity: bytes
    peer_id: str
    run_id: str
    last_seen: float


@dataclass
class RunState:
    run_id: str
    generation: int = 0
    model_id: str | None = None
    model_cfg: dict | None = None
    queue: deque[SlotRequests] = field(default_factory=deque)
    queued: int = 0
    """Slots in ``queue``."""
    completed: int = 0
    discarded: int = 0
    leader_epoch: int = 0
    leader_id: str | None = None
    share_model: bool = False
    """Fan-out opt-in: its slots may get samples computed for other runs of the same model."""


class Broker:
    """Routes REQUESTs to workers and DONEs back to students (see module docstring)."""

    def __init__(self, frontend_endpoint: str | None = None, backend_endpoint: str | None = None,
                 control_endpoint: str | None = None, control_pub_endpoint: str | None = None, *,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_liveness: int = HEARTBEAT_LIVENESS,
                 max_queued_per_run: int = MAX_QUEUED_PER_RUN, max_queued: int = MAX_QUEUED,
                 max_queued_per_student: int = MAX_QUEUED_PER_STUDENT, max_students: int = MAX_STUDENTS,
                 max_workers: int = MAX_WORKERS, max_runs: int = MAX_RUNS,
                 curve: CurveConfig | None = None) -> None:
        self.frontend_endpoint = frontend_endpoint or default_endpoint("frontend")
        self.backend_endpoint = backend_endpoint or default_endpoint("backend")
        self.control_endpoint = control_endpoint or default_endpoint("control")
        self.control_pub_endpoint = control_pub_endpoint or default_endpoint("control_pub")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.max_queued_per_run = max_queued_per_run
        self.max_queued, self.max_queued_per_student = max_queued, max_queued_per_student
        self.max_students, self.max_workers, self.max_runs = max_students, max_workers, max_runs
        _check_limits(self)
        self._queued_by_student: dict[bytes, int] = {}  # student identity -> slots in run queues
        self._refusals = LogThrottle(log)
        # Read (and checked) now, so a bad key fails in the caller, not in the thread.
        self._keys: ServerKeys | None = curve.server_keys() if curve is not None else None
        self._runs: dict[str, RunState] = {}
        self._workers: dict[str, WorkerPeer] = {}  # by peer_id
        self._students: dict[str, StudentPeer] = {}  # by peer_id
        self._purged_students: dict[str, None] = {}  # insertion-ordered set, bounded
        self._zombie_works: dict[tuple[str, int], Work] = {}  # (worker peer_id, work_id), bounded
        self._outstanding: set[tuple[str, int, int]] = set()
        """(medium, slot, request id) queued or in flight: a REQUEST that repeats one (a
        student re-asking after our restart, its earlier REQUEST still on the way) is
        dropped, so no slot is ever dispatched twice. Bounded by the queue and credit."""
        self._recent: deque[tuple[str, int, int]] = deque()
        self._recent_set: set[tuple[str, int, int]] = set()  # the last RECENTLY_SETTLED of them
        self.instance_id = f"broker-{uuid.uuid4().hex[:12]}"  # changes on restart
        # Our answer to every heartbeat; peers that beat slower than we expect speed up.
        self._beat_body = {"peer_id": self.instance_id, "role": "broker",
                           "interval_ms": max(1, round(heartbeat_interval_s * 1000))}
        self._next_work_id = 1
        self._rr_runs: deque[str] = deque()
        self._counters = BrokerStats()
        self._completed_rate = RateMeter()
        self._requested_rate = RateMeter()
        self._started_at = time.monotonic()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # guards stats snapshots taken from other threads

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        """Serve until :meth:`stop` (blocking)."""
        ctx = zmq.Context()
        authenticator = start_authenticator(ctx, self._keys) if self._keys is not None else None
        try:
            socks = self._bind(ctx)
        except BaseException:
            self._close_context(ctx, authenticator)
            raise
        self._ready.set()
        log.info("broker serving: frontend=%s backend=%s%s", self.frontend_endpoint, self.backend_endpoint,
                 " (CurveZMQ: allowed clients only)" if authenticator is not None else "")
        try:
            self._loop(*socks)
        finally:
            for sock in socks:
                sock.close(linger=0)
            self._close_context(ctx, authenticator)
            log.info("broker stopped")

    @staticmethod
    def _close_context(ctx: zmq.Context, authenticator: Any) -> None:
        """Stop the ZAP handler (its socket lives in ``ctx``) before terminating ``ctx``."""
        if authenticator is not None:
            authenticator.stop()
        ctx.term()

    def start(self) -> Broker:
        """Serve from a background thread; returns once the sockets are bound."""
        self._thread = threading.Thread(target=self._run_guarded, name="broker", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    @property
    def stats(self) -> BrokerStats:
        with self._lock:
            return self._snapshot()

    def _run_guarded(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
            log.exception("broker failed")

    def _bind(self, ctx: zmq.Context) -> tuple[zmq.Socket, ...]:
        socks = []
        for kind, endpoint in ((zmq.ROUTER, self.frontend_endpoint), (zmq.ROUTER, self.backend_endpoint),
                               (zmq.ROUTER, self.control_endpoint), (zmq.PUB, self.control_pub_endpoint)):
            prepare_endpoint(endpoint)
            sock = protocol.configure(ctx.socket(kind), hwm=protocol.BROKER_SNDHWM,
                                      rcvhwm=protocol.BROKER_RCVHWM)
            try:
                prepare_endpoint(endpoint)
                if self._keys is not None:
                    self._keys.apply(sock)
                sock.bind(endpoint)
            except (zmq.ZMQError, OSError) as exc:
                for s in socks + [sock]:
                    s.close(linger=0)
                if isinstance(exc, zmq.ZMQError):
                    raise OSError(f"broker cannot bind {endpoint}: {exc}; is another broker running?") from exc
                raise
            socks.append(sock)
        self._warn_if_open()
        return tuple(socks)

    def _warn_if_open(self) -> None:
        tcp = [ep for ep in (self.frontend_endpoint, self.backend_endpoint, self.control_endpoint,
                             self.control_pub_endpoint) if ep.startswith("tcp://")]
        if tcp and self._keys is None:
            log.warning("%s take anyone who can reach them: turn on CurveZMQ authentication "
                        "(Broker(curve=...), pipeline.auth_keys_dir) on networks you do not trust",
                        ", ".join(tcp))

    # ------------------------------------------------------------------ loop
    def _loop(self, frontend: zmq.Socket, backend: zmq.Socket, control: zmq.Socket,
              pub: zmq.Socket) -> None:
        self._frontend, self._backend, self._control, self._pub = frontend, backend, control, pub
        self._handler_table = self._handlers()
        poller = zmq.Poller()
        for sock in (frontend, backend, control):
            poller.register(sock, zmq.POLLIN)
        timeout_ms = self.heartbeat_interval_s * 1000
        next_purge = time.monotonic() + self.heartbeat_interval_s
        while not self._stop.is_set():
            events = dict(poller.poll(timeout_ms))
            with self._lock:
                for sock in (control, backend, frontend):  # control first: switches win
                    if sock in events:
                        self._drain(sock)
                self._dispatch()
                if time.monotonic() >= next_purge:
                    self._purge()
                    next_purge = time.monotonic() + self.heartbeat_interval_s

    def _drain(self, sock: zmq.Socket, max_messages: int = 1000) -> None:
        for _ in range(max_messages):
            identity, msg = protocol.recv_routed(sock)
            self._route(sock, identity, msg)
            if not protocol.readable(sock):
                return

    def _route(self, sock: zmq.Socket, identity: bytes, msg: Message | ProtocolError) -> None:
        if isinstance(msg, ProtocolError):
            self._refuse(sock, identity, msg.reason)
            return
        handler = self._handler_table.get((id(sock), msg.command))
        if handler is None:
            self._refuse(sock, identity, f"command {msg.command.name} not accepted on this socket",
                         msg.command)
            return
        try:
            handler(identity, msg.body)
        except ProtocolError as exc:
            self._refuse(sock, identity, exc.reason, msg.command, getattr(exc, "slots", None))

    def _handlers(self) -> dict[tuple[int, Command], Any]:
        f, b, c = id(self._frontend), id(self._backend), id(self._control)
        return {
            (f, Command.HELLO): self._on_hello,
            (f, Command.REQUEST): self._on_request,
            (f, Command.HEARTBEAT): self._on_student_heartbeat,
            (f, Command.STATS): lambda ident, body: self._on_stats(self._frontend, ident, body),
            (f, Command.BYE): self._on_student_bye,
            (b, Command.READY): self._on_ready,
            (b, Command.DONE): self._on_done,
            (b, Command.HEARTBEAT): self._on_worker_heartbeat,
            (b, Command.BYE): self._on_worker_bye,
            (b, Command.ERROR): self._on_worker_error,
            (c, Command.SET_MODEL): self._on_set_model,
            (c, Command.STOP): self._on_stop,
            (c, Command.STATS): lambda ident, body: self._on_stats(self._control, ident, body),
        }

    def _refuse(self, sock: zmq.Socket, identity: bytes, reason: str,
                command: Command | None = None, slots: list | None = None) -> None:
        self._counters.bad_messages += 1
        self._refusals.warning("refused message from %r: %s", identity[:16], reason)
        body: dict[str, Any] = {"reason": reason[:protocol.MAX_STRING_CHARS]}
        if command is not None:
            body["command"] = command.name
        if slots:  # a well-formed REQUEST over a limit: the student asks again later
            body["slots"] = slots
        protocol.send(sock, Command.ERROR, body, identity=identity)

    # ------------------------------------------------------------------ students
    def _run(self, run_id: str) -> RunState:
        run = self._runs.get(run_id)
        if run is None:
            self._make_room_for_run(run_id)
            run = self._runs[run_id] = RunState(run_id)
            self._rr_runs.append(run_id)
        return run

    def _touch_student(self, identity: bytes, peer_id: str, run_id: str) -> StudentPeer:
        peer = self._students.get(peer_id)
        if peer is None:
            if len(self._students) >= self.max_students:
                raise _over_limit(f"{len(self._students)} students connected", "max_students")
            peer = self._students[peer_id] = StudentPeer(identity, peer_id, run_id, time.monotonic())
        elif peer.run_id != run_id:
            raise ProtocolError(f"student {peer_id} belongs to run {peer.run_id}, not {run_id}: "
                                "use one peer id per run")
        elif peer.identity != identity:
            self._drop_student_requests(peer)  # answers could not reach its old connection
        peer.identity, peer.last_seen = identity, time.monotonic()
        return peer

    def _on_hello(self, identity: bytes, body: dict) -> None:
        run = self._run(body["run_id"])
        self._touch_student(identity, body["peer_id"], run.run_id)
        protocol.send(self._frontend, Command.WELCOME, {
            "run_id": run.run_id, "generation": run.generation, "model_id": run.model_id,
            "model_cfg": run.model_cfg, "heartbeat_interval_ms": int(self.heartbeat_interval_s * 1000),
        }, identity=identity)

    def _on_request(self, identity: bytes, body: dict) -> None:
        run = self._run(body["run_id"])
        self._touch_student(identity, body["peer_id"], run.run_id)
        stride, slots = body["stride"], body["slots"]
        if stride <= HEADER_BYTES:
            raise ProtocolError(f"REQUEST.stride {stride} leaves no room after the {HEADER_BYTES}-byte header")
        refused, slots = self._over_room(identity, run, slots)
        slots = self._new_requests(body["medium"], slots)
        if slots:
            run.queue.append(SlotRequests(identity, run.run_id, body["medium"], stride, slots))
            run.queued += len(slots)
            self._count_queued((run.queue[-1],), +1)
        self._counters.requested += len(slots)
        self._requested_rate.add(len(slots))
        if refused is not None:
            raise refused

    def _new_requests(self, medium: str, slots: list[list[int]]) -> list[list[int]]:
        """The slots not already outstanding with the same request id; marks them outstanding."""
        out, recent = self._outstanding, self._recent_set
        keys = [(medium, slot, req) for slot, req in slots]
        if out.isdisjoint(keys) and recent.isdisjoint(keys):
            out.update(keys)
            return slots
        fresh = [s for s, key in zip(slots, keys, strict=True) if key not in out and key not in recent]
        log.info("dropped %d repeated request(s) for slots of %s", len(slots) - len(fresh), medium)
        out.update((medium, slot, req) for slot, req in fresh)
        return fresh

    def _settled(self, requests: Any, answered: bool = True) -> None:
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

    def _over_room(self, identity: bytes, run: RunState,
                   slots: list[list[int]]) -> tuple[ProtocolError | None, list[list[int]]]:
        """Split a REQUEST at the queue limits: the slots that fit are queued; the rest
        are refused, by name in the ERROR reply, so the student can ask again later."""
        try:
            self._check_queue_room(identity, len(slots))
            if run.queued + len(slots) > self.max_queued_per_run:
                raise _over_limit(f"run {run.run_id}: {run.queued} slots queued, {len(slots)} more asked",
                                  "max_queued_per_run")
        except ProtocolError as exc:
            room = max(0, min(self.max_queued_per_student - self._queued_by_student.get(identity, 0),
                              self.max_queued - sum(r.queued for r in self._runs.values()),
                              self.max_queued_per_run - run.queued))
            exc.slots = slots[room:]  # type: ignore[attr-defined]  # named in the ERROR reply
            self._counters.refused += len(slots) - room
            return exc, slots[:room]
        return None, slots

    def _on_student_heartbeat(self, identity: bytes, body: dict) -> None:
        peer = self._students.get(body["peer_id"])
        if peer is None and body["peer_id"] in self._purged_students:
            # We dropped its requests: it must ask again. (Unknown but never purged
            # means its first REQUEST is still on the way: nothing to do.)
            del self._purged_students[body["peer_id"]]
            protocol.send(self._frontend, Command.RECONNECT, {}, identity=identity)
            return
        if peer is not None:
            peer.last_seen = time.monotonic()
        protocol.send(self._frontend, Command.HEARTBEAT, self._beat_body,
                      identity=identity)

    def _on_student_bye(self, identity: bytes, body: dict) -> None:
        peer = self._students.pop(body["peer_id"], None)
        if peer is not None:
            self._drop_student_requests(peer)

    def _drop_student_requests(self, peer: StudentPeer) -> None:
        run = self._runs.get(peer.run_id)
        if run is not None:
            self._settled((r for r in run.queue if r.student == peer.identity), answered=False)
            run.queue = deque(r for r in run.queue if r.student != peer.identity)
            run.queued = sum(len(r.slots) for r in run.queue)
        self._queued_by_student.pop(peer.identity, None)

    def _on_stats(self, sock: zmq.Socket, identity: bytes, body: dict) -> None:
        protocol.send(sock, Command.STATS_REPLY, {"stats": self._snapshot().to_dict()}, identity=identity)

    # ------------------------------------------------------------------ control
    def _on_set_model(self, identity: bytes, body: dict) -> None:
        run = self._run(body["run_id"])
        self._check_leader(run, body["leader_epoch"], body["peer_id"])
        restore = body.get("restore_generation")
        floor = body.get("min_generation") or 0  # a switch: above every generation the leader knows
        _check_generation_room(run, max(restore or 0, floor))
        if restore is not None and restore >= run.generation:
            run.generation = restore  # a leader re-joining a restarted broker
        else:
            run.generation = max(run.generation + 1, floor)
        run.model_id, run.model_cfg = body["model_id"], body.get("model_cfg")
        run.share_model = bool(body.get("share_model"))
        log.info("run %s: model %s, generation %d", run.run_id, run.model_id, run.generation)
        model = {"run_id": run.run_id, "generation": run.generation, "model_id": run.model_id,
                 "model_cfg": run.model_cfg}
        protocol.send(self._pub, Command.MODEL, model, topic=run.run_id.encode())
        protocol.send(self._control, Command.MODEL_SET, {
            "run_id": run.run_id, "generation": run.generation, "model_id": run.model_id,
        }, identity=identity)

    def _check_leader(self, run: RunState, epoch: int, peer_id: str) -> None:
        """Accept the newest leader; refuse an older one, or a second one of the same epoch."""
        if epoch < run.leader_epoch or (epoch == run.leader_epoch and peer_id != run.leader_id):
            self._counters.refused += 1
            raise ProtocolError(f"run {run.run_id}: {peer_id} (epoch {epoch}) is not the leader; "
                                f"{run.leader_id} (epoch {run.leader_epoch}) is")
        if peer_id != run.leader_id and run.leader_id is not None:
            log.info("run %s: leader %s (epoch %d) replaces %s (epoch %d)", run.run_id, peer_id,
                        epoch, run.leader_id, run.leader_epoch)
        run.leader_epoch, run.leader_id = epoch, peer_id

    def _on_stop(self, identity: bytes, body: dict) -> None:
        """Publish STOP to the workers (of one run, or all); answered with the stats."""
        run_id = body.get("run_id")
        log.info("stop requested for %s", run_id or "all workers")
        protocol.send(self._pub, Command.STOP, {"run_id": run_id}, topic=(run_id or "").encode())
        protocol.send(self._control, Command.STATS_REPLY, {"stats": self._snapshot().to_dict()},
                      identity=identity)

    # ------------------------------------------------------------------ workers
    def _on_ready(self, identity: bytes, body: dict) -> None:
        peer = self._workers.get(body["peer_id"])
        if peer is None:
            if len(self._workers) >= self.max_workers:
                raise _over_limit(f"{len(self._workers)} workers connected", "max_workers")
            peer = self._workers[body["peer_id"]] = WorkerPeer(
                identity, body["peer_id"], 0, 1, time.monotonic())
            log.info("worker %s joined (credit %d)", peer.peer_id, body["credit"])
        peer.identity, peer.last_seen = identity, time.monotonic()
        peer.process = body.get("process")
        peer.direct = _direct_counts(body.get("direct"))  # the baseline: fills before we knew it
        peer.credit = body["credit"]
        peer.max_batch = max(1, body["max_batch"])

    def _on_worker_heartbeat(self, identity: bytes, body: dict) -> None:
        peer = self._workers.get(body["peer_id"])
        if peer is None:
            protocol.send(self._backend, Command.RECONNECT, {}, identity=identity)
            return
        peer.last_seen = time.monotonic()
        if body.get("direct"):
            self._count_direct(peer, _direct_counts(body["direct"]))
        protocol.send(self._backend, Command.HEARTBEAT, self._beat_body,
                      identity=identity)

    def _on_worker_bye(self, identity: bytes, body: dict) -> None:
        peer = self._workers.pop(body["peer_id"], None)
        if peer is not None:
            log.info("worker %s left", peer.peer_id)
            self._requeue(peer)

    def _on_worker_error(self, identity: bytes, body: dict) -> None:
        log.warning("worker %r refused a message: %s", identity[:32], body["reason"])

    def _on_done(self, identity: bytes, body: dict) -> None:
        zombie = self._zombie_works.pop((body["peer_id"], body["work_id"]), None)
        if zombie is not None:  # late: its slots went to no one, and now they are safe
            self._release(zombie)
            return
        peer = self._workers.get(body["peer_id"])
        if peer is None:
            return  # a worker we declared dead: its slots were re-queued already
        peer.last_seen = time.monotonic()
        work = peer.in_flight.pop(body["work_id"], None)
        if work is None:
            peer.credit += body["num_items"]  # work from before a broker restart
            return
        peer.credit += work.num_slots if work.credit is None else work.credit
        failed = {idx: reason for idx, reason in body["failed"] if 0 <= idx < work.num_slots}
        self._complete_parts(work, failed, frozenset(body.get("notified") or ()))

    def _count_direct(self, peer: WorkerPeer, counts: dict[str, tuple[int, int]]) -> None:
        """Add the slots a worker filled for DIRECT requests since its last report to the
        statistics (completed, failed, per run) as if this broker had dispatched them."""
        for run_id, (filled, failed) in counts.items():
            seen_filled, seen_failed = peer.direct.get(run_id, (0, 0))
            # Clamped: a report is untrusted input, and the counters must stay encodable.
            new_filled = min(max(0, filled - seen_filled), MAX_DIRECT_PER_REPORT)
            new_failed = min(max(0, failed - seen_failed), MAX_DIRECT_PER_REPORT)
            if not new_filled and not new_failed:
                continue
            self._counters.completed += new_filled
            self._counters.direct += new_filled
            self._counters.failed += new_failed
            run = self._runs.get(run_id)
            if run is not None:
                run.completed += new_filled + new_failed
            self._completed_rate.add(new_filled + new_failed)
        peer.direct = counts

    def _complete(self, work: Work, failed: dict[int, str], notified: frozenset[str] = frozenset()) -> None:
        """Answer a finished WORK: COMPLETE (filled or failed) or DISCARDED (stale) to
        each student; filled slots of ``notified`` segments were announced by the worker
        itself (``notices.py``) and are only counted."""
        self._settled(work.requests)
        run = self._runs.get(work.run_id)
        stale = run is None or work.generation != run.generation
        by_student: dict[bytes, list[list]] = {}
        discarded: dict[bytes, list[list[int]]] = {}
        num_notified = 0
        if not stale and not failed:  # the common case: every slot filled
            for request in work.requests:
                if request.medium in notified:
                    num_notified += len(request.slots)
                    continue
                by_student.setdefault(request.student, []).extend(
                    [slot_idx, request_id, True] for slot_idx, request_id in request.slots)
        else:
            self._sort_outcomes(work, stale, failed, by_student, discarded)
            if notified and not stale:
                num_notified = _drop_notified(work, notified, by_student)
        num_failed = sum(not ok for rows in by_student.values() for *_, ok in rows) if failed else 0
        num_rows = sum(len(v) for v in by_student.values()) + num_notified
        num_discarded = sum(len(v) for v in discarded.values())
        self._counters.completed += num_rows - num_failed
        self._counters.notified += num_notified
        self._counters.failed += num_failed
        self._counters.discarded += num_discarded
        if run is not None:
            run.completed += num_rows
            run.discarded += num_discarded
        self._completed_rate.add(num_rows)
        for student, rows in by_student.items():
            if rows:
                protocol.send(self._frontend, Command.COMPLETE, {"generation": work.generation, "slots": rows},
                              identity=student)
        for student, rows in discarded.items():
            protocol.send(self._frontend, Command.DISCARDED,
                          {"generation": run.generation if run else 0, "slots": rows}, identity=student)

    @staticmethod
    def _sort_outcomes(work: Work, stale: bool, failed: dict[int, str], by_student: dict[bytes, list[list]],
                       discarded: dict[bytes, list[list[int]]]) -> None:
        """Slot by slot: completed (ok or failed) or discarded (stale)."""
        idx = 0
        for request in work.requests:
            for slot_idx, request_id in request.slots:
                if stale or failed.get(idx) == "stale":
                    discarded.setdefault(request.student, []).append([slot_idx, request_id])
                else:
                    ok = idx not in failed
                    if not ok:
                        log.warning("worker failed slot %d of %s: %s", slot_idx, request.medium, failed[idx])
                    by_student.setdefault(request.student, []).append([slot_idx, request_id, ok])
                idx += 1

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self) -> None:
        """Hand queued slots to workers with credit: one WORK per run in turn, to the
        worker with the most credit, until a whole turn serves no run. The turn goes on
        from where the last one stopped, so runs with equal demand get equal shares
        (a full rotation per call would let the first run take every freed credit)."""
        idle = 0
        while self._workers and idle < len(self._rr_runs):
            worker = max(self._workers.values(), key=lambda w: w.credit)
            if worker.credit <= 0:
                return
            run = self._runs[self._rr_runs[0]]
            self._rr_runs.rotate(-1)
            if run.model_id is None or not run.queue or not self._send_next(worker, run):
                idle += 1
                continue
            idle = 0

    def _send_work(self, worker: WorkerPeer, run: RunState, count: int) -> None:
        """A plain WORK (one run). A run opted in to fan-out is marked ``shared``, so its
        slots keep coming through us (no direct requests) and can be shared later."""
        requests = self._take(run, count)
        self._count_queued(requests, -1)
        num_slots = sum(len(r.slots) for r in requests)
        work = Work(self._next_work_id, worker.identity, run.run_id, run.generation, requests, num_slots)
        self._next_work_id += 1
        worker.in_flight[work.work_id] = work
        worker.credit -= num_slots
        self._counters.dispatched += num_slots
        body = {
            "work_id": work.work_id, "run_id": run.run_id, "generation": run.generation,
            "model_id": run.model_id, "model_cfg": run.model_cfg,
            "items": [[r.medium, slot_idx, r.stride, request_id]
                      for r in requests for slot_idx, request_id in r.slots],
        }
        if run.share_model:
            body["shared"] = True
        protocol.send(self._backend, Command.WORK, body, identity=worker.identity)

    def _send_next(self, worker: WorkerPeer, run: RunState) -> bool:
        """One WORK for ``worker``: ``run`` alone, or with the runs it shares its model
        with. False when the slots wait for a partner run (see ``_waits``)."""
        partners = self._partners(run) if run.share_model else []
        if run.share_model and self._waits(worker, run):
            return False
        if partners:
            self._send_shared_work(worker, [run, *partners], min(worker.credit, worker.max_batch))
        else:
            self._send_work(worker, run, min(worker.credit, worker.max_batch))
        return True

    def _waits(self, worker: WorkerPeer, run: RunState) -> bool:
        """Hold a sharing run's slots while the worker is busy anyway and another live
        run of its model has no slots queued yet (its student is re-requesting): sent
        now, they would be computed for this run alone. An idle worker never waits."""
        if not worker.in_flight:
            return False
        waiting_for = {other.run_id for other in self._runs.values()
                       if other is not run and other.share_model and not other.queue
                       and other.model_id == run.model_id and other.model_cfg == run.model_cfg}
        return bool(waiting_for & {student.run_id for student in self._students.values()})

    def _partners(self, run: RunState) -> list[RunState]:
        """Other opted-in runs with queued slots and exactly ``run``'s model."""
        return [other for other in self._runs.values()
                if other is not run and other.share_model and other.queue
                and other.model_id == run.model_id and other.model_cfg == run.model_cfg]

    def _send_shared_work(self, worker: WorkerPeer, runs: list[RunState], samples: int) -> None:
        """A fan-out WORK: up to ``samples`` slots of each run; slot j of every run gets
        sample j, computed once for the first run that has a j-th slot."""
        parts = []
        for run in runs:
            requests = self._take(run, samples)
            parts.append(Work(0, worker.identity, run.run_id, run.generation, requests,
                              sum(len(r.slots) for r in requests)))
        items, groups, copies, source_of = [], [], [], {}
        for part, run in zip(parts, runs, strict=True):
            groups.append([run.run_id, run.generation, part.num_slots])
            for j, (request, slot_idx, request_id) in enumerate(_slots(part.requests)):
                if j in source_of:
                    copies.append([len(items), source_of[j]])
                else:
                    source_of[j] = len(items)
                items.append([request.medium, slot_idx, request.stride, request_id])
        work = Work(self._next_work_id, worker.identity, runs[0].run_id, runs[0].generation,
                    [r for part in parts for r in part.requests], len(items), parts, len(source_of))
        self._next_work_id += 1
        worker.in_flight[work.work_id] = work
        worker.credit -= len(source_of)
        self._counters.dispatched += len(items)
        protocol.send(self._backend, Command.WORK, {
            "work_id": work.work_id, "run_id": work.run_id, "generation": work.generation,
            "model_id": runs[0].model_id, "model_cfg": runs[0].model_cfg, "items": items,
            "runs": groups, "copies": copies,
        }, identity=worker.identity)

    def _complete_parts(self, work: Work, failed: dict[int, str], notified: frozenset[str]) -> None:
        """Complete a WORK, each run's part against its own run's generation."""
        if not work.parts:
            self._complete(work, failed, notified)
            return
        start = 0
        for part in work.parts:
            end = start + part.num_slots
            self._complete(part, {idx - start: why for idx, why in failed.items() if start <= idx < end},
                           notified)
            start = end

    @staticmethod
    def _take(run: RunState, count: int) -> list[SlotRequests]:
        """Up to ``count`` queued slots, oldest first (the last group split if needed)."""
        taken: list[SlotRequests] = []
        left = count
        while left > 0 and run.queue:
            head = run.queue[0]
            if len(head.slots) <= left:
                taken.append(run.queue.popleft())
            else:
                taken.append(SlotRequests(head.student, head.run_id, head.medium, head.stride,
                                          head.slots[:left]))
                del head.slots[:left]
            left -= len(taken[-1].slots)
        run.queued -= count - left
        return taken

    # ------------------------------------------------------------------ limits
    def _check_queue_room(self, identity: bytes, count: int) -> None:
        """Refuse ``count`` more slots from one student connection past the caps."""
        queued = self._queued_by_student.get(identity, 0)
        if queued + count > self.max_queued_per_student:
            raise _over_limit(f"{queued} slots of this student queued, {count} more asked",
                              "max_queued_per_student")
        total = sum(r.queued for r in self._runs.values())
        if total + count > self.max_queued:
            raise _over_limit(f"{total} slots queued, {count} more asked", "max_queued")

    def _count_queued(self, requests: Any, sign: int) -> None:
        """Keep ``_queued_by_student`` in step with the run queues (+1: queued, -1: left)."""
        counts = self._queued_by_student
        for request in requests:
            left = counts.get(request.student, 0) + sign * len(request.slots)
            if left > 0:
                counts[request.student] = left
            else:
                counts.pop(request.student, None)

    def _make_room_for_run(self, run_id: str) -> None:
        """At ``max_runs``, forget an idle run (no model, queue, student or work) or refuse."""
        if len(self._runs) < self.max_runs:
            return
        busy = {s.run_id for s in self._students.values()}
        busy.update(w.run_id for p in self._workers.values() for w in p.in_flight.values())
        idle = next((r.run_id for r in self._runs.values()
                     if r.model_id is None and not r.queue and r.run_id not in busy), None)
        if idle is None:
            raise _over_limit(f"{len(self._runs)} runs known, cannot add run {run_id[:40]}", "max_runs")
        del self._runs[idle]
        self._rr_runs.remove(idle)

    # ------------------------------------------------------------------ liveness
    def _purge(self) -> None:
        deadline = time.monotonic() - self.heartbeat_interval_s * self.heartbeat_liveness
        for peer in [w for w in self._workers.values() if w.last_seen < deadline]:
            log.warning("worker %s missed %d heartbeats: quarantining its %d slot(s)", peer.peer_id,
                        self.heartbeat_liveness, sum(w.num_slots for w in peer.in_flight.values()))
            del self._workers[peer.peer_id]
            self._quarantine(peer)
        for peer in [s for s in self._students.values() if s.last_seen < deadline]:
            log.warning("student %s missed %d heartbeats: dropping its requests", peer.peer_id,
                        self.heartbeat_liveness)
            del self._students[peer.peer_id]
            self._purged_students[peer.peer_id] = None
            while len(self._purged_students) > MAX_PURGED_REMEMBERED:
                self._purged_students.pop(next(iter(self._purged_students)))
            self._drop_student_requests(peer)

    def _requeue(self, peer: WorkerPeer) -> None:
        live = {s.identity for s in self._students.values()}
        for work in _parts(peer.in_flight.values()):
            run = self._runs.get(work.run_id)
            if run is None:
                continue
            requests = [r for r in work.requests if r.student in live]
            run.queue.extendleft(reversed(requests))
            self._count_queued(requests, +1)
            num_slots = sum(len(r.slots) for r in requests)
            run.queued += num_slots
            self._counters.requeued += num_slots
        peer.in_flight.clear()

    def _quarantine(self, peer: WorkerPeer) -> None:
        """A silent worker may still write its slots: tell their students not to reuse them.

        It may also hold slots students asked of it directly, which we never saw: every
        live student hears ``direct`` for its process (a local worker: it has a token)."""
        live = {s.identity for s in self._students.values()}
        for work in peer.in_flight.values():
            self._settled(work.requests, answered=False)
            by_student: dict[bytes, list[list[int]]] = {}
            for request in work.requests:
                if request.student in live:
                    by_student.setdefault(request.student, []).extend(request.slots)
            for student, rows in by_student.items():
                protocol.send(self._frontend, Command.QUARANTINE, {"slots": rows, "process": peer.process},
                              identity=student)
                self._counters.quarantined += len(rows)
            self._zombie_works[(peer.peer_id, work.work_id)] = work
        peer.in_flight.clear()
        while len(self._zombie_works) > MAX_ZOMBIE_WORKS:
            self._zombie_works.pop(next(iter(self._zombie_works)))
        if peer.process is not None:
            for student in live:
                protocol.send(self._frontend, Command.QUARANTINE,
                              {"slots": [], "process": peer.process, "direct": True}, identity=student)

    def _release(self, work: Work) -> None:
        """The late DONE of a quarantined work: its slots may be filled again (its data is not used)."""
        log.warning("late DONE of work %d from a worker declared dead: releasing its %d slot(s)",
                    work.work_id, work.num_slots)
        by_student: dict[bytes, list[list[int]]] = {}
        for request in work.requests:
            by_student.setdefault(request.student, []).extend(request.slots)
        for student, rows in by_student.items():
            protocol.send(self._frontend, Command.RELEASE, {"slots": rows}, identity=student)
            self._counters.released += len(rows)

    def _snapshot(self) -> BrokerStats:
        c = self._counters
        per_run = {r.run_id: {"generation": r.generation, "model_id": r.model_id, "queued": r.queued,
                              "completed": r.completed, "discarded": r.discarded}
                   for r in self._runs.values()}
        return BrokerStats(
            queued=sum(r.queued for r in self._runs.values()),
            in_flight=sum(w.num_slots for p in self._workers.values() for w in p.in_flight.values()),
            requested=c.requested, dispatched=c.dispatched, completed=c.completed, notified=c.notified,
            direct=c.direct,
            discarded=c.discarded, requeued=c.requeued, quarantined=c.quarantined, released=c.released,
            failed=c.failed, refused=c.refused,
            bad_messages=c.bad_messages, workers=len(self._workers), students=len(self._students),
            runs=len(self._runs), completed_per_s=self._completed_rate.rate(),
            requested_per_s=self._requested_rate.rate(), uptime_s=time.monotonic() - self._started_at,
            per_run=per_run,
        )


def _direct_counts(value: Any) -> dict[str, tuple[int, int]]:
    """A worker's ``direct`` report, keeping only well-formed entries (run id -> two counts)."""
    if not isinstance(value, dict):
        return {}
    return {run_id: (counts[0], counts[1]) for run_id, counts in list(value.items())[:MAX_DIRECT_RUNS]
            if isinstance(run_id, str) and isinstance(counts, list) and len(counts) == 2
            and all(type(n) is int and 0 <= n <= protocol.MAX_INT for n in counts)}


def _check_generation_room(run: RunState, restore: int | None) -> None:
    """Refuse a SET_MODEL whose generation would not fit the wire's integers: the run's
    state stays as it was, instead of every later WORK and WELCOME failing to encode."""
    if max(run.generation, restore or 0) >= protocol.MAX_INT:
        raise ProtocolError(f"run {run.run_id}: generation {max(run.generation, restore or 0)} is at the "
                            "protocol's maximum (2**63-1); start a new run_id")


def _over_limit(what: str, limit: str) -> ProtocolError:
    """The refusal of input past one of the broker's limits, saying how to raise it."""
    return ProtocolError(f"{what}: over the broker's {limit}; raise it with pipeline.{limit}=N "
                         f"(Broker({limit}=N)) if this load is expected")


def _check_limits(broker: Broker) -> None:
    for name in ("max_queued_per_run", "max_queued", "max_queued_per_student", "max_students",
                 "max_workers", "max_runs"):
        value = getattr(broker, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Broker({name}={value!r}): must be a positive integer")
    if broker.max_queued_per_student > protocol.BROKER_SNDHWM:
        log.warning("max_queued_per_student=%d is above the broker's send high-water mark (%d): a "
                    "student owed that many replies may lose some", broker.max_queued_per_student,
                    protocol.BROKER_SNDHWM)


def _parts(works: Any) -> list[Work]:
    """The one-run parts of ``works`` (a fan-out WORK has one per run)."""
    return [part for work in works for part in (work.parts or [work])]


def _slots(requests: list[SlotRequests]) -> Any:
    """(request, slot_idx, request_id) of every slot of ``requests``, in order."""
    return ((request, slot_idx, request_id) for request in requests for slot_idx, request_id in request.slots)


def _drop_notified(work: Work, notified: frozenset[str], by_student: dict[bytes, list[list]]) -> int:
    """Take the filled slots of ``notified`` segments out of the COMPLETE rows (their
    students were told directly; failed ones still need the broker). Returns how many."""
    students = {request.student for request in work.requests if request.medium in notified}
    dropped = 0
    for student in students & by_student.keys():
        rows = by_student[student]
        kept = [row for row in rows if not row[2]]
        dropped += len(rows) - len(kept)
        by_student[student] = kept
    return dropped
