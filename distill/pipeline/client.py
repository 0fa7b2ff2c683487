"""The student side: a pool of owned slots, and the StudentClient of the seed README.

:class:`SlotPool` is what every consumer process has (the StudentClient, and each
DataLoader worker of a DistillIterableDataset): one shared-memory medium, one
socket to the broker's frontend, and the bookkeeping that makes delivery exact:

- each fill gets a fresh request id; the header is cleared before asking;
- a COMPLETE is accepted only for a slot that is pending with that request id, of a
  generation not older than the newest one known, with a header that checks out;
- DISCARDED (stale work) and failed slots are asked for again, so none gets stuck;
- a slot whose last fill a local worker announced with its request lane is asked for
  again straight from that worker (a DIRECT datagram, ``notices.py``), and through
  the broker, with the same request id, when that worker declines or is gone.

The hot paths work on many slots per call: headers are checked and cleared through
one NumPy view of the segment's headers, a batch is gathered out of the slots with
one ``index_select`` per tensor, and each slot's payload views are made once.

Slot life: FREE -> (request) PENDING -> (COMPLETE, checked) READY -> (handed out)
HELD -> (release) FREE.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import ClientKeys, CurveConfig, HandshakeWatch, secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    Heartbeater,
    new_peer_id,
    process_alive,
)
from distill.pipeline.mediums.shm import SharedMemoryManager, sweep_orphans
from distill.pipeline.mediums.tcp import TcpMedium
from distill.pipeline.notices import NoticeInbox, encode_datagram
from distill.pipeline.protocol import Command, ProtocolError
from distill.pipeline.slot import (
    HEADER_BYTES,
    HeaderTable,
    check_slot,
    slot_stride,
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


@dataclass
class SampleRef:
    """A filled slot handed to the user: views valid until ``release_slot(slot_id)``."""

    slot_id: int
    generation: int
    request_id: int
    data: memoryview
    tensors: dict[str, torch.Tensor]


class SlotPool:
    """Owned slots + a frontend socket (see module docstring). One per process."""

    def __init__(self, frontend_endpoint: str, run_id: str, slot_count: int, payload_bytes: int,
                 generation: Callable[[], int], note_generation: Callable[[int], None], *,
                 role: str = "student", request_batch: int | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_liveness: int = HEARTBEAT_LIVENESS, medium: str = "shm",
                 tcp_host: str | None = None, curve: CurveConfig | ClientKeys | None = None,
                 notices: bool = True, notice_dir: str | os.PathLike | None = None,
                 direct_requests: bool = True) -> None:
        keys = curve.client_keys() if isinstance(curve, CurveConfig) else curve  # before any resource
        sweep_orphans(inbox_dir=notice_dir)
        self.run_id = run_id
        self.payload_bytes = payload_bytes
        self.peer_id = new_peer_id(role)
        self.source_id = int(self.peer_id.rsplit("-", 1)[1], 16)  # names this pool in sample metadata
        self._generation = generation
        self._note_generation = note_generation
        self.medium = _open_medium(medium, slot_count, slot_stride(payload_bytes), run_id, tcp_host)
        self._data_sock = self.medium.socket if isinstance(self.medium, TcpMedium) else None
        self._awaiting: dict[int, tuple[int, int, float]] = {}
        """Network medium: slot -> (generation, request id, deadline) completed before its data came."""
        stride = self.medium.slot_stride
        # Views of the whole segment, made once (through their own memoryviews, so
        # closing the medium is not blocked by them): every header as one record
        # array, every payload as one row of a [slot_count, payload_bytes] tensor.
        self._headers = HeaderTable(self.medium.buf[:], stride)
        self._payload_rows = torch.frombuffer(self.medium.buf[:], dtype=torch.uint8).view(
            slot_count, stride)[:, HEADER_BYTES:HEADER_BYTES + payload_bytes]
        self._slot_views: dict[int, tuple[memoryview, dict[str, torch.Tensor]]] = {}
        self._slot_views_config: BatchConfig | None = None
        self.request_batch = request_batch or max(1, slot_count // 4)
        self._ctx = zmq.Context()
        self._sock = secure_client(protocol.configure(self._ctx.socket(zmq.DEALER)), keys)
        self._sock.setsockopt(zmq.ROUTING_ID, self.peer_id.encode())
        self._sock.setsockopt(zmq.SNDTIMEO, protocol.SEND_RETRY_MS)  # see _send
        self._sock.connect(frontend_endpoint)
        self._inbox = (NoticeInbox.open(self.medium.buf_name, notice_dir)
                       if notices and self._data_sock is None else None)
        """Workers on this machine announce filled slots here, past the broker (``notices.py``);
        in ``notice_dir`` (default: the default socket directory), where they must look too."""
        self.direct_requests = direct_requests and self._inbox is not None
        """Ask the worker that filled a slot to fill it again, past the broker (``notices.py``)."""
        self._lanes: dict[int, tuple[str, str]] = {}
        """slot -> (request lane, process token) of the local worker that last filled it."""
        self._direct: dict[int, str] = {}
        """slot -> process token of the worker its pending request went to by DIRECT."""
        self._visible: dict[str, bool] = {}
        """process token -> whether this process can see it run (a lane is used only then)."""
        self._checked = 0.0
        """When the checks that run once per heartbeat interval last ran (``_beat_checks``)."""
        self._notice_dir = notice_dir
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._inbox is not None:
            self._poller.register(self._inbox.fileno(), zmq.POLLIN)
        self._heart = Heartbeater(frontend_endpoint, self.peer_id, role, interval_s=heartbeat_interval_s,
                                  liveness=heartbeat_liveness, keys=keys, first_beat_now=True).start()
        self._free: deque[int] = deque(range(slot_count))
        self._pending: dict[int, int] = {}  # slot -> request id
        self._ready: deque[tuple[int, int, int]] = deque()  # (slot, generation, request id)
        self._to_request: list[int] = []
        # Request ids start at a random point so that ids of different pools differ:
        # a worker may derive the sample from the id (e.g. which chunk of data to use).
        self._next_request_id = secrets.randbits(40) << 16
        self.on_rejoin: Callable[[], None] | None = None
        self.counts = {"accepted": 0, "stale": 0, "rejected": 0, "failed": 0, "discarded": 0,
                       "quarantined": 0, "released": 0, "refused": 0, "notices": 0,
                       "direct": 0, "declined": 0}
        self._quarantined: dict[int, str | None] = {}  # slot -> process token of its writer
        self._late: dict[int, int] = {}
        """Quarantined slot -> the request id a silent worker holds it for by DIRECT."""
        self._reissue: deque[int] = deque()  # request ids of quarantined slots, asked for again
        self._closed = False
        self._met_broker = False
        self._warned_silent = False
        self._consecutive_failures = 0
        self._failure_logged = 0.0
        self._refusals = LogThrottle(log)

    # ------------------------------------------------------------------ requests
    def request_free(self) -> None:
        """Ask for every FREE slot to be filled (sent on the next flush)."""
        while self._free:
            self._queue_request(self._free.popleft())

    def release(self, slot_idx: int) -> None:
        """A HELD slot comes back: ask for it again (batched)."""
        self._queue_request(slot_idx)
        if len(self._to_request) >= self.request_batch:
            self.flush()

    def release_many(self, slot_idxs: list[int]) -> None:
        """HELD slots come back: ask for them again (sent on the next flush)."""
        for slot_idx in slot_idxs:
            if not 0 <= slot_idx < len(self._headers):
                raise IndexError(f"slot {slot_idx} outside [0, {len(self._headers)})")
        self._headers.clear(slot_idxs)
        if self._reissue:
            for slot_idx in slot_idxs:
                self._pending[slot_idx] = self._new_request_id()
            self._to_request.extend(slot_idxs)
            return
        first = self._next_request_id
        self._pending.update(zip(slot_idxs, range(first, first + len(slot_idxs)), strict=True))
        self._next_request_id = first + len(slot_idxs)
        self._to_request.extend(slot_idxs)

    def _queue_request(self, slot_idx: int) -> None:
        self._headers.clear([slot_idx])
        self._pending[slot_idx] = self._new_request_id()
        self._to_request.append(slot_idx)

    def _new_request_id(self) -> int:
        """A quarantined request's id first (so its sample is not lost), else a new one."""
        if self._reissue:
            return self._reissue.popleft()
        self._next_request_id += 1
        return self._next_request_id - 1

    def flush(self) -> None:
        if not self._to_request:
            return
        wanted = [s for s in dict.fromkeys(self._to_request) if s in self._pending]
        self._to_request.clear()
        if self._lanes:
            wanted = self._send_direct(wanted)
        if not wanted:
            return
        if not self._met_broker:
            self._meet_broker()
        slots = [[s, self._pending[s]] for s in wanted]
        self._send(Command.REQUEST, {
            "run_id": self.run_id, "peer_id": self.peer_id, "generation": self._generation(),
            "medium": self.medium.buf_name, "stride": self.medium.slot_stride, "slots": slots,
        })

    def _send_direct(self, slots: list[int]) -> list[int]:
        """Ask for the slots that have a lane straight from its worker; returns those
        left for the broker (no lane, or it did not take the datagram)."""
        by_lane: dict[tuple[str, str], list[int]] = {}
        rest = []
        for slot in slots:
            lane = self._lanes.get(slot)
            if lane is None:
                rest.append(slot)
            else:
                by_lane.setdefault(lane, []).append(slot)
        generation = self._generation()
        for (path, process), group in by_lane.items():
            data = encode_datagram(Command.DIRECT, {
                "run_id": self.run_id, "peer_id": self.peer_id, "generation": generation,
                "medium": self.medium.buf_name, "stride": self.medium.slot_stride,
                "slots": [[s, self._pending[s]] for s in group]})
            if self._inbox.send_to(path, data):
                self._direct.update(dict.fromkeys(group, process))
                self.counts["direct"] += len(group)
                continue
            for slot in group:  # gone or full: nobody will write these, the broker may
                self._lanes.pop(slot, None)
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
        """The next checked slot (slot, generation, request id), or None on timeout."""
        if self._ready and self._ready[0][1] >= self._generation():
            return self._ready.popleft()
        got = self.next_ready_many(1, timeout_ms)
        return got[0] if got else None

    def next_ready_many(self, max_count: int, timeout_ms: float) -> list[tuple[int, int, int]]:
        """Up to ``max_count`` checked slots (slot, generation, request id) of the
        current generation: those ready now, or else the first to arrive within
        ``timeout_ms`` (an empty list after that)."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if self._ready:
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
        """Pop up to ``max_count`` ready slots; stale ones are asked for again."""
        current = self._generation()
        got = []
        while self._ready and len(got) < max_count:
            entry = self._ready.popleft()
            if entry[1] >= current:
                got.append(entry)
                continue
            self.counts["stale"] += 1
            self._queue_request(entry[0])
        return got

    def _drain(self) -> None:
        while protocol.readable(self._sock):
            try:
                msg = protocol.recv(self._sock)
            except ProtocolError as exc:
                log.warning("%s: bad message from broker: %s", self.peer_id, exc.reason)
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
            self._on_discarded(msg.body["slots"])
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
        """Accept completed slots that check out. A worker's direct ``notice`` whose header
        does not check out is ignored and its slot stays pending: asking again could put a
        second writer on a slot the first may still be writing (the broker, which knows
        the first has finished, answers such slots instead). A notice's ``lane`` (path,
        process token) is where its slots are asked for next."""
        if generation > self._generation():
            self._note_generation(generation)
        if self._data_sock is not None:
            self._receive_data()  # the data of these slots may be waiting on the data socket
        pending = self._pending
        slots, reqs, was_direct = [], [], {}
        for slot, req, ok in rows:
            if pending.get(slot) != req:
                if not (notice and self._late and self._settle_late(slot, req)):
                    self.counts["rejected"] += 1  # not what we asked for (late or foreign)
                continue
            del pending[slot]
            if self._direct and (token := self._direct.pop(slot, None)) is not None:
                was_direct[slot] = token
            if not ok:
                self._on_failed_fill(slot)
                continue
            self._consecutive_failures = 0
            slots.append(slot)
            reqs.append(req)
        if not slots:
            return
        matches = self._headers.check(slots, generation, reqs, self.payload_bytes)
        if all(matches):
            self.counts["accepted"] += len(slots)
            self._ready.extend(zip(slots, [generation] * len(slots), reqs, strict=True))
        else:
            slots = [slot for slot, req, match in zip(slots, reqs, matches, strict=True)
                     if self._accept_or_refuse(slot, generation, req, match, notice=notice,
                                               direct=was_direct.get(slot))]
        if notice and self.direct_requests:
            self._note_lanes(slots, lane)

    def _note_lanes(self, slots: list[int], lane: tuple[str, str] | None) -> None:
        """Remember where to ask for ``slots`` next: the lane of the worker that filled
        them, when this process can see that worker run (else nobody could tell that it
        died holding a DIRECT); no lane after a fill that named none (fan-out)."""
        if lane is not None:
            visible = self._visible.get(lane[1])
            if visible is None:
                if len(self._visible) >= MAX_KNOWN_PROCESSES:
                    self._visible.clear()
                visible = self._visible[lane[1]] = process_alive(lane[1]) is True
            if visible:
                self._lanes.update(dict.fromkeys(slots, lane))
                return
        for slot in slots:
            self._lanes.pop(slot, None)

    def _on_failed_fill(self, slot: int) -> None:
        """A worker could not fill the slot: ask again, backing off while failures persist."""
        self.counts["failed"] += 1
        self._consecutive_failures += 1
        n = self._consecutive_failures
        if n >= MAX_CONSECUTIVE_FAILURES:
            raise RuntimeError(f"{self.peer_id}: workers failed {n} fills in a row; their logs say why "
                               "(generator errors, or a segment they cannot map)")
        if n >= FAILURES_BEFORE_BACKOFF:
            if time.monotonic() - self._failure_logged > 5:
                self._failure_logged = time.monotonic()
                log.warning("%s: %d fills in a row failed (see the worker logs); retrying with back-off",
                            self.peer_id, n)
            time.sleep(min(BACKOFF_MAX_S, 0.001 * 2 ** (n - FAILURES_BEFORE_BACKOFF)))
        self._queue_request(slot)

    def _accept_or_refuse(self, slot: int, generation: int, req: int, match: bool, *,
                          notice: bool = False, direct: str | None = None) -> bool:
        """One completed slot, its header already compared: the slow check (checksum,
        and the reason to log) decides when the quick one did not accept it. A refused
        ``notice`` leaves the slot pending (see ``_on_complete``), and with the worker
        it went to by DIRECT (``direct``: its process token). True when accepted."""
        problem = None if match else check_slot(self.medium.slot_view(slot), generation, req,
                                                self.payload_bytes)
        if problem is not None and notice:
            self._pending[slot] = req
            if direct is not None:  # its worker may still be writing it
                self._direct[slot] = direct
            self.counts["rejected"] += 1
            self._refusals.warning("%s: notice for slot %d ignored (%s); it stays pending", self.peer_id,
                                   slot, problem)
            return False
        if problem is not None and self._data_sock is not None and slot not in self._awaiting \
                and self._headers.request_id(slot) == 0:  # header never written: data on its way
            self._awaiting[slot] = (generation, req, time.monotonic() + DATA_WAIT_S)
            return False
        self._awaiting.pop(slot, None)
        if problem is not None:
            self.counts["rejected"] += 1
            log.warning("%s: slot %d refused: %s", self.peer_id, slot, problem)
            self._queue_request(slot)
            return False
        self.counts["accepted"] += 1
        self._ready.append((slot, generation, req))
        return True

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
            waiting = self._awaiting.get(slot)
            if waiting is not None:
                self._accept_or_refuse(slot, waiting[0], waiting[1], False)

    def _expected_request(self, slot: int) -> int | None:
        waiting = self._awaiting.get(slot)
        return waiting[1] if waiting is not None else self._pending.get(slot)

    def _expire_awaiting(self) -> None:
        now = time.monotonic()
        for slot in [s for s, (_, _, deadline) in self._awaiting.items() if deadline < now]:
            del self._awaiting[slot]
            self.counts["rejected"] += 1
            log.warning("%s: slot %d completed but its data never came in %.0fs; asking again",
                        self.peer_id, slot, DATA_WAIT_S)
            self._queue_request(slot)

    def _on_declined(self, rows: list[list[int]], reason: str) -> None:
        """A worker will not fill these DIRECT slots: the broker gets them, same request ids."""
        for slot, req in rows:
            if self._late and self._settle_late(slot, req):
                continue
            if self._pending.get(slot) == req and self._direct.pop(slot, None) is not None:
                self._lanes.pop(slot, None)
                self._to_request.append(slot)
                self.counts["declined"] += 1
        log.debug("%s: %d direct request(s) declined: %s", self.peer_id, len(rows), reason)

    def _beat_checks(self) -> None:
        """What waits on other processes, looked at once per heartbeat interval (each needs
        a system call per slot or writer): quarantined slots, DIRECT slots, our inbox."""
        self._checked = time.monotonic()
        if self._quarantined:
            self._check_quarantine()
        if self._direct:
            self._check_direct()
        if self.direct_requests:
            self._check_inbox()

    def _check_inbox(self) -> None:
        """Bind our inbox again if its file vanished: workers keep answers to DIRECT
        requests for a while, and would lose them otherwise."""
        if self._inbox.present():
            return
        self._take_notices()  # what reached the old socket
        self._poller.unregister(self._inbox.fileno())
        self._inbox.close()
        self._inbox = NoticeInbox.open(self.medium.buf_name, self._notice_dir)
        if self._inbox is None:  # cannot: notices go through the broker from now on
            log.warning("%s: inbox vanished and could not be bound again; no direct notices", self.peer_id)
            self.direct_requests = False
            self._lanes.clear()
            return
        self._poller.register(self._inbox.fileno(), zmq.POLLIN)
        log.warning("%s: inbox %s vanished; bound it again", self.peer_id, self._inbox.path)

    def _check_direct(self) -> None:
        """Slots asked of a worker by DIRECT whose process is gone go to the broker, with
        the same request ids: nobody can write them any more."""
        alive: dict[str, bool] = {}
        for slot, process in list(self._direct.items()):
            if process not in alive:
                alive[process] = process_alive(process) is not False
            if not alive[process]:
                del self._direct[slot]
                self._lanes.pop(slot, None)
                self._to_request.append(slot)
        if not all(alive.values()):
            log.warning("%s: a worker holding direct requests is gone; asking the broker", self.peer_id)

    def _on_discarded(self, rows: list[list[int]]) -> None:
        for slot, req in rows:
            if self._pending.get(slot) == req:
                self.counts["discarded"] += 1
                self._queue_request(slot)

    def _on_refused(self, rows: list[list[int]], reason: str) -> None:
        """The broker is over a limit and did not queue these requests: back off, ask again."""
        again = [slot for slot, req in rows if self._pending.get(slot) == req]
        self.counts["refused"] += len(again)
        if time.monotonic() - self._failure_logged > 5:
            self._failure_logged = time.monotonic()
            log.warning("%s: broker refused %d request(s) (%s); asking again after a pause",
                        self.peer_id, len(again), reason)
        time.sleep(BACKOFF_MAX_S)
        self._to_request.extend(again)

    def _on_quarantine(self, rows: list[list[int]], process: str | None, *, direct: bool = False) -> None:
        """A worker declared dead may still write these slots: keep them out of use and
        ask for their samples in other slots; with ``direct``, also those we asked of it
        by DIRECT (the broker never saw them)."""
        if direct and process is not None:
            self._quarantine_direct(process)
        if not rows:
            return
        if process_alive(process) is None:
            # A process we cannot see (another machine, another pid namespace, or no
            # token at all) has not mapped our segment: over the network medium it
            # reaches our slots only through receive(), which takes data for pending
            # requests only. Ask again at once. (A worker in another pid namespace that
            # shares our /dev/shm is the one case this does not protect.)
            self._on_discarded(rows)
            return
        taken = 0
        for slot, req in rows:
            if self._pending.get(slot) == req:
                del self._pending[slot]
                self._quarantined[slot] = process
                self._reissue.append(req)
                taken += 1
        if taken:
            self.counts["quarantined"] += taken
            log.warning("%s: %d slot(s) quarantined: their worker stopped answering and may still "
                        "write them; %d of %d slots left in use", self.peer_id, taken,
                        len(self._headers) - len(self._quarantined), len(self._headers))
            self._reissue_now()

    def _quarantine_direct(self, process: str) -> None:
        """Slots held by DIRECT at a worker the broker gave up on: out of use until that
        worker answers them late (``_settle_late``) or its process is gone; their samples
        are asked for in other slots, and no more requests go to its lane."""
        held = []
        for slot in [slot for slot, token in self._direct.items() if token == process]:
            del self._direct[slot]
            req = self._pending.pop(slot, None)
            if req is not None:
                self._quarantined[slot] = process
                self._late[slot] = req
                self._reissue.append(req)
                held.append(slot)
        for slot in [slot for slot, lane in self._lanes.items() if lane[1] == process]:
            del self._lanes[slot]
        if held:
            self.counts["quarantined"] += len(held)
            log.warning("%s: %d slot(s) asked of a silent worker directly quarantined; %d of %d slots "
                        "left in use", self.peer_id, len(held), len(self._headers) - len(self._quarantined),
                        len(self._headers))
            self._reissue_now()

    def _settle_late(self, slot: int, req: int) -> bool:
        """A late answer (notice or DECLINED) of a worker to a DIRECT whose slot we had
        quarantined: that worker is done with the slot, which goes back into use (its
        sample was asked for elsewhere and is not used). True when it was one."""
        if self._late.get(slot) != req:
            return False
        self._unquarantine(slot)
        return True

    def _reissue_now(self) -> None:
        """Slots already free (never requested) can carry re-issued requests at once."""
        while self._reissue and self._free:
            self._queue_request(self._free.popleft())

    def _on_release(self, rows: list[list[int]]) -> None:
        """The worker's late DONE: it is done with these slots."""
        for slot, _req in rows:
            self._unquarantine(slot)

    def _unquarantine(self, slot: int) -> None:
        self._late.pop(slot, None)
        if self._quarantined.pop(slot, False) is not False:
            self.counts["released"] += 1
            self._queue_request(slot)

    def _check_quarantine(self) -> None:
        """Free quarantined slots whose writer process is gone."""
        for slot, process in list(self._quarantined.items()):
            if process_alive(process) is False:
                self._unquarantine(slot)

    def _check_refused(self) -> None:
        """A broker that refuses our key never answers: say so instead of waiting forever."""
        if self._heart.refusal is not None:
            raise PermissionError(f"{self.peer_id}: {self._heart.refusal}")

    def _check_broker(self) -> None:
        """After a broker restart (or it purged us) ask again for everything pending.

        Mere silence is only logged: asking twice for a slot that a worker may
        still be writing would let two writers race on it.
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
        log.warning("%s: the broker forgot us; asking again for %d pending slot(s)", self.peer_id,
                    len(self._pending))
        if self.on_rejoin is not None:
            self.on_rejoin()
        self._take_notices()  # answers already here settle their requests: those need no repeat
        self._drain()
        # The same request ids: a REQUEST of ours that was still on its way reaches the
        # new broker too, and the broker drops the repeat instead of filling a slot twice.
        # Slots a live worker holds by DIRECT were never the broker's: they stay with it.
        self._to_request.extend(s for s in self._pending if s not in self._direct)
        self.flush()

    def hello(self, rank: int, timeout_ms: float = CONTROL_TIMEOUT_MS) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_ms / 1000
        self._send(Command.HELLO, {"run_id": self.run_id, "peer_id": self.peer_id, "rank": rank}, deadline)
        while (left := deadline - time.monotonic()) > 0:
            self._check_refused()
            if self._sock.poll(min(left, 0.1) * 1000):
                try:
                    welcome = self._on_message(protocol.recv(self._sock))
                except ProtocolError as exc:
                    log.warning("bad message from broker: %s", exc.reason)
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


def _open_medium(kind: str, slot_count: int, stride: int, run_id: str,
                 tcp_host: str | None) -> SharedMemoryManager:
    """The consumer's slots: shared memory, or shared memory plus a TCP data socket."""
    if kind == "shm":
        return SharedMemoryManager(slot_count, stride, read_only=True, run_id=run_id)
    if kind == "tcp":
        return TcpMedium(slot_count, stride, run_id=run_id, host=tcp_host)
    raise ValueError(f"medium={kind!r}: choose one of {MEDIUMS} (pipeline.medium)")


