"""SlotPool: what every consumer process has (the StudentClient, and each DataLoader
worker of a DistillIterableDataset): one medium cut into slots, one socket to the
broker's frontend, and the bookkeeping that makes delivery exact.

Each slot is one record of a :class:`~distill.pipeline.slots.SlotTable` (its states
and moves are drawn there). The rules:

- each fill gets a fresh, random request id (``slots.random_request_ids``); the slot's
  header is *asked* (zeroed, its ``fill`` set to that id) before the request leaves;
- a completion (the broker's COMPLETE, or a worker's notice in our inbox) is accepted
  only for a slot PENDING with that request id, with a header committed by the
  slot's claimed writer for that fill (``slot.py``); a notice never moves the
  generation: only what the leader set does (the StudentClient's SET_MODEL answers
  and broadcasts, and the broker's DISCARDED);
- what was not filled (failed, discarded, stale) is asked for again, but a slot whose
  header shows a live writer's claim is left to that writer: asking again could put a
  second writer on it;
- a PENDING slot has a deadline (``pending_deadline_s``, by default derived from the
  heartbeat and the fill times seen); past it, and once the pool has made progress
  without it (a fill asked later was accepted: so it is not merely waiting its turn
  at a broker with no free worker), it is looked at once: a commit whose notice never
  came is taken, a wrong one is refused with the reason, one that nobody claims is
  asked for again, one a live writer claims waits on; one log line per kind and
  interval;
- a slot a local worker filled last is asked for again straight from that worker (a
  DIRECT datagram on its lane, ``notices.py``), and through the broker, same request
  id, when that worker declines or is gone; no lane gets more than its writer's fair
  share of the slots;
- the same fair share is written into the segment header (``max_claims``): no writer
  claims more than ``ceil(slot_count / max(2, writers seen))`` of our slots at once,
  so a frozen one never holds them all.

The hot paths work on many slots per call: headers are checked and asked through one
NumPy view of the segment's headers, a batch is gathered out of the slots with one
``index_select`` per tensor, and each slot's payload views are made once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import ClientKeys, CurveConfig, secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.liveness import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    Heartbeater,
    new_peer_id,
    process_alive,
    writer_alive,
)
from distill.pipeline.mediums.shm import SharedMemoryManager, sweep_orphans
from distill.pipeline.mediums.tcp import TcpMedium
from distill.pipeline.notices import NoticeInbox, encode_datagram
from distill.pipeline.protocol import Command, ProtocolError
from distill.pipeline.settings import merge
from distill.pipeline.slot import (
    HEADER_BYTES,
    HeaderTable,
    check_slot,
    read_claim,
    read_header,
    slot_stride,
)
from distill.pipeline.slots import (
    AWAITING,
    OUT,
    PENDING,
    QUARANTINED,
    Route,
    SlotRecord,
    SlotTable,
)
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

DEFAULT_RUN = "default"
CONTROL_TIMEOUT_MS = 10_000
FAILURES_BEFORE_BACKOFF = 16
"""Failed fills in a row before re-requests slow down (exponential, up to BACKOFF_MAX_S)."""
BACKOFF_MAX_S = 0.5
MAX_CONSECUTIVE_FAILURES = 200
"""Failed fills in a row after which the student gives up with an error instead of spinning."""
DATA_WAIT_S = 30.0
"""Network medium: how long a COMPLETE slot waits for its data before it is asked for again."""
MEDIUMS = ("shm", "tcp")
MAX_KNOWN_PROCESSES = 1024
DEADLINE_LATENCIES = 8
"""An automatic pending deadline is this many times the typical fill time ..."""
DEADLINE_HEARTBEATS = 2
"""... and at least this many times the broker's liveness window (interval x liveness)."""
MAX_DEADLINE_DOUBLINGS = 4
"""A slot overdue again and again waits up to 2**4 deadlines before it is looked at again."""
STALL_DEADLINES = 4
"""A slot counts as overdue once a fill asked after it has been accepted (the pool makes
progress without it); with no progress at all (no worker yet, a slow start), only after
``STALL_DEADLINES`` deadlines: asking again sooner would only pile requests up at the
broker."""
WRITER_WINDOW_HEARTBEATS = 30
"""Writers whose commits came within this many heartbeat intervals count for the fair share."""


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
    notice_dir: str | os.PathLike | None = None
    direct_requests: bool = True
    """Ask a slot's last local worker to fill it again, past the broker (needs ``notices``)."""
    pending_deadline_s: float | None = None
    """How long a slot may stay PENDING before it is looked at and asked for again (None:
    ``DEADLINE_LATENCIES`` x the typical fill time, at least ``DEADLINE_HEARTBEATS`` x the
    broker's liveness window)."""

    def __post_init__(self) -> None:
        if isinstance(self.slot_count, bool) or not isinstance(self.slot_count, int) or self.slot_count < 1:
            raise ValueError(f"slot_count={self.slot_count!r}: must be a positive integer (pipeline.slot_count)")
        if self.medium not in MEDIUMS:
            raise ValueError(f"medium={self.medium!r}: choose one of {MEDIUMS} (pipeline.medium)")
        if self.pending_deadline_s is not None and not self.pending_deadline_s > 0:
            raise ValueError(f"pending_deadline_s={self.pending_deadline_s!r}: must be > 0 (or None: automatic)")


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
        sweep_orphans(inbox_dir=cfg.notice_dir)
        self.run_id = cfg.run_id
        self.payload_bytes = cfg.payload_bytes
        self.peer_id = new_peer_id(cfg.role)
        self.source_id = int(self.peer_id.rsplit("-", 1)[1], 16)  # names this pool in sample metadata
        self._generation = generation or (lambda: 0)
        self._note_generation = note_generation or (lambda _generation: None)
        self.medium = _open_medium(cfg, keys is not None)
        self._data_sock = self.medium.socket if isinstance(self.medium, TcpMedium) else None
        stride = self.medium.slot_stride
        # Views of the slots, made once (through their own memoryviews, so closing the
        # medium is not blocked by them): every header as one record array, every
        # payload as one row of a [slot_count, payload_bytes] tensor.
        self._headers = HeaderTable(self.medium.buf[:], stride)
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
        self._inbox = (NoticeInbox.open(self.medium.buf_name, cfg.notice_dir)
                       if cfg.notices and self._data_sock is None else None)
        """Workers on this machine announce filled slots here, past the broker (``notices.py``);
        in ``notice_dir`` (default: the default socket directory), where they must look too."""
        self.direct_requests = cfg.direct_requests and self._inbox is not None
        self._visible: dict[str, bool] = {}
        """process token -> whether this process can see it run (a lane is used only then)."""
        self._writers: dict[int, float] = {}
        """writer id -> when its last commit was accepted (how many writers share our slots)."""
        self._share = 0
        """The fair share last written into the segment header (``max_claims``)."""
        self._checked = 0.0
        """When the checks that run once per heartbeat interval last ran (``_beat_checks``)."""
        self._latency_s: float | None = None
        """Typical time from asking for a slot to accepting it (a moving average)."""
        self._progress_asked = 0.0
        """When the most recently asked of the slots accepted so far was asked (progress)."""
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._inbox is not None:
            self._poller.register(self._inbox.fileno(), zmq.POLLIN)
        self._heart = Heartbeater(cfg.frontend_endpoint, self.peer_id, cfg.role,
                                  interval_s=cfg.heartbeat_interval_s, liveness=cfg.heartbeat_liveness,
                                  keys=keys, first_beat_now=True).start()
        self.on_rejoin: Callable[[], None] | None = None
        self.counts = {"accepted": 0, "stale": 0, "rejected": 0, "failed": 0, "discarded": 0,
                       "quarantined": 0, "released": 0, "refused": 0, "notices": 0,
                       "direct": 0, "declined": 0, "overdue": 0}
        self._closed = False
        self._met_broker = False
        self._warned_silent = False
        self._consecutive_failures = 0
        self._failure_logged = 0.0
        self._refusals = LogThrottle(log)
        self._overdue_log = LogThrottle(log, burst=4)
        self._update_share()

    # ------------------------------------------------------------------ requests
    def request_free(self) -> None:
        """Ask for every FREE slot to be filled (sent on the next flush)."""
        self._ask(list(self.slots.free))

    def release(self, slot_idx: int) -> None:
        """An OUT slot comes back: ask for it again (batched)."""
        self.release_many([slot_idx])
        if len(self.slots.to_send) >= self.request_batch:
            self.flush()

    def release_many(self, slot_idxs: list[int]) -> None:
        """OUT slots come back: ask for them again (sent on the next flush)."""
        records = self.slots.records
        for slot_idx in slot_idxs:
            if not 0 <= slot_idx < len(records) or records[slot_idx].state is not OUT:
                raise IndexError(f"slot {slot_idx} is not a slot handed out by this pool")
        self._ask(slot_idxs)

    def _ask(self, slots: list[int]) -> None:
        """Ask for fills of ``slots`` (nobody writes them now): fresh requests, headers asked."""
        if not slots:
            return
        now = time.monotonic()
        asked = self.slots.ask(slots, now, now + self._deadline_s())
        self._headers.ask(slots, [record.request_id for record in asked])

    def _ask_again(self, record: SlotRecord, *, keep_request: bool = False) -> None:
        """A slot nobody will write (any more) is asked for again, with a new request; with
        ``keep_request`` its old request is not lost but asked for in the next slot asked."""
        if record.state is PENDING:
            self._drop_from_send(record)
        now = time.monotonic()
        self.slots.renew(record, now, now + self._deadline_s(), keep_request=keep_request)
        self._headers.ask([record.idx], [record.request_id])
        if keep_request:
            self._reissue_now()

    def _drop_from_send(self, record: SlotRecord) -> None:
        with contextlib.suppress(ValueError):
            self.slots.to_send.remove(record.idx)

    def _resend(self, record: SlotRecord) -> None:
        """Send a PENDING slot's request again, same id, through the broker (its lane's
        worker will not fill it)."""
        record.route, record.holder = Route.BROKER, None
        record.lane = None
        self.slots.to_send.append(record.idx)

    def flush(self) -> None:
        """Send the requests of the slots asked for since the last flush."""
        table = self.slots
        if not table.to_send:
            return
        records = table.records
        wanted = [s for s in dict.fromkeys(table.to_send) if records[s].state is PENDING]
        table.to_send.clear()
        if self.direct_requests and any(records[s].lane is not None for s in wanted):
            wanted = self._send_direct(wanted)
        if not wanted:
            return
        if not self._met_broker:
            self._meet_broker()
        self._send(Command.REQUEST, {
            "run_id": self.run_id, "peer_id": self.peer_id, "generation": self._generation(),
            "medium": self.medium.buf_name, "stride": self.medium.slot_stride,
            "slots": [[s, records[s].request_id] for s in wanted],
        })

    def _send_direct(self, slots: list[int]) -> list[int]:
        """Ask for the slots that have a lane straight from its worker, up to that worker's
        fair share of our slots (a lane is sticky: without it, one worker would end up
        holding them all); returns those left for the broker (no lane, over the share, or
        the datagram was not taken)."""
        records = self.slots.records
        held: dict[str, int] = {}
        for record in records:
            if record.state is PENDING and record.route is Route.DIRECT:
                held[record.holder] = held.get(record.holder, 0) + 1
        by_lane: dict[tuple[str, str], list[int]] = {}
        rest = []
        share = math.ceil(len(records) / max(1, len(self._writers)))
        for slot in slots:
            lane = records[slot].lane
            if lane is None or held.get(lane[1], 0) >= share:
                rest.append(slot)
                continue
            held[lane[1]] = held.get(lane[1], 0) + 1
            by_lane.setdefault(lane, []).append(slot)
        generation = self._generation()
        for (path, process), group in by_lane.items():
            data = encode_datagram(Command.DIRECT, {
                "run_id": self.run_id, "peer_id": self.peer_id, "generation": generation,
                "medium": self.medium.buf_name, "stride": self.medium.slot_stride,
                "slots": [[s, records[s].request_id] for s in group]})
            if self._inbox.send_to(path, data):
                for slot in group:
                    records[slot].route, records[slot].holder = Route.DIRECT, process
                self.counts["direct"] += len(group)
                continue
            for slot in group:  # gone or full: nobody will write these, the broker may
                records[slot].lane = None
            rest.extend(group)
        return rest

    def _send(self, command: Command, body: dict[str, Any], deadline: float = math.inf) -> None:
        """Send to the broker, raising rather than blocking forever when it refuses our key
        (ZeroMQ then has no route for the message) or ``deadline`` passes."""
        def go_on() -> bool:
            self._check_refused()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.peer_id}: could not send {command.name} to the broker at "
                                   f"{self._sock.last_endpoint.decode()}: is it running?")
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
        timeout_s = self._heart.interval_s * self._heart.liveness
        if not self._heart.introduced.wait(timeout_s):
            log.warning("%s: no answer from the broker in %.1fs; sending requests anyway", self.peer_id,
                        timeout_s)

    # ------------------------------------------------------------------ delivery
    def next_ready(self, timeout_ms: float) -> tuple[int, int, int] | None:
        """The next checked slot (slot, generation, request id), or None on timeout; it is
        the caller's (OUT) until :meth:`release`."""
        ready = self.slots.ready
        if ready and ready[0][1] >= self._generation():
            entry = ready.popleft()
            self.slots.take(entry)
            return entry
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
            if time.monotonic() - self._checked >= self._heart.interval_s:
                self._beat_checks()
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if self._data_sock is not None:
                self._wait_network(min(left, self._heart.interval_s))
            else:
                ready = dict(self._poller.poll(min(left, self._heart.interval_s) * 1000))
                if self._inbox is not None and self._inbox.fileno() in ready:
                    self._take_notices()
                if self._sock in ready:  # asking only then saves a call per sample of large ones
                    self._drain()

    def _take_ready(self, max_count: int) -> list[tuple[int, int, int]]:
        """Pop up to ``max_count`` ready slots (now OUT); stale ones are asked for again."""
        current = self._generation()
        table = self.slots
        got, stale = [], []
        while table.ready and len(got) < max_count:
            entry = table.ready.popleft()
            table.take(entry)
            (got if entry[1] >= current else stale).append(entry)
        if stale:
            self.counts["stale"] += len(stale)
            self._ask([entry[0] for entry in stale])
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
        if self._inbox is None:
            return
        for msg in self._inbox.receive():
            if msg.command is Command.DECLINED:
                self._on_declined(msg.body["slots"], msg.body["reason"])
                continue
            self.counts["notices"] += 1
            lane = msg.body.get("lane")
            self._on_complete(msg.body["generation"], msg.body["slots"], notice=True,
                              lane=None if lane is None else (lane, msg.body.get("process") or ""))

    def _on_message(self, msg: protocol.Message) -> dict[str, Any] | None:
        if msg.command is Command.COMPLETE:
            self._on_complete(msg.body["generation"], msg.body["slots"])
        elif msg.command is Command.DISCARDED:
            self._on_discarded(msg.body["generation"], msg.body["slots"])
        elif msg.command is Command.QUARANTINE:
            self._on_quarantine(msg.body["slots"], msg.body.get("process"), direct=bool(msg.body.get("direct")))
        elif msg.command is Command.RELEASE:
            self._on_release(msg.body["slots"])
        elif msg.command is Command.ERROR:
            if msg.body.get("slots"):
                self._on_refused(msg.body["slots"], msg.body["reason"])
            else:
                log.error("%s: broker refused %s: %s", self.peer_id, msg.body.get("command"),
                          msg.body["reason"])
        elif msg.command is Command.WELCOME:
            return msg.body
        return None

    def _on_complete(self, generation: int, rows: list[list], *, notice: bool = False,
                     lane: tuple[str, str] | None = None) -> None:
        """Accept completed slots that check out. The generation a completion names never
        moves ours (only the leader's does): a slot is accepted with the generation its
        checked header carries. A notice's ``lane`` (path, process token) is where its
        slots are asked for next."""
        if self._data_sock is not None:
            self._receive_data()  # the data of these slots may be waiting on the data socket
        table = self.slots
        records, reqs = [], []
        for slot, req, ok in rows:
            record = table.pending(slot, req)
            if record is None:
                if not (notice and self._settle_late(slot, req)):
                    self.counts["rejected"] += 1  # not what we asked for (late or foreign)
                continue
            if not ok:
                self._on_failed_fill(record)
                continue
            records.append(record)
            reqs.append(req)
        if not records:
            return
        self._consecutive_failures = 0
        slots = [record.idx for record in records]
        matches = self._headers.check(slots, generation, reqs, self.payload_bytes)
        if all(matches):
            self._accept(records, generation)
        else:
            self._accept([r for r, match in zip(records, matches, strict=True) if match], generation)
            for record, match in zip(records, matches, strict=True):
                if not match:
                    self._refuse(record, generation, notice=notice)
        if notice and self.direct_requests:
            self._note_lanes([r for r in records if r.state is not PENDING], lane)

    def _accept(self, records: list[SlotRecord], generation: int) -> None:
        if not records:
            return
        now = time.monotonic()
        first = records[0]
        self._progress_asked = max(self._progress_asked, max(record.asked for record in records))
        sample = now - first.asked
        self._latency_s = sample if self._latency_s is None else 0.9 * self._latency_s + 0.1 * sample
        writer = self._headers.header(first.idx)
        if writer is not None:
            self._writers[writer.writer] = now
        for record in records:
            record.writer = writer.writer if writer is not None else 0
        self.counts["accepted"] += len(records)
        self.slots.accept(records, generation)

    def _refuse(self, record: SlotRecord, generation: int, *, notice: bool) -> None:
        """A completed slot whose header did not pass the quick check: the slow check
        (checksum, and the reason to log) decides; a slot a live writer is still writing
        is left to it."""
        view = self.medium.slot_view(record.idx)
        problem = check_slot(view, generation, record.request_id, self.payload_bytes)
        if problem is None:
            self._accept([record], generation)
            return
        if self._left_to_writer(record, view):
            return
        if self._headers.header(record.idx) is None:
            self._uncommitted(record, generation, notice=notice)
            return
        # Committed, but not what we asked for: its writer is done with the slot.
        self.counts["rejected"] += 1
        self._refusals.warning("%s: slot %d refused (%s); asking again", self.peer_id, record.idx, problem)
        self._ask_again(record)

    def _uncommitted(self, record: SlotRecord, generation: int, *, notice: bool) -> None:
        """Completed, but no commit in the header (yet), and no live writer on it."""
        if self._data_sock is not None and not notice:  # its data is on its way
            self.slots.move(record, AWAITING)
            record.deadline = time.monotonic() + DATA_WAIT_S
            record.generation = generation
            return
        self.counts["rejected"] += 1
        if notice:  # a notice before its commit, or forged: the deadline looks at it again
            self._refusals.warning("%s: notice for slot %d ignored (no commit in its header); it stays "
                                   "pending", self.peer_id, record.idx)
            return
        log.debug("%s: slot %d completed without a commit; asking again", self.peer_id, record.idx)
        self._ask_again(record)

    def _left_to_writer(self, record: SlotRecord, view: memoryview) -> bool:
        """True (and the slot now waits on it) when a live writer claims this slot's fill
        and has not committed it: asking again could put a second writer on the slot."""
        claim, fill = read_claim(view)
        if not claim or fill != record.request_id or writer_alive(claim) is False:
            return False
        header = read_header(view)
        if header is not None and header.writer == claim and header.request_id == record.request_id:
            return False  # it has committed: it is done with the slot
        record.route, record.holder = Route.WRITER, claim
        self._drop_from_send(record)
        return True

    def _wait_or_ask(self, record: SlotRecord, why: str, *, keep_request: bool = False) -> None:
        """A PENDING slot its fill did not reach: left to a live writer that claims it,
        else asked for again."""
        if self._left_to_writer(record, self.medium.slot_view(record.idx)):
            return
        log.debug("%s: slot %d %s; asking again", self.peer_id, record.idx, why)
        self._ask_again(record, keep_request=keep_request)

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
        for record in records:
            record.lane = lane

    def _on_failed_fill(self, record: SlotRecord) -> None:
        """A worker could not fill the slot: ask again, backing off while failures persist."""
        self.counts["failed"] += 1
        self._consecutive_failures += 1
        n = self._consecutive_failures
        if n >= MAX_CONSECUTIVE_FAILURES:
            raise RuntimeError(f"{self.peer_id}: workers failed {n} fills in a row; their logs say why "
                               "(generator errors, a sample size that is not the students', or a segment "
                               "they cannot map)")
        if n >= FAILURES_BEFORE_BACKOFF:
            if time.monotonic() - self._failure_logged > 5:
                self._failure_logged = time.monotonic()
                log.warning("%s: %d fills in a row failed (see the worker logs); retrying with back-off",
                            self.peer_id, n)
            time.sleep(min(BACKOFF_MAX_S, 0.001 * 2 ** (n - FAILURES_BEFORE_BACKOFF)))
        self._wait_or_ask(record, "failed")

    # ------------------------------------------------------------------ network medium
    def _wait_network(self, timeout_s: float) -> None:
        """Wait for broker messages and sample data at once; take in what came."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._data_sock, zmq.POLLIN)
        events = dict(poller.poll(timeout_s * 1000))
        if self._data_sock in events:
            self._receive_data()
        if self._sock in events:
            self._drain()
        self._expire_awaiting()

    def _receive_data(self) -> None:
        """Copy arrived DATA into the slots that wait for it; check those already completed."""
        for slot in self.medium.receive(self._expected_request):
            record = self.slots.records[slot]
            if record.state is AWAITING:
                self._refuse(record, record.generation, notice=False)

    def _expected_request(self, slot: int) -> int | None:
        record = self.slots.record(slot)
        if record is None or record.state not in (PENDING, AWAITING):
            return None
        return record.request_id

    def _expire_awaiting(self) -> None:
        now = time.monotonic()
        for record in [r for r in self.slots.records if r.state is AWAITING and r.deadline < now]:
            self.counts["rejected"] += 1
            self._refusals.warning("%s: slot %d completed but its data never came in %.0fs; asking again",
                                   self.peer_id, record.idx, DATA_WAIT_S)
            self._ask([record.idx])

    def _on_declined(self, rows: list[list[int]], reason: str) -> None:
        """A worker will not fill these DIRECT slots: the broker gets them, same request ids."""
        for slot, req in rows:
            if self._settle_late(slot, req):
                continue
            record = self.slots.pending(slot, req)
            if record is not None and record.route is Route.DIRECT:
                self.counts["declined"] += 1
                if not self._left_to_writer(record, self.medium.slot_view(slot)):
                    self._resend(record)
        log.debug("%s: %d direct request(s) declined: %s", self.peer_id, len(rows), reason)

    # ------------------------------------------------------------------ what waits on others
    def _beat_checks(self) -> None:
        """What waits on other processes, looked at once per heartbeat interval (each needs
        a system call per slot or writer): overdue and held slots, our inbox, the fair share."""
        self._checked = now = time.monotonic()
        self._check_held(now)
        if self.direct_requests:
            self._check_inbox()
        self._update_share()

    def _check_held(self, now: float) -> None:
        """Quarantined slots whose writer is gone come back; DIRECT or WRITER slots whose
        holder is gone go to the broker; overdue PENDING slots are looked at."""
        alive: dict[Any, bool] = {}
        overdue: list[SlotRecord] = []
        stalled = now - STALL_DEADLINES * self._deadline_s()
        for record in self.slots.records:
            state = record.state
            if state is QUARANTINED:
                if not self._holder_alive(record.holder, alive):
                    self._unquarantine(record)
            elif state is PENDING:
                if record.route is not Route.BROKER and not self._holder_alive(record.holder, alive):
                    self._resend(record)
                elif record.deadline < now and (record.asked < self._progress_asked or record.asked < stalled):
                    overdue.append(record)
        if overdue:
            self._look_at_overdue(overdue, now)

    @staticmethod
    def _holder_alive(holder: str | int | None, alive: dict[Any, bool]) -> bool:
        """Whether a slot's holder (a process token or a writer id) may still write it."""
        if holder not in alive:
            state = writer_alive(holder) if isinstance(holder, int) else process_alive(holder)
            alive[holder] = state is not False
        return alive[holder]

    def _look_at_overdue(self, records: list[SlotRecord], now: float) -> None:
        """PENDING past their deadline: take a commit whose notice never came, refuse a
        wrong one, leave a live writer's claim alone, ask again for the rest."""
        self.counts["overdue"] += len(records)
        asked, waiting, taken = [], 0, 0
        for record in records:
            record.overdue += 1
            view = self.medium.slot_view(record.idx)
            header = self._headers.header(record.idx)
            if header is not None and header.request_id == record.request_id:
                if check_slot(view, header.generation, record.request_id, self.payload_bytes) is None:
                    self._accept([record], header.generation)  # committed; its notice was lost
                    taken += 1
                else:
                    self._refuse(record, header.generation, notice=False)
                continue
            if self._left_to_writer(record, view):
                record.deadline = now + self._deadline_s() * 2 ** min(record.overdue, MAX_DEADLINE_DOUBLINGS)
                waiting += 1
                continue
            asked.append(record)
        if taken:
            self._overdue_log.warning("%s: %d slot(s) committed but never announced; taken", self.peer_id, taken)
        if waiting:
            self._overdue_log.warning("%s: %d slot(s) overdue are still being written by a live writer; "
                                      "waiting on it", self.peer_id, waiting)
        if asked:
            self._overdue_log.warning("%s: %d slot(s) pending for more than %.1fs with nobody writing them "
                                      "(a lost or unanswered request); asking again", self.peer_id, len(asked),
                                      self._deadline_s())
            for record in asked:
                overdue = record.overdue
                self._ask_again(record, keep_request=True)
                record.overdue = overdue
                record.deadline = now + self._deadline_s() * 2 ** min(overdue, MAX_DEADLINE_DOUBLINGS)

    def _deadline_s(self) -> float:
        """How long a slot may stay PENDING (``PoolConfig.pending_deadline_s``)."""
        if self.config.pending_deadline_s is not None:
            return self.config.pending_deadline_s
        floor = DEADLINE_HEARTBEATS * self._heart.interval_s * self._heart.liveness
        return max(floor, DEADLINE_LATENCIES * (self._latency_s or 0.0))

    def _update_share(self) -> None:
        """Write the fair share of one writer into the segment header (``max_claims``)."""
        window = WRITER_WINDOW_HEARTBEATS * self._heart.interval_s
        now = time.monotonic()
        for writer in [w for w, seen in self._writers.items() if now - seen > window]:
            del self._writers[writer]
        share = math.ceil(len(self.slots) / max(2, len(self._writers)))
        if share != self._share:
            self._share = share
            self.medium.set_max_claims(share)

    def _check_inbox(self) -> None:
        """Bind our inbox again if its file vanished: workers keep answers to DIRECT
        requests for a while, and would lose them otherwise."""
        if self._inbox.present():
            return
        self._take_notices()  # what reached the old socket
        self._poller.unregister(self._inbox.fileno())
        self._inbox.close()
        self._inbox = NoticeInbox.open(self.medium.buf_name, self.config.notice_dir)
        if self._inbox is None:  # cannot: notices go through the broker from now on
            log.warning("%s: inbox vanished and could not be bound again; no direct notices", self.peer_id)
            self.direct_requests = False
            for record in self.slots.records:
                record.lane = None
            return
        self._poller.register(self._inbox.fileno(), zmq.POLLIN)
        log.warning("%s: inbox %s vanished; bound it again", self.peer_id, self._inbox.path)

    def _on_discarded(self, generation: int, rows: list[list[int]]) -> None:
        """Fills the broker dropped (stale) or a worker would not make: asked for again, unless
        a live writer claims the slot. The broker's generation is the leader's: noted."""
        self._note_generation(generation)
        for slot, req in rows:
            record = self.slots.pending(slot, req)
            if record is not None:
                self.counts["discarded"] += 1
                self._wait_or_ask(record, "discarded")

    def _on_refused(self, rows: list[list[int]], reason: str) -> None:
        """The broker is over a limit and did not queue these requests: back off, ask again."""
        again = [record for slot, req in rows if (record := self.slots.pending(slot, req)) is not None]
        self.counts["refused"] += len(again)
        if time.monotonic() - self._failure_logged > 5:
            self._failure_logged = time.monotonic()
            log.warning("%s: broker refused %d request(s) (%s); asking again after a pause",
                        self.peer_id, len(again), reason)
        time.sleep(BACKOFF_MAX_S)
        self.slots.to_send.extend(record.idx for record in again)

    def _on_quarantine(self, rows: list[list[int]], process: str | None, *, direct: bool = False) -> None:
        """A worker declared dead may still write these slots: those it has claimed stay
        out of use (their samples are asked for in other slots); those it never claimed
        are asked for again at once (it can no longer write them: their fill changes).
        With ``direct``, the same for what we asked of it by DIRECT."""
        if direct and process is not None:
            self._quarantine_direct(process)
        if not rows:
            return
        remote = process_alive(process) is None
        taken = 0
        for slot, req in rows:
            record = self.slots.pending(slot, req)
            if record is None:
                continue
            claim, fill = read_claim(self.medium.slot_view(slot))
            if remote or not claim or fill != req or writer_alive(claim) is False:
                # Not being written: over the network medium a remote writer reaches our
                # slots only through receive(), which takes data for pending requests only.
                self.counts["discarded"] += 1
                self._ask_again(record, keep_request=True)
                continue
            self._drop_from_send(record)
            self.slots.quarantine(record, claim)
            taken += 1
        if taken:
            self._quarantined(taken, "their worker stopped answering and may still write them")

    def _quarantine_direct(self, process: str) -> None:
        """Slots asked of a silent worker by DIRECT: those it claimed are out of use until it
        answers them late (``_settle_late``) or is gone; the rest are asked for again. No
        more requests go to its lane."""
        taken = 0
        for record in self.slots.records:
            if record.lane is not None and record.lane[1] == process:
                record.lane = None
            if record.state is not PENDING or record.route is not Route.DIRECT or record.holder != process:
                continue
            claim, fill = read_claim(self.medium.slot_view(record.idx))
            if claim and fill == record.request_id and writer_alive(claim) is not False:
                self._drop_from_send(record)
                self.slots.quarantine(record, process, late_request=record.request_id)
                taken += 1
            else:
                self._ask_again(record, keep_request=True)
        if taken:
            self._quarantined(taken, "asked of a silent worker directly")

    def _quarantined(self, count: int, why: str) -> None:
        self.counts["quarantined"] += count
        usable = sum(record.state is not QUARANTINED for record in self.slots.records)
        log.warning("%s: %d slot(s) quarantined (%s); %d of %d slots left in use", self.peer_id, count, why,
                    usable, len(self.slots))
        self._reissue_now()

    def _settle_late(self, slot: int, req: int) -> bool:
        """A late answer (notice or DECLINED) of a worker to a DIRECT whose slot we had
        quarantined: that worker is done with the slot, which goes back into use (its
        sample was asked for elsewhere and is not used). True when it was one."""
        record = self.slots.record(slot)
        if record is None or record.state is not QUARANTINED or not record.late_request \
                or record.late_request != req:
            return False
        self._unquarantine(record)
        return True

    def _reissue_now(self) -> None:
        """Slots still FREE (never requested) can carry re-issued requests at once."""
        while self.slots.reissue and self.slots.free:
            self._ask([self.slots.free[0]])

    def _on_release(self, rows: list[list[int]]) -> None:
        """The worker's late DONE: it is done with these slots."""
        for slot, _req in rows:
            record = self.slots.record(slot)
            if record is not None and record.state is QUARANTINED:
                self._unquarantine(record)

    def _unquarantine(self, record: SlotRecord) -> None:
        record.late_request = 0
        self.counts["released"] += 1
        self._ask([record.idx])

    def _check_refused(self) -> None:
        """A broker that refuses our key never answers: say so instead of waiting forever."""
        if self._heart.refusal is not None:
            raise PermissionError(f"{self.peer_id}: {self._heart.refusal}")

    def _check_broker(self) -> None:
        """After a broker restart (or it purged us) ask again for everything pending.

        Mere silence is only logged. A slot a live writer claims is left to it (asking
        twice could let two writers race on it); the others are asked for with new
        requests, so a WORK of the old broker still waiting in a worker's socket finds
        another fill in the slot and writes nothing (``worker/claims.py``).
        """
        if not self._heart.broker_alive and not self._warned_silent:
            self._warned_silent = True
            log.warning("%s: no heartbeat from the broker for %.1fs", self.peer_id,
                        time.monotonic() - self._heart.last_heard)
        elif self._heart.broker_alive:
            self._warned_silent = False
        if not self._heart.forgotten.is_set():
            return
        self._heart.forgotten.clear()
        pending = [r for r in self.slots.records if r.state is PENDING and r.route is Route.BROKER]
        log.warning("%s: the broker forgot us; asking again for %d pending slot(s)", self.peer_id,
                    len(pending))
        if self.on_rejoin is not None:
            self.on_rejoin()
        self._take_notices()  # answers already here settle their requests: those need no repeat
        self._drain()
        for record in pending:
            if record.state is PENDING and record.route is Route.BROKER:
                self._wait_or_ask(record, "lost with the broker", keep_request=True)
        self.flush()

    # ------------------------------------------------------------------ API of the consumers
    def hello(self, rank: int, timeout_ms: float = CONTROL_TIMEOUT_MS) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_ms / 1000
        self._send(Command.HELLO, {"run_id": self.run_id, "peer_id": self.peer_id, "rank": rank}, deadline)
        while (left := deadline - time.monotonic()) > 0:
            self._check_refused()
            if self._sock.poll(min(left, 0.1) * 1000):
                try:
                    welcome = self._on_message(protocol.recv(self._sock))
                except ProtocolError as exc:
                    self._refusals.warning("bad message from broker: %s", exc.reason)
                    continue
                if welcome is not None:
                    self._meet_broker()  # so a leader can tell this broker from a restarted one
                    return welcome
        raise TimeoutError(f"no answer from the broker at {self._sock.last_endpoint.decode()} in "
                           f"{timeout_ms / 1000:.0f}s: is `python -m distill mode=broker` running?")

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

    def fill_number(self, slot_idx: int) -> int:
        """The pool's consecutive number of the fill a slot holds (request ids are random)."""
        return self.slots.records[slot_idx].fill

    def gather(self, slot_idxs: list[int], batch_config: BatchConfig, out: dict[str, torch.Tensor],
               row: int) -> None:
        """Copy the samples of ``slot_idxs`` into rows ``row...`` of the batch ``out``."""
        batch_config.gather(self._payload_rows, slot_idxs, out, row)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._heart.stop()
        with contextlib.suppress(zmq.ZMQError):  # no route to the broker (refused key): skip BYE
            protocol.send(self._sock, Command.BYE, {"peer_id": self.peer_id})
        self._sock.close(linger=100)
        self._ctx.term()
        if self._inbox is not None:
            self._inbox.close()
        # Drop our views of the segment first, so that closing it can unmap it.
        self._slot_views.clear()
        self._headers = self._payload_rows = None
        self.medium.close()


def _open_medium(cfg: PoolConfig, secure: bool) -> SharedMemoryManager:
    """The consumer's slots: shared memory, or shared memory plus a TCP data socket
    (a CurveZMQ one when the pool's keys are on, ``mediums/tcp.py``)."""
    stride = slot_stride(cfg.payload_bytes)
    if cfg.medium == "tcp":
        return TcpMedium(cfg.slot_count, stride, run_id=cfg.run_id, host=cfg.tcp_host,
                         payload_bytes=cfg.payload_bytes, secure=secure)
    return SharedMemoryManager(cfg.slot_count, stride, read_only=True, run_id=cfg.run_id,
                               payload_bytes=cfg.payload_bytes)

