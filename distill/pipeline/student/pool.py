"""SlotPool: what every consumer process has (the StudentClient, and each DataLoader
worker of a DistillIterableDataset): one medium cut into slots, one socket to the
broker's frontend, and the bookkeeping that makes delivery exact.

Each slot is one record of a :class:`~distill.pipeline.student.slots.SlotTable` (its states and
moves are drawn there). The pool asks for fills and routes what comes back; two parts
of it decide about what comes back:

- ``delivery.py``: completions are accepted only for a slot PENDING with that request
  id, with a header committed by the slot's claimed writer for that fill; a completion
  (above all a datagram in the inbox, which any process of the user can send) never
  moves the generation: only the leader's switches do (the StudentClient's SET_MODEL
  answers and broadcasts, and the broker's DISCARDED);
- ``custody.py``: what waits on other processes (quarantine, declines, a broker
  restart, the pending deadline, the lanes' deadline, the writers' fair share).

Neither holds the pool: they move the slot table (``SlotAccess``), and what their moves
leave to do waits in its queues, which the pool carries out right after each call
(headers to ask, ``_carry_out``) or on its next flush (requests to send).

Asking for a fill: a fresh, random request id per fill (``slots.random_request_ids``);
the slot's header is *asked* (zeroed, its ``fill`` set to that id) before the request
leaves, straight to the local worker that filled it last (DIRECT) within that worker's
fair share, else through the broker (docs/pipeline.md, section Direct requests).

The hot paths work on many slots per call: headers are checked and asked through one
NumPy view of the segment's headers, a batch is gathered out of the slots with one
``index_select`` per tensor, and each slot's payload views are made once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import ClientKeys, CurveConfig, secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.liveness import (
    BROKER_SILENCE_S,
    BROKER_WAIT_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    BrokerPatience,
    BrokerWait,
    Heartbeater,
    new_peer_id,
)
from distill.pipeline.mediums.shm import SharedMemoryManager, sweep_orphans
from distill.pipeline.mediums.tcp import TcpMedium
from distill.pipeline.protocol import DEFAULT_RUN, Command, ProtocolError
from distill.pipeline.settings import merge
from distill.pipeline.slot import HEADER_BYTES, HeaderTable, slot_stride
from distill.pipeline.student.custody import Custody
from distill.pipeline.student.delivery import Delivery, SlotAccess
from distill.pipeline.student.inbox import Inbox, NoInbox
from distill.pipeline.student.slots import PENDING, Route, SlotTable
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

MEDIUMS = ("shm", "tcp")
BYE_LINGER_MS = 100
"""How long closing a pool lets its BYE take to leave."""


@dataclass(frozen=True)
class PoolConfig:
    """Every setting of a :class:`SlotPool` (the generation callbacks aside)."""

    frontend_endpoint: str | None = None
    run_id: str = DEFAULT_RUN
    slot_count: int = 16
    payload_bytes: int = 0
    role: str = "student"
    """The first part of the pool's peer id (``dataset<rank>`` for a dataset's pools)."""
    request_batch: int | None = None
    """Slots given back before a REQUEST is sent (default: a quarter of ``slot_count``)."""
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    medium: str = "shm"
    """``shm`` (one machine) or ``tcp`` (workers elsewhere send the samples over TCP)."""
    tcp_host: str | None = None
    curve: CurveConfig | ClientKeys | None = None
    notices: bool = True
    """Let workers on this machine announce filled slots directly (``notices.py``)."""
    socket_dir: str | os.PathLike | None = None
    direct_requests: bool = True
    """Ask a slot's last local worker to fill it again, past the broker (needs ``notices``)."""
    pending_deadline_s: float | None = None
    """How long a slot may stay PENDING before it is looked at and asked for again (None:
    8 x the typical fill time, at least twice the broker's liveness window; ``custody.py``)."""
    broker_pid: int | None = None
    """The broker's process, when it runs on this machine (mode=local sets it): while it runs,
    a call to the broker waits for its answer (up to ``broker_wait_s``); once it has exited,
    the call fails at once. None: only what is heard from the broker tells
    (:class:`~distill.pipeline.liveness.BrokerPatience`). A broker restarted under another
    pid is not followed: leave it None then."""
    broker_wait_s: float = BROKER_WAIT_S
    """The longest a call to the broker (HELLO, SET_MODEL, STOP) waits for its answer while
    the broker shows signs of life."""
    broker_silence_s: float = BROKER_SILENCE_S
    """Without ``broker_pid``, a call to the broker gives up after this long without hearing
    from it."""

    def __post_init__(self) -> None:
        if isinstance(self.slot_count, bool) or not isinstance(self.slot_count, int) or self.slot_count < 1:
            raise ValueError(f"slot_count={self.slot_count!r}: must be a positive integer (pipeline.slot_count)")
        if self.medium not in MEDIUMS:
            raise ValueError(f"medium={self.medium!r}: choose one of {MEDIUMS} (pipeline.medium)")
        if self.pending_deadline_s is not None and not self.pending_deadline_s > 0:
            raise ValueError(f"pending_deadline_s={self.pending_deadline_s!r}: must be > 0 (or None: automatic)")
        if not self.broker_wait_s > 0:  # NaN fails too
            raise ValueError(f"broker_wait_s={self.broker_wait_s!r}: must be > 0 seconds (pipeline.broker_wait_s)")
        if not self.broker_silence_s > 0:
            raise ValueError(f"broker_silence_s={self.broker_silence_s!r}: must be > 0 seconds")
        if self.broker_pid is not None and (isinstance(self.broker_pid, bool) or self.broker_pid < 1):
            raise ValueError(f"broker_pid={self.broker_pid!r}: a process id, or None (pipeline.broker_pid)")