class StudentClient:
    """The student of the seed README: owns slots, switches models (leader), follows (others)."""

    def __init__(self, student_rank: int, slot_count: int, batch_config: BatchConfig,
                 frontend_endpoint: str | None = None, control_endpoint: str | None = None,
                 control_pub_endpoint: str | None = None, *, run_id: str = DEFAULT_RUN,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_liveness: int = HEARTBEAT_LIVENESS, medium: str = "shm",
                 tcp_host: str | None = None, leader_epoch: int | None = None,
                 curve: CurveConfig | None = None, share_model: bool = False, notices: bool = True,
                 notice_dir: str | os.PathLike | None = None, direct_requests: bool = True) -> None:
        self.student_rank = student_rank
        # Fan-out opt-in: this run's slots may get samples the teacher made for other
        # runs of the same model (one teacher pass for a whole sweep; see broker.py).
        self.share_model = share_model
        # The newest leader of a run wins: a later start gets a larger epoch, so a
        # leader left over from an earlier incarnation of the job is refused.
        self.leader_epoch = time.time_ns() if leader_epoch is None else leader_epoch
        self._keys = curve.client_keys() if curve is not None else None
        self.batch_config = batch_config
        self.run_id = run_id
        self.frontend_endpoint = frontend_endpoint or default_endpoint("frontend")
        self.control_endpoint = control_endpoint or default_endpoint("control")
        self.control_pub_endpoint = control_pub_endpoint or default_endpoint("control_pub")
        self.generation_value = mp.Value("q", 0)
        self.model_id: str | None = None
        self._model_cfg: dict | None = None
        self._gen_lock = threading.Lock()
        self._pool = SlotPool(self.frontend_endpoint, run_id, slot_count, batch_config.nbytes(),
                              self._current_generation, self._note_generation,
                              heartbeat_interval_s=heartbeat_interval_s,
                              heartbeat_liveness=heartbeat_liveness, medium=medium, tcp_host=tcp_host,
                              curve=self._keys, notices=notices, notice_dir=notice_dir,
                              direct_requests=direct_requests)
        self._pool.on_rejoin = self._rejoin
        self._control_lock = threading.Lock()  # a restore never interleaves with a switch
        self._keeper: threading.Thread | None = None
        self._requested = False
        self._held: set[int] = set()
        self._sub_thread: threading.Thread | None = None
        self._sub_stop = threading.Event()
        self._generation_seen = threading.Condition()

    # ------------------------------------------------------------------ generation
    @property
    def generation(self) -> int:
        return self.generation_value.value

    def _current_generation(self) -> int:
        return self.generation_value.value

    def _note_generation(self, generation: int) -> None:
        """Raise the shared generation (never lower it: generations only move forward)."""
        with self._gen_lock, self.generation_value.get_lock():
            if generation > self.generation_value.value:
                self.generation_value.value = generation
        with self._generation_seen:
            self._generation_seen.notify_all()

    def wait_generation(self, generation: int, timeout_s: float = 30.0) -> int:
        """Block until this client knows ``generation`` (followers, after a DDP broadcast)."""
        deadline = time.monotonic() + timeout_s
        with self._generation_seen:
            while self.generation < generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"generation {generation} not seen in {timeout_s}s "
                                       "(is start_sub_listener() running?)")
                self._generation_seen.wait(min(left, 0.1))
        return self.generation

    # ------------------------------------------------------------------ API
    def hello(self) -> dict[str, Any]:
        """Register with the broker; learn the run's current model and generation."""
        welcome = self._pool.hello(self.student_rank)
        self._note_generation(welcome["generation"])
        self.model_id = welcome.get("model_id")
        return welcome

    def set_model(self, model_id: str, model_cfg: dict | None = None) -> int:
        """Leader only: switch every worker to ``model_id``; returns the new generation.

        When this returns, no sample of an older generation is yielded by this client
        or by datasets sharing its ``generation_value``.
        """
        if self.student_rank != 0:
            raise RuntimeError(f"rank {self.student_rank} is not the leader: only rank 0 switches the "
                               "model; other ranks call start_sub_listener() and wait_generation()")
        with self._control_lock:
            reply = self._control(Command.SET_MODEL, {"run_id": self.run_id, "model_id": model_id,
                                                      "model_cfg": model_cfg, **self._leader()})
            if reply.command is not Command.MODEL_SET:
                raise RuntimeError(f"broker refused SET_MODEL: {reply.body.get('reason')}")
            self._note_generation(reply.body["generation"])
            self.model_id = model_id
            self._model_cfg = model_cfg
        self._start_keeper()
        return reply.body["generation"]

    def stop_workers(self) -> None:
        """Ask the broker to publish STOP to every worker."""
        self._control(Command.STOP, {})

    def request_sample(self, timeout_ms: float = 1000) -> SampleRef | None:
        """The next filled slot of the current generation, or None after ``timeout_ms``."""
        if not self._requested:
            self._pool.request_free()
            self._requested = True
        got = self._pool.next_ready(timeout_ms)
        if got is None:
            return None
        slot, gen, req = got
        data, tensors = self._pool.slot_tensors(slot, self.batch_config)
        self._held.add(slot)
        return SampleRef(slot, gen, req, data, tensors)

    def release_slot(self, slot_id: int) -> None:
        """Give a slot back (its views become invalid) so it can be filled again."""
        if slot_id not in self._held:
            raise ValueError(f"slot {slot_id} is not held by this client")
        self._held.discard(slot_id)
        self._pool.release(slot_id)

    def start_sub_listener(self) -> None:
        """Followers: track the leader's model switches through the broker's PUB socket."""
        if self._sub_thread is not None:
            return
        ready = threading.Event()
        self._sub_thread = threading.Thread(target=self._listen, args=(ready,), daemon=True,
                                            name=f"sub-{self.student_rank}")
        self._sub_thread.start()
        ready.wait(5)

    def _listen(self, ready: threading.Event) -> None:
        ctx = zmq.Context.instance()
        sub = secure_client(protocol.configure(ctx.socket(zmq.SUB)), self._keys)
        sub.setsockopt(zmq.SUBSCRIBE, self.run_id.encode())
        sub.connect(self.control_pub_endpoint)
        ready.set()
        try:
            while not self._sub_stop.is_set():
                if not sub.poll(100):
                    continue
                try:
                    msg = protocol.recv_published(sub)
                except ProtocolError as exc:
                    log.warning("bad broadcast: %s", exc.reason)
                    continue
                if msg.command is Command.MODEL and msg.body["run_id"] == self.run_id:
                    self.model_id = msg.body["model_id"]
                    self._note_generation(msg.body["generation"])
        finally:
            sub.close(linger=0)

    def _control(self, command: Command, body: dict) -> protocol.Message:
        ctx = zmq.Context.instance()
        sock = secure_client(protocol.configure(ctx.socket(zmq.DEALER)), self._keys)
        watch = HandshakeWatch(sock) if self._keys is not None else None
        sock.connect(self.control_endpoint)
        try:
            protocol.send(sock, command, body)
            deadline = time.monotonic() + CONTROL_TIMEOUT_MS / 1000
            while not sock.poll(100):
                if watch is not None and (refusal := watch.refusal()) is not None:
                    raise PermissionError(f"{command.name} not delivered: {refusal}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to {command.name} from {self.control_endpoint}: "
                                       "is the broker running?")
            return protocol.recv(sock)
        finally:
            if watch is not None:
                watch.close()
            sock.close(linger=0)

    def _rejoin(self) -> None:
        """A restarted broker lost the run's model: the leader restores it."""
        with self._control_lock:
            if self.student_rank == 0 and self.model_id is not None:
                log.warning("restoring model %s (generation %d) on the broker", self.model_id,
                            self.generation)
                self._control(Command.SET_MODEL, {"run_id": self.run_id, "model_id": self.model_id,
                                                  "model_cfg": self._model_cfg,
                                                  "restore_generation": self.generation,
                                                  **self._leader()})

    def _start_keeper(self) -> None:
        """Leader: restore the model on a restarted broker even if this client never asks
        for samples itself (the app's ranks read through DataLoader workers, whose pools
        notice the restart but cannot restore a model they do not know)."""
        if self._keeper is not None or self.student_rank != 0:
            return
        self._keeper = threading.Thread(target=self._keep_model, daemon=True, name="model-keeper")
        self._keeper.start()

    def _keep_model(self) -> None:
        heart = self._pool._heart
        known = heart.broker_id
        while not self._sub_stop.wait(heart.interval_s):
            broker_id = heart.broker_id
            if broker_id == known:
                continue
            if known is not None:  # a new broker instance answers: it has no model for our run
                try:
                    self._rejoin()
                except TimeoutError as exc:
                    log.warning("%s; retrying at the next heartbeat", exc)
                    continue
            known = broker_id

    def _leader(self) -> dict[str, Any]:
        """What the leader declares with every SET_MODEL besides the model."""
        return {"leader_epoch": self.leader_epoch, "peer_id": self._pool.peer_id,
                "share_model": self.share_model}

    def close(self) -> None:
        self._sub_stop.set()
        for thread in (self._sub_thread, self._keeper):
            if thread is not None:
                thread.join(timeout=2)
        self._pool.close()

    def __enter__(self) -> StudentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