class SlotPool:
    """Owned slots + a frontend socket (see module docstring). One per process.

    ``SlotPool(frontend_endpoint, run_id, slot_count, payload_bytes, generation,
    note_generation, ...)``, or with ``config=PoolConfig(...)``: ``generation()`` is the
    newest generation the consumer knows, ``note_generation(g)`` raises it (called only
    for what the broker says the leader set).
    """

    def __init__(self, frontend_endpoint: str | None = None, run_id: str | None = None,
                 slot_count: int | None = None, payload_bytes: int | None = None,
                 generation: Callable[[], int] | None = None,
                 note_generation: Callable[[int], None] | None = None, *,
                 config: PoolConfig | None = None, **options: Any) -> None:
        cfg = self.config = merge(PoolConfig, config, {
            "frontend_endpoint": frontend_endpoint, "run_id": run_id, "slot_count": slot_count,
            "payload_bytes": payload_bytes, **options}, "SlotPool")
        if cfg.frontend_endpoint is None:
            raise ValueError("SlotPool needs the broker's frontend_endpoint")
        keys = cfg.curve.client_keys() if isinstance(cfg.curve, CurveConfig) else cfg.curve  # before any resource
        sweep_orphans(inbox_dir=cfg.socket_dir)
        self.run_id = cfg.run_id
        self.payload_bytes = cfg.payload_bytes
        self.peer_id = new_peer_id(cfg.role)
        self.source_id = int(self.peer_id.rsplit("-", 1)[1], 16)  # names this pool in sample metadata
        self._generation = generation or (lambda: 0)
        self._note_generation = note_generation or (lambda _generation: None)
        self.medium = _open_medium(cfg, keys is not None)
        self.data_socket = self.medium.socket if isinstance(self.medium, TcpMedium) else None
        stride = self.medium.slot_stride
        # Views of the slots, made once (through their own memoryviews, so closing the
        # medium is not blocked by them): every header as one record array, every
        # payload as one row of a [slot_count, payload_bytes] tensor.
        self.headers = HeaderTable(self.medium.buf[:], stride)
        self._payload_rows = torch.frombuffer(self.medium.buf[:], dtype=torch.uint8).view(
            cfg.slot_count, stride)[:, HEADER_BYTES:HEADER_BYTES + cfg.payload_bytes]
        self._slot_views: dict[int, tuple[memoryview, dict[str, torch.Tensor]]] = {}
        self._slot_views_config: BatchConfig | None = None
        self.slots = SlotTable(cfg.slot_count)
        """Every slot's record (``slots.py``)."""
        self.request_batch = cfg.request_batch or max(1, cfg.slot_count // 4)
        self._ctx = zmq.Context()
        self._sock = secure_client(protocol.configure(self._ctx.socket(zmq.DEALER)), keys)
        self._sock.setsockopt(zmq.ROUTING_ID, self.peer_id.encode())
        self._sock.setsockopt(zmq.SNDTIMEO, protocol.SEND_RETRY_MS)  # see _send
        self._sock.connect(cfg.frontend_endpoint)
        self._inbox: Inbox | NoInbox = (
            Inbox.open(self.medium.buf_name, cfg.socket_dir, direct=cfg.direct_requests)
            if cfg.notices and self.data_socket is None else NoInbox())
        """Workers on this machine announce filled slots here, past the broker, and are asked
        for slots directly from here (``inbox.py``); in ``socket_dir`` (default: the default
        socket directory), where they must look too."""
        self._checked = 0.0
        """When the checks that run once per heartbeat interval last ran (``_beat_checks``)."""
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._inbox.fileno() is not None:
            self._poller.register(self._inbox.fileno(), zmq.POLLIN)
        self.heart = Heartbeater(cfg.frontend_endpoint, self.peer_id, cfg.role,
                                  interval_s=cfg.heartbeat_interval_s, liveness=cfg.heartbeat_liveness,
                                  keys=keys, first_beat_now=True).start()
        self._disconnect = weakref.finalize(self, _disconnect, self._sock, self._ctx, self.heart)
        """Closes the socket and its context: from :meth:`close`, or when a pool dropped without
        it is collected (then in whichever thread collects it: nothing in it may block)."""
        self._disconnect.atexit = False  # at exit another thread may still be using the socket
        self.patience = BrokerPatience.of(cfg.broker_pid, cfg.broker_silence_s, cfg.broker_wait_s)
        """How long calls to the broker wait for its answer (``liveness.py``)."""
        self.on_rejoin: Callable[[], None] | None = None
        self.counts = {"accepted": 0, "stale": 0, "rejected": 0, "failed": 0, "discarded": 0,
                       "quarantined": 0, "released": 0, "refused": 0, "notices": 0,
                       "direct": 0, "declined": 0, "overdue": 0, "hung_lanes": 0}
        self._closed = False
        self._met_broker = False
        self._warned_silent = False
        self._refusals = LogThrottle(log)
        self._model_cfg: tuple[str, dict] | None = None
        """(digest, model_cfg) of the last WELCOME that carried one: the broker sends a run's
        cfg once per connection and model (``protocol.py``), then only its digest."""
        access = SlotAccess(self.slots, self.headers, self.medium.slot_view, cfg.payload_bytes, self.peer_id,
                            self.counts)
        self.delivery = Delivery(access, network=self.data_socket is not None)
        """Takes completions in (``delivery.py``)."""
        self.custody = Custody(access, self.delivery, self.heart, pending_deadline_s=cfg.pending_deadline_s)
        """Decides about slots that wait on other processes (``custody.py``)."""
        self._write_share()

    def note_generation(self, generation: int) -> None:
        """Raise the consumer's generation: only for what the broker says the leader set."""
        self._note_generation(generation)

    def _carry_out(self) -> None:
        """Ask the headers of the slots just given new requests (``SlotTable.to_ask``): at
        once, so that a late writer of the old fill finds another fill in the slot."""
        table = self.slots
        if table.to_ask:
            slots, table.to_ask = table.to_ask, []
            records = table.records
            self.headers.ask(slots, [records[slot].request_id for slot in slots])

    def _write_share(self) -> None:
        """Write the writers' fair share into the segment header when it changed (``max_claims``)."""
        share = self.custody.fair_share()
        if share is not None:
            self.medium.set_max_claims(share)

    def request_free(self) -> None:
        """Ask for every FREE slot to be filled (sent on the next flush)."""
        self.ask(list(self.slots.free), from_free=True)

    def release(self, slot_idx: int) -> None:
        """An OUT slot comes back: ask for it again (batched)."""
        self.release_many([slot_idx])
        if len(self.slots.to_send) >= self.request_batch:
            self.flush()

    def release_many(self, slot_idxs: list[int]) -> None:
        """OUT slots come back: ask for them again (sent on the next flush)."""
        self.ask(slot_idxs, handed_out=True)

    def ask(self, slots: list[int], *, from_free: bool = False, handed_out: bool = False) -> None:
        """Ask for fills of ``slots`` (nobody writes them now): fresh requests, headers asked."""
        if not slots:
            return
        self.slots.ask(slots, time.monotonic(), from_free=from_free, handed_out=handed_out)
        self._carry_out()

    def flush(self) -> None:
        """Send the requests of the slots asked for since the last flush."""
        table = self.slots
        if not table.to_send:
            return
        self._carry_out()
        records = table.records
        wanted = [s for s in dict.fromkeys(table.to_send) if records[s].state is PENDING]
        table.to_send.clear()
        body = {"run_id": self.run_id, "peer_id": self.peer_id, "generation": self._generation(),
                "medium": self.medium.buf_name, "stride": self.medium.slot_stride}
        wanted, asked = self._inbox.send_direct(table, wanted, self.custody.direct_share, body)
        if asked:
            now = time.monotonic()
            for process, count in asked.items():
                self.counts["direct"] += count
                self.custody.lane_sent(process, now)  # its deadline (``custody.LaneClock``)
        if not wanted:
            return
        if not self._met_broker:
            self._meet_broker()
        self._send(Command.REQUEST, {**body, "slots": [[s, records[s].request_id] for s in wanted]})

    def _send(self, command: Command, body: dict[str, Any], wait: BrokerWait | None = None) -> None:
        """Send to the broker, raising rather than blocking forever when it refuses our key
        (ZeroMQ then has no route for the message) or ``wait`` gives up on the broker."""
        def go_on() -> bool:
            self._check_refused()
            if wait is not None:
                wait.check()
            return True
        protocol.send_patiently(self._sock, command, body, go_on)

    def _meet_broker(self) -> None:
        """Before the first REQUEST: learn which broker instance will hold it.

        A restart is told by the broker's instance id changing; a pool that sent its
        requests to a broker it never heard from could not tell that broker's
        successor from it, and would wait forever for slots the successor never got.
        Bounded: a broker that is down now gets the requests when it comes up.
        """
        self._met_broker = True
        timeout_s = self.heart.interval_s * self.heart.liveness
        if not self.heart.introduced.wait(timeout_s):
            log.warning("%s: no answer from the broker in %.1fs; sending requests anyway", self.peer_id,
                        timeout_s)

    def next_ready(self, timeout_ms: float) -> tuple[int, int, int] | None:
        """The next checked slot (slot, generation, request id), or None on timeout; it is
        the caller's (OUT) until :meth:`release`."""
        ready = self.slots.ready
        if ready and ready[0][1] >= self._generation():
            return self.slots.take_many(1, 0)[0][0]
        got = self.next_ready_many(1, timeout_ms)
        return got[0] if got else None

    def next_ready_many(self, max_count: int, timeout_ms: float) -> list[tuple[int, int, int]]:
        """Up to ``max_count`` checked slots (slot, generation, request id) of the current
        generation: those ready now, or else the first to arrive within ``timeout_ms``
        (an empty list after that). They are the caller's (OUT) until released."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if self.slots.ready:
                got = self._take_ready(max_count)
                if got:
                    return got
            self._check_refused()
            self.flush()
            self._check_broker()
            if time.monotonic() - self._checked >= self.heart.interval_s:
                self._beat_checks()
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if self.data_socket is not None:
                self._wait_network(min(left, self.heart.interval_s))
            else:
                ready = dict(self._poller.poll(min(left, self.heart.interval_s) * 1000))
                if self._inbox.fileno() in ready:
                    self._take_notices()
                if self._sock in ready:  # asking only then saves a call per sample of large ones
                    self._drain()

    def _take_ready(self, max_count: int) -> list[tuple[int, int, int]]:
        """Pop up to ``max_count`` ready slots (now OUT); stale ones are asked for again."""
        got, stale = self.slots.take_many(max_count, self._generation())
        if stale:
            self.counts["stale"] += len(stale)
            self.ask(stale)
        return got

    def _drain(self) -> None:
        while protocol.readable(self._sock):
            try:
                msg = protocol.recv(self._sock)
            except ProtocolError as exc:
                self._refusals.warning("%s: bad message from broker: %s", self.peer_id, exc.reason)
                continue
            self._on_message(msg)

    def _take_notices(self) -> None:
        """Completions a worker sent us directly (checked exactly as the broker's)."""
        for msg in self._inbox.receive():
            if msg.command is Command.DECLINED:
                self.custody.on_declined(msg.body["slots"], msg.body["reason"])
                continue
            self.counts["notices"] += 1
            lane = msg.body.get("lane")
            if lane is not None:  # its worker is alive (the lane's deadline, ``custody.py``)
                lane = (lane, msg.body.get("process") or "")
                self.custody.lane_answered(lane[1], time.monotonic())
            self.delivery.on_complete(msg.body["generation"], msg.body["slots"], notice=True,
                                      lanes=self._inbox.direct, lane=lane)
        self._carry_out()

    def _on_message(self, msg: protocol.Message) -> dict[str, Any] | None:
        if msg.command is Command.WELCOME:
            return self._welcomed(msg.body)
        if msg.command is Command.COMPLETE:
            if self.data_socket is not None:
                self._receive_data()  # the data of these slots may be waiting on the data socket
            self.delivery.on_complete(msg.body["generation"], msg.body["slots"])
        elif msg.command is Command.DISCARDED:
            self.note_generation(msg.body["generation"])  # the broker's is the leader's
            self.custody.on_discarded(msg.body["slots"])
        elif msg.command is Command.QUARANTINE:
            self.custody.on_quarantine(msg.body["slots"], msg.body.get("process"), direct=bool(msg.body.get("direct")))
        elif msg.command is Command.RELEASE:
            self.custody.on_release(msg.body["slots"])
        elif msg.command is Command.ERROR:
            if msg.body.get("slots"):
                self.custody.on_refused(msg.body["slots"], msg.body["reason"])
            else:
                log.error("%s: broker refused %s: %s", self.peer_id, msg.body.get("command"),
                          msg.body["reason"])
        self._carry_out()
        return None

    def _welcomed(self, welcome: dict[str, Any]) -> dict[str, Any]:
        """A WELCOME's body, its ``model_cfg`` filled in from our copy where the broker left
        it out (it named the digest of the cfg it sent us before)."""
        digest = welcome.get("model_digest")
        if digest is None:
            return welcome
        if "model_cfg" in welcome:
            self._model_cfg = (digest, welcome["model_cfg"])
        elif self._model_cfg is not None and self._model_cfg[0] == digest:
            welcome = {**welcome, "model_cfg": self._model_cfg[1]}
        return welcome

    def _wait_network(self, timeout_s: float) -> None:
        """Wait for broker messages and sample data at once; take in what came."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.data_socket, zmq.POLLIN)
        events = dict(poller.poll(timeout_s * 1000))
        if self.data_socket in events:
            self._receive_data()
        if self._sock in events:
            self._drain()
        self.delivery.expire_awaiting()
        self._carry_out()

    def _receive_data(self) -> None:
        """Copy arrived DATA into the slots that wait for it; check those completed already."""
        medium = cast("TcpMedium", self.medium)  # a data socket is a network medium's
        self.delivery.on_data(medium.receive(self.slots.expected_request))

    def _beat_checks(self) -> None:
        """What waits on other processes, looked at once per heartbeat interval (each needs
        a system call per slot or writer): held and overdue slots, our inbox."""
        self._checked = now = time.monotonic()
        self.custody.beat_checks(now)
        self._carry_out()
        self._write_share()
        self._check_inbox()

    def _check_inbox(self) -> None:
        """Bind our inbox again if its file vanished: workers keep answers to DIRECT
        requests for a while, and would lose them otherwise. Without direct requests
        nothing is lost (the broker's COMPLETE comes for every fill): it stays unbound."""
        if not self._inbox.direct or self._inbox.present():
            return
        self._take_notices()  # what reached the old socket
        self._poller.unregister(self._inbox.fileno())
        old = self._inbox.path
        self._inbox = self._inbox.rebind()
        if self._inbox.fileno() is None:  # cannot: notices go through the broker from now on
            log.warning("%s: inbox %s vanished and could not be bound again; no direct notices", self.peer_id, old)
            self.slots.drop_lanes()
            return
        self._poller.register(self._inbox.fileno(), zmq.POLLIN)
        log.warning("%s: inbox %s vanished; bound it again", self.peer_id, self._inbox.path)

    def _check_refused(self) -> None:
        """A broker that refuses our key never answers: say so instead of waiting forever."""
        if self.heart.refusal is not None:
            raise PermissionError(f"{self.peer_id}: {self.heart.refusal}")

    def _check_broker(self) -> None:
        """After a broker restart (or it purged us) ask again for what the broker held
        (``Custody.on_broker_restart``). Mere silence is only logged."""
        if not self.heart.broker_alive and not self._warned_silent:
            self._warned_silent = True
            log.warning("%s: no heartbeat from the broker for %.1fs", self.peer_id,
                        time.monotonic() - self.heart.last_heard)
        elif self.heart.broker_alive:
            self._warned_silent = False
        if not self.heart.forgotten.is_set():
            return
        self.heart.forgotten.clear()
        pending = [r for r in self.slots.records if r.state is PENDING and r.route is Route.BROKER]
        log.warning("%s: the broker forgot us; asking again for %d pending slot(s)", self.peer_id,
                    len(pending))
        if self.on_rejoin is not None:
            self.on_rejoin()
        self._take_notices()  # answers already here settle their requests: those need no repeat
        self._drain()
        self.custody.on_broker_restart(pending)
        self._carry_out()
        self.flush()

    def wait_for_broker(self, command: Command, endpoint: str, timeout_ms: float | None = None) -> BrokerWait:
        """A call's wait for the broker's answer to ``command`` sent to ``endpoint``:
        as long as the broker shows signs of life (``liveness.BrokerPatience``)."""
        return BrokerWait(self.peer_id, command, endpoint, self.heart, self.patience,
                          None if timeout_ms is None else timeout_ms / 1000)

    def hello(self, rank: int, timeout_ms: float | None = None) -> dict[str, Any]:
        """Register with the broker; its WELCOME (the run's model and generation). Waits as
        long as the broker shows signs of life (or ``timeout_ms``, a caller asking again);
        raises :class:`~distill.pipeline.liveness.BrokerRefusal` when it refuses the HELLO."""
        wait = self.wait_for_broker(Command.HELLO, self._sock.last_endpoint.decode(), timeout_ms)
        self._send(Command.HELLO, {"run_id": self.run_id, "peer_id": self.peer_id, "rank": rank}, wait)
        while True:
            self._check_refused()
            if self._sock.poll(100):
                wait.heard()
                welcome = self._on_hello_answer(wait)
                if welcome is not None:
                    self._meet_broker()  # so a leader can tell this broker from a restarted one
                    return welcome
            wait.check()

    def _on_hello_answer(self, wait: BrokerWait) -> dict[str, Any] | None:
        """Take one message while waiting for WELCOME: the WELCOME's body, None for anything
        else (handled as usual); the broker's refusal of the HELLO is raised."""
        try:
            msg = protocol.recv(self._sock)
        except ProtocolError as exc:
            self._refusals.warning("bad message from broker: %s", exc.reason)
            return None
        if msg.command is Command.ERROR and msg.body.get("command") == Command.HELLO.name:
            raise wait.refused(msg.body["reason"])
        return self._on_message(msg)

    def slot_tensors(self, slot_idx: int, batch_config: BatchConfig) -> tuple[memoryview, dict]:
        """The payload of a slot and views of its tensors (fresh tensor objects over
        views decoded once per slot, so a caller may reshape them freely)."""
        if batch_config is not self._slot_views_config:
            self._slot_views.clear()
            self._slot_views_config = batch_config
        cached = self._slot_views.get(slot_idx)
        if cached is None:
            view = self.medium.slot_view(slot_idx)[HEADER_BYTES:HEADER_BYTES + self.payload_bytes]
            cached = self._slot_views[slot_idx] = (view, batch_config.decode(view))
        view, tensors = cached
        return view, {name: tensor.detach() for name, tensor in tensors.items()}

    def payload_view(self, slot_idx: int) -> memoryview:
        """The payload bytes of a slot (what :class:`~distill.pipeline.student.loans.SlotLoans` lends)."""
        return self.medium.slot_view(slot_idx)[HEADER_BYTES:HEADER_BYTES + self.payload_bytes]

    def fill_number(self, slot_idx: int) -> int:
        """The pool's consecutive number of the fill a slot holds (request ids are random)."""
        return self.slots.records[slot_idx].fill

    def gather(self, slot_idxs: list[int], batch_config: BatchConfig, out: dict[str, torch.Tensor],
               row: int) -> None:
        """Copy the samples of ``slot_idxs`` into rows ``row...`` of the batch ``out``."""
        batch_config.gather(self._payload_rows, slot_idxs, out, row)

    def take_out(self, slot_idxs: list[int], batch_config: BatchConfig) -> dict[str, torch.Tensor]:
        """The samples of ``slot_idxs`` copied into fresh tensors ``{name: [len, *shape]}``."""
        return batch_config.take(self._payload_rows, slot_idxs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.heart.stop()
        with contextlib.suppress(zmq.ZMQError):  # no route to the broker (refused key): skip BYE
            protocol.send(self._sock, Command.BYE, {"peer_id": self.peer_id})
        self._sock.setsockopt(zmq.LINGER, BYE_LINGER_MS)
        self._disconnect()
        self._inbox.close()
        # Drop our views of the segment first, so that closing it can unmap it.
        self._slot_views.clear()
        self.headers.close()  # the helpers' reference to it holds no view of the segment either
        self.headers = self._payload_rows = None
        self.medium.close()


def _disconnect(sock: zmq.Socket, ctx: zmq.Context, heart: Heartbeater) -> None:
    """Close a pool's connection to the broker: stop its heartbeats (without waiting for
    their thread), close its socket (within the socket's LINGER: 0 unless :meth:`SlotPool.close`
    gave its BYE time), then terminate its context, which has no socket left to wait for.

    A finalizer and not ``Context.__del__``: collected together with a dropped pool, the
    context was terminated while the pool's socket, in the same cycle, was still open, and
    ``term()`` waited for it for ever in the collecting thread."""
    heart.stop(wait=False)
    sock.close()
    ctx.term()


def _open_medium(cfg: PoolConfig, secure: bool) -> SharedMemoryManager:
    """The consumer's slots: shared memory, or shared memory plus a TCP data socket
    (a CurveZMQ one when the pool's keys are on, ``mediums/tcp.py``)."""
    stride = slot_stride(cfg.payload_bytes)
    if cfg.medium == "tcp":
        return TcpMedium(cfg.slot_count, stride, run_id=cfg.run_id, host=cfg.tcp_host,
                         payload_bytes=cfg.payload_bytes, secure=secure)
    return SharedMemoryManager(cfg.slot_count, stride, read_only=True, run_id=cfg.run_id,
                               payload_bytes=cfg.payload_bytes)

