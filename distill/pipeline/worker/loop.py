"""The worker: receives WORK (batches of slot addresses), fills the slots, says DONE.

Two ways to make samples:

- ``generator_fn(model_id, model_cfg) -> bytes`` — the seed README's per-sample
  function; its bytes are copied into the slot.
- ``batch_fn(model_id, model_cfg, targets)`` — the zero-copy path: one call per
  batch, with one :class:`SlotTarget` per slot whose ``tensors`` (needs
  ``batch_config``) or ``payload`` are writable views straight into the student's
  memory. A teacher runs one forward and copies each sample's output in place.
  It may return a ``finish`` callable instead of None: the copies are then still
  in flight (e.g. device-to-host on a CUDA side stream), and the worker commits the
  batch (calls ``finish``, writes the headers, says DONE) only after it has started
  the NEXT batch waiting on its socket, so the next forward overlaps this copy. With
  no batch waiting it finishes at once; a sample is never late by more than a batch.

The worker drains every WORK already waiting on its socket (up to ``max_batch``
slots of one model) before calling the generator, so small requests are batched.
A fan-out WORK (``runs``/``copies``, see ``protocol.py``) holds slots of several
runs of one model: the worker computes only the *source* items, copies each
source's payload into its copies' slots, and writes every header with its own
run's generation; a run whose generation is stale here gets no header ("stale"),
while its sources are still computed for the other runs that copy them.
The payload is written first and the slot header last (see ``slot.py``): all
headers of a batch at once, through one NumPy view of the segment's headers.
Students on this machine also ask the worker directly (``direct_requests``, see
``notices.py``): a DIRECT datagram on the worker's lane is filled like the WORK the
broker would have sent, with the model of the run's last plain WORK, and answered
with a notice; one the worker cannot fill as the broker would is declined. Broker
WORK comes first: while some waits, every DIRECT is declined.
Each slot's address is checked and its views are decoded once, the first time it
is filled, and the same tensor views serve every later fill of that slot: write
into them (``copy_``, indexing), never change them in place (``resize_``,
``unsqueeze_``, ...). Each ``SlotTarget.tensors`` dict is a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import CurveConfig, secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    Heartbeater,
    process_token,
)
from distill.pipeline.mediums.shm import SHM_DIR, attach_segment, is_our_name
from distill.pipeline.mediums.tcp import TcpSender, is_tcp_medium, parse_medium
from distill.pipeline.notices import (
    ANSWER_RETRY_S,
    Delivery,
    NoticeOutbox,
    RequestLane,
    encode_datagram,
    encode_notice,
)
from distill.pipeline.protocol import Command, Message, ProtocolError
from distill.pipeline.slot import (
    HEADER_BYTES,
    HeaderTable,
    SlotHeader,
    payload_checksum,
    write_header,
)
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

GeneratorFn = Callable[[str, dict | None], bytes]
MAX_ATTACHED_SEGMENTS = 256
MAX_QUEUED_DIRECT = 256
"""DIRECT requests a worker takes off its lane before filling them (more wait in the socket)."""
SEGMENT_RECHECK_S = 5.0


@dataclass
class SlotTarget:
    """One slot to fill: writable views into the student's memory (write into them;
    they are reused for the slot's next fill, so never reshape them in place)."""

    request_id: int
    generation: int
    payload: memoryview
    tensors: dict[str, torch.Tensor] | None


BatchFn = Callable[[str, dict | None, list[SlotTarget]], Callable[[], None] | None]
Deferred = Callable[[], None]
"""Completes a filled group whose payload copies are in flight: finish them, commit the headers."""


SlotViews = tuple[memoryview, dict[str, torch.Tensor] | None]


@dataclass
class _Segment:
    """An attached student segment, and what was made of it once per slot."""

    view: memoryview
    slots: dict[int, dict[int, SlotViews]] = field(default_factory=dict)
    """stride -> slot_idx -> the slot's payload view and decoded tensors."""
    tables: dict[int, HeaderTable] = field(default_factory=dict)
    """stride -> the header table of the segment cut in slots of that stride."""


@dataclass
class _Run:
    """Consecutive items of one WORK that go to one segment, cut with one stride."""

    work_id: int
    medium: str
    stride: int
    idxs: list[int] = field(default_factory=list)
    """Positions of the items in the WORK (what DONE.failed refers to)."""
    slot_idxs: list[int] = field(default_factory=list)
    targets: list[SlotTarget] = field(default_factory=list)
    staged: list[memoryview] | None = None
    """Network medium the worker cannot map: the whole staged slot of each target."""


class Worker:
    """Fills student slots on request (see module docstring)."""

    def __init__(self, generator_fn: GeneratorFn | None = None, slot_size: int | None = None,
                 backend_endpoint: str | None = None, control_pub_endpoint: str | None = None,
                 worker_id: int | str | None = None, *, batch_fn: BatchFn | None = None,
                 batch_config: BatchConfig | None = None, max_batch: int = 32,
                 prefetch_batches: int = 2, checksum: bool = False,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_liveness: int = HEARTBEAT_LIVENESS, local_shm: bool = True,
                 curve: CurveConfig | None = None, notify_students: bool = True,
                 notice_dir: str | os.PathLike | None = None, direct_requests: bool = True) -> None:
        if (generator_fn is None) == (batch_fn is None):
            raise ValueError("Worker needs exactly one of generator_fn= (per sample) or batch_fn= (batched)")
        if slot_size is None:
            if batch_config is None:
                raise ValueError("Worker needs slot_size= (bytes per sample) or batch_config=")
            slot_size = batch_config.nbytes()
        if batch_config is not None and batch_config.nbytes() != slot_size:
            raise ValueError(f"slot_size {slot_size} != batch_config.nbytes() {batch_config.nbytes()}")
        self.generator_fn = generator_fn
        self.batch_fn = batch_fn
        self.batch_config = batch_config
        self.slot_size = slot_size
        self.backend_endpoint = backend_endpoint or default_endpoint("backend")
        self.control_pub_endpoint = control_pub_endpoint or default_endpoint("control_pub")
        self.worker_id = worker_id if worker_id is not None else os.getpid()
        self.peer_id = f"worker-{self.worker_id}-{os.urandom(3).hex()}"
        self.max_batch = max_batch
        self.capacity = max_batch * prefetch_batches
        self.checksum = checksum
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self._keys = curve.client_keys() if curve is not None else None  # checked here, not in run()
        self._generation: dict[str, int] = {}
        self._model_id: str | None = None
        self._last_run = "default"
        self._segments: OrderedDict[str, _Segment] = OrderedDict()
        self._segments_checked = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples_written = 0
        self.samples_computed = 0
        """Samples the generator made (less than ``samples_written`` under fan-out)."""
        self.local_shm = local_shm
        """Write into a network medium's segment directly when it is on this machine."""
        self._sender = TcpSender()
        self.notify_students = notify_students
        """Tell students on this machine about filled slots directly (``notices.py``)."""
        self.notice_dir = notice_dir
        """Where those students' inboxes are (None: the default socket directory)."""
        self._outbox: NoticeOutbox | None = None
        self.direct_requests = direct_requests
        """Take DIRECT requests from students we notify, past the broker (``notices.py``)."""
        self._lane: RequestLane | None = None
        self._lane_name: str | None = None
        """The lane's path as notices name it (made once, not per notice)."""
        self._direct: deque[Message] = deque()
        """DIRECT requests taken off the lane, not yet filled or declined."""
        self._models: dict[str, tuple[int, str, dict | None]] = {}
        """run -> (generation, model id, model cfg) of its last plain WORK: what a DIRECT may ask for."""
        self._shared_runs: set[str] = set()
        """Runs opted in to fan-out: always through the broker, which shares their samples."""
        self._unsent: list[tuple[str, bytes, float]] = []
        """Answers to DIRECTs not delivered yet (inbox full or gone): (segment, datagram, give-up time)."""
        self._token = process_token()
        self.direct_filled = 0
        """Samples written for DIRECT requests (the broker never saw them)."""
        self._direct_counts: dict[str, tuple[int, int]] = {}
        """run -> (filled, failed) DIRECT slots so far, reported to the broker for its statistics."""
        self._heart: Heartbeater | None = None
        self._refusals = LogThrottle(log)
        self._deferred: tuple[list[Message], dict[int, dict[int, str]], Deferred] | None = None

    # ------------------------------------------------------------------ public API
    @property
    def generation(self) -> int:
        """Newest generation seen (of the last run served)."""
        return self._generation.get(self._last_run, 0)

    @property
    def model_id(self) -> str | None:
        return self._model_id

    def run(self) -> None:
        """Serve until STOP is published or :meth:`stop` is called (blocking)."""
        ctx = zmq.Context()
        sock = secure_client(protocol.configure(ctx.socket(zmq.DEALER)), self._keys)
        sock.setsockopt(zmq.ROUTING_ID, self.peer_id.encode())
        sock.setsockopt(zmq.SNDTIMEO, protocol.SEND_RETRY_MS)  # see _send
        sock.connect(self.backend_endpoint)
        sub = secure_client(protocol.configure(ctx.socket(zmq.SUB)), self._keys)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.control_pub_endpoint)
        heart = Heartbeater(self.backend_endpoint, self.peer_id, "worker", interval_s=self.heartbeat_interval_s,
                            liveness=self.heartbeat_liveness, keys=self._keys, extra=self._direct_report).start()
        self._heart = heart
        self._outbox = NoticeOutbox(self.notice_dir) if self.notify_students else None
        if self._outbox is not None and self.direct_requests:
            self._lane = RequestLane.open(self.peer_id, self.notice_dir)
            self._lane_name = None if self._lane is None else os.fspath(self._lane.path)
        try:
            self._serve(sock, sub, heart)
        finally:
            self._shut_lane()
            if self._outbox is not None:
                self._outbox.close()
            heart.stop()
            with contextlib.suppress(zmq.Again):  # no route to the broker (refused key): skip BYE
                protocol.send(sock, Command.BYE, {"peer_id": self.peer_id})
            sock.close(linger=100)
            sub.close(linger=0)
            ctx.term()
            self._close_segments()
            self._sender.close()
            log.info("worker %s stopped after %d samples", self.peer_id, self.samples_written)

    def start(self) -> Worker:
        self._thread = threading.Thread(target=self.run, name=f"worker-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ loop
    def _serve(self, sock: zmq.Socket, sub: zmq.Socket, heart: Heartbeater) -> None:
        self._ready(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        lane = self._lane.fileno() if self._lane is not None else None
        if lane is not None:
            poller.register(lane, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                busy = self._direct or self._unsent
                events = dict(poller.poll(0 if self._direct else 10 if busy else self.heartbeat_interval_s * 1000))
                if sub in events and self._on_published(sub):
                    return
                if sock in events:
                    self._process(self._collect_work(sock), sock)
                if lane in events or self._direct:
                    self._serve_direct(sock)
                if self._unsent:
                    self._retry_unsent()
                if heart.refusal is not None:  # the broker will never answer: stop with the reason
                    raise PermissionError(f"worker {self.peer_id}: {heart.refusal}")
                if heart.forgotten.is_set() or not heart.broker_alive:
                    self._rejoin(sock, heart)
                self._maybe_drop_segments()
        finally:
            self._finish_deferred(sock)

    def _send(self, sock: zmq.Socket, command: Command, body: dict) -> None:
        """Send to the broker, raising rather than blocking forever when it refuses our key
        (ZeroMQ then has no route for the message); given up when we are stopping."""
        def go_on() -> bool:
            if self._heart is not None and self._heart.refusal is not None:
                raise PermissionError(f"worker {self.peer_id}: {self._heart.refusal}")
            return not self._stop.is_set()
        protocol.send_patiently(sock, command, body, go_on)

    def _ready(self, sock: zmq.Socket) -> None:
        # The process token lets a student whose slots we hold see when we are gone.
        self._send(sock, Command.READY, {"peer_id": self.peer_id, "credit": self.capacity,
                                         "max_batch": self.max_batch, "process": self._token,
                                         **self._direct_report()})

    def _direct_report(self) -> dict:
        """DIRECT fills so far, for READY and every heartbeat (the heartbeat thread reads
        it: the counts are replaced, never changed in place, so a copy is consistent)."""
        counts = dict(self._direct_counts)
        return {"direct": {run_id: list(c) for run_id, c in counts.items()}} if counts else {}

    def _rejoin(self, sock: zmq.Socket, heart: Heartbeater) -> None:
        forgotten = heart.forgotten.is_set()
        log.warning("worker %s: broker %s; registering again", self.peer_id,
                    "forgot us" if forgotten else "silent")
        heart.forgotten.clear()
        heart.last_heard = time.monotonic()
        if forgotten:
            self._give_back_queued(sock)
        self._ready(sock)

    def _give_back_queued(self, sock: zmq.Socket) -> None:
        """WORK still queued here was handed out before the broker forgot us (it
        restarted, or declared us dead). Its slots may be asked for again by then, so
        writing them now could race another worker: answer DONE without writing."""
        while protocol.readable(sock):
            try:
                msg = protocol.recv(sock)
            except ProtocolError:
                continue
            if msg.command is Command.WORK:
                items = len(msg.body["items"])
                self._send(sock, Command.DONE, {
                    "peer_id": self.peer_id, "work_id": msg.body["work_id"], "num_items": items,
                    "failed": [[idx, "stale"] for idx in range(items)],
                })

    def _on_published(self, sub: zmq.Socket) -> bool:
        """Apply a MODEL or STOP broadcast; True when the worker must stop."""
        try:
            msg = protocol.recv_published(sub)
        except ProtocolError as exc:
            log.warning("bad broadcast: %s", exc.reason)
            return False
        if msg.command is Command.STOP:
            return msg.body.get("run_id") is None
        if msg.command is Command.MODEL:
            self._note_generation(msg.body["run_id"], msg.body["generation"], msg.body["model_id"])
        return False

    def _note_generation(self, run_id: str, generation: int, model_id: str) -> None:
        if generation >= self._generation.get(run_id, 0):
            self._generation[run_id] = generation
            self._model_id = model_id
            self._last_run = run_id

    def _collect_work(self, sock: zmq.Socket) -> list[Message]:
        """The WORK waiting on the socket, up to about ``max_batch`` slots."""
        works, slots = [], 0
        while slots < self.max_batch and protocol.readable(sock):
            try:
                msg = protocol.recv(sock)
            except ProtocolError as exc:
                self._refusals.warning("worker %s: refused message from broker: %s", self.peer_id,
                                       exc.reason)
                self._send(sock, Command.ERROR, {"reason": exc.reason[:protocol.MAX_STRING_CHARS]})
                continue
            if msg.command is Command.WORK:
                works.append(msg)
                slots += len(msg.body["items"])
            elif msg.command is Command.ERROR:
                log.warning("broker error: %s", msg.body["reason"])
            else:
                reason = f"command {msg.command.name} not accepted by a worker"
                log.warning("worker %s: %s", self.peer_id, reason)
                self._send(sock, Command.ERROR, {"reason": reason, "command": msg.command.name})
        return works

    # ------------------------------------------------------------------ filling
    def _process(self, works: list[Message], sock: zmq.Socket) -> None:
        shared = [[work] for work in works if work.body.get("runs") is not None]
        plain = [work for work in works if work.body.get("runs") is None]
        for group in shared:  # fan-out WORKs: filled and committed at once
            self._finish_deferred(sock)
            self._send_done(sock, group, self._fill_shared(group[0].body))
        for group in _group_by_model(plain):
            failed, deferred = self._fill_group(group)
            self._finish_deferred(sock)  # the previous group's copies ran during this group's fill
            if deferred is None:
                self._send_done(sock, group, failed)
            else:
                self._deferred = group, failed, deferred
        if self._deferred is not None and not protocol.readable(sock) and not self._direct_waiting():
            self._finish_deferred(sock)  # no next batch to overlap with: finish now

    def _finish_deferred(self, sock: zmq.Socket) -> None:
        """Commit the group whose copies were left in flight, and say DONE."""
        if self._deferred is None:
            return
        group, failed, deferred = self._deferred
        self._deferred = None
        deferred()
        self._send_done(sock, group, failed)

    def _send_done(self, sock: zmq.Socket, group: list[Message], failed: dict[int, dict[int, str]]) -> None:
        for work in group:
            body = work.body
            failures = failed.get(body["work_id"], {})
            if work.command is Command.DIRECT:
                self._answer_direct(body, failures)
                continue
            done = {"peer_id": self.peer_id, "work_id": body["work_id"], "num_items": len(body["items"]),
                    "failed": [[idx, why] for idx, why in sorted(failures.items())]}
            notified = self._notify(body, failures) if self._outbox is not None else []
            if notified:
                done["notified"] = notified
            self._send(sock, Command.DONE, done)

    def _notify(self, body: dict, failures: dict[int, str]) -> list[str]:
        """Tell the students whose shared memory we filled, straight to their inboxes
        (``notices.py``), before DONE reaches the broker. Returns the segments every
        notice reached: the broker completes the others."""
        rows: dict[tuple[str, int], list[list]] = {}
        for idx, generation, (medium, slot_idx, _stride, request_id) in _with_generations(body):
            if idx not in failures and medium in self._segments and not is_tcp_medium(medium):
                rows.setdefault((medium, generation), []).append([slot_idx, request_id, True])
        # Not for a run opted in to fan-out: its slots must keep going through the broker,
        # which is what lets one teacher pass serve several runs.
        shared = body.get("runs") is not None or body.get("shared")
        lane = None if shared else self._lane_name
        reached, missed = set(), set()
        for (medium, generation), slots in rows.items():
            (reached if self._outbox.send(medium, generation, slots, lane, self._token) else missed).add(medium)
        return sorted(reached - missed)

    def _fill_group(self, group: list[Message]) -> tuple[dict[int, dict[int, str]], Deferred | None]:
        """Fill every slot of WORKs of one (run, generation, model). Returns failures, and
        the commit still to do when the batch function left its copies in flight."""
        first = group[0].body
        run_id, generation, model_id = first["run_id"], first["generation"], first["model_id"]
        failed: dict[int, dict[int, str]] = {}
        if generation < self._generation.get(run_id, 0):
            for work in group:
                failed[work.body["work_id"]] = dict.fromkeys(range(len(work.body["items"])), "stale")
            return failed, None
        self._note_generation(run_id, generation, model_id)
        if group[0].command is Command.WORK:
            self._models[run_id] = (generation, model_id, first.get("model_cfg"))
            (self._shared_runs.add if first.get("shared") else self._shared_runs.discard)(run_id)
        runs: list[_Run] = []
        for work in group:
            self._add_targets(work.body, generation, runs, failed)
        targets = [target for run in runs for target in run.targets]
        if targets:
            return failed, self._generate(model_id, first.get("model_cfg"), targets, runs, failed)
        return failed, None

    def _add_targets(self, body: dict, generation: int, runs: list[_Run],
                     failed: dict[int, dict[int, str]], start: int = 0, stop: int | None = None) -> None:
        """A target for every item of one WORK (or of its items start:stop), grouped in
        runs; bad addresses fail."""
        work_id, run, cached_slots = body["work_id"], None, {}
        for idx, (medium, slot_idx, stride, request_id) in enumerate(body["items"][start:stop], start):
            if run is None or medium != run.medium or stride != run.stride:
                run = _Run(work_id, medium, stride)
                runs.append(run)
                cached_slots = self._cached_slots(medium, stride)
            views = cached_slots.get(slot_idx)
            if views is None:
                try:
                    views = self._slot(medium, slot_idx, stride, run)
                except (OSError, ValueError, IndexError, PermissionError) as exc:
                    self._refusals.warning("worker %s: cannot write slot %d of %r: %s", self.peer_id,
                                           slot_idx, medium, exc)
                    failed.setdefault(work_id, {})[idx] = f"bad address: {exc}"[:200]
                    continue
                cached_slots = self._cached_slots(medium, stride)  # the segment may be new
            payload, tensors = views
            run.idxs.append(idx)
            run.slot_idxs.append(slot_idx)
            run.targets.append(SlotTarget(request_id, generation, payload,
                                          None if tensors is None else dict(tensors)))

    def _cached_slots(self, medium: str, stride: int) -> dict[int, SlotViews]:
        """The slots of a segment already checked and decoded for ``stride`` (or none)."""
        segment = self._segments.get(medium)
        return {} if segment is None else segment.slots.get(stride, {})

    def _slot(self, medium: str, slot_idx: int, stride: int, run: _Run | None = None) -> SlotViews:
        """Check a slot's address, decode its views, and remember them."""
        if stride < HEADER_BYTES + self.slot_size:
            raise ValueError(f"stride {stride} < header + slot_size {HEADER_BYTES + self.slot_size}")
        if run is not None and is_tcp_medium(medium) and self._sender.is_remote(medium, self.local_shm):
            return self._stage(run, stride)
        segment = self._segment(medium, stride)
        start = slot_idx * stride
        if start + stride > len(segment.view):
            raise IndexError(f"slot {slot_idx} x stride {stride} is outside the "
                             f"{len(segment.view)}-byte segment")
        payload = segment.view[start + HEADER_BYTES:start + HEADER_BYTES + self.slot_size]
        tensors = self.batch_config.decode(payload) if self.batch_config and self.batch_fn else None
        segment.slots.setdefault(stride, {})[slot_idx] = payload, tensors
        return payload, tensors

    def _stage(self, run: _Run, stride: int) -> SlotViews:
        """Views into a fresh staging buffer for a slot sent over the network medium."""
        buf = self._sender.stage(stride)
        if run.staged is None:
            run.staged = []
        run.staged.append(buf)
        payload = buf[HEADER_BYTES:HEADER_BYTES + self.slot_size]
        return payload, self.batch_config.decode(payload) if self.batch_config and self.batch_fn else None

    def _generate(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget],
                  runs: list[_Run], failed: dict[int, dict[int, str]]) -> Deferred | None:
        """Fill the targets and commit them, or return the commit when copies are in flight."""
        finish = None
        try:
            if self.batch_fn is not None:
                finish = self.batch_fn(model_id, model_cfg, targets)
                lengths = [self.slot_size] * len(targets)
            else:
                lengths = [self._generate_one(model_id, model_cfg, t) for t in targets]
        except Exception as exc:  # a generator bug must not kill the worker
            log.exception("worker %s: generator failed for model %s", self.peer_id, model_id)
            _fail_runs(runs, failed, f"generator failed: {exc!r}")
            return None
        self.samples_computed += len(targets)
        if callable(finish):
            return lambda: self._finish_and_commit(finish, model_id, runs, lengths, failed)
        self._commit_runs(runs, lengths, failed)
        return None

    def _finish_and_commit(self, finish: Callable[[], None], model_id: str, runs: list[_Run],
                           lengths: list[int], failed: dict[int, dict[int, str]]) -> None:
        try:
            finish()
        except Exception as exc:  # a failed copy fails its slots, not the worker
            log.exception("worker %s: finishing a batch of model %s failed", self.peer_id, model_id)
            _fail_runs(runs, failed, f"generator failed: {exc!r}")
            return
        self._commit_runs(runs, lengths, failed)

    def _commit_runs(self, runs: list[_Run], lengths: list[int], failed: dict[int, dict[int, str]]) -> None:
        start = 0
        for run in runs:
            self._commit(run, lengths[start:start + len(run.targets)], failed)
            start += len(run.targets)

    def _generate_one(self, model_id: str, model_cfg: dict | None, target: SlotTarget) -> int:
        data = self.generator_fn(model_id, model_cfg)
        if len(data) > len(target.payload):
            log.error("generator returned %d bytes; slot_size is %d", len(data), len(target.payload))
            return -1
        target.payload[:len(data)] = data
        return len(data)

    def _commit(self, run: _Run, lengths: list[int], failed: dict[int, dict[int, str]]) -> None:
        """Write the headers of a run's filled slots (their payloads are in place)."""
        slot_idxs, targets = run.slot_idxs, run.targets
        if not targets:  # every item of the run had a bad address
            return
        if min(lengths) < 0:  # a generator_fn sample that did not fit: that slot fails
            kept = [i for i, length in enumerate(lengths) if length >= 0]
            for i in sorted(set(range(len(lengths))) - set(kept)):
                failed.setdefault(run.work_id, {})[run.idxs[i]] = "sample larger than the slot"
            slot_idxs, targets = [slot_idxs[i] for i in kept], [targets[i] for i in kept]
            lengths = [lengths[i] for i in kept]
            if run.staged is not None:
                run.staged = [run.staged[i] for i in kept]
        if not slot_idxs:
            return
        if run.staged is not None:
            self._send_staged(run, slot_idxs, targets, lengths, failed)
            return
        segment = self._segments[run.medium]
        self._segments.move_to_end(run.medium)  # least recently used segments are unmapped first
        table = segment.tables.get(run.stride)
        if table is None:
            table = segment.tables[run.stride] = HeaderTable(segment.view[:], run.stride)
        checksums = ([payload_checksum(target.payload[:length])
                      for target, length in zip(targets, lengths, strict=True)] if self.checksum else None)
        table.write(slot_idxs, targets[0].generation, [target.request_id for target in targets], lengths,
                    checksums)
        self.samples_written += len(slot_idxs)

    def _send_staged(self, run: _Run, slot_idxs: list[int], targets: list[SlotTarget],
                     lengths: list[int], failed: dict[int, dict[int, str]]) -> None:
        """Commit staged slots (header last, as in shared memory) and send them."""
        for buf, target, length in zip(run.staged, targets, lengths, strict=True):
            checksum = payload_checksum(target.payload[:length]) if self.checksum else None
            write_header(buf, SlotHeader(target.generation, target.request_id, length, checksum))
        problem = self._sender.send(run.medium, targets[0].generation, run.stride,
                                    [[slot_idx, t.request_id] for slot_idx, t in zip(slot_idxs, targets, strict=True)],
                                    run.staged)
        if problem is not None:
            log.warning("worker %s: %s", self.peer_id, problem)
            failed.setdefault(run.work_id, {}).update(dict.fromkeys(run.idxs, problem[:200]))
            return
        self.samples_written += len(slot_idxs)

    # ------------------------------------------------------------------ direct requests
    def _serve_direct(self, sock: zmq.Socket) -> None:
        """Fill DIRECT requests (up to about ``max_batch`` slots per call), or decline
        them all while broker WORK waits: the broker's students keep their share."""
        if self._lane is not None and len(self._direct) < MAX_QUEUED_DIRECT:
            for msg in self._lane.receive(MAX_QUEUED_DIRECT - len(self._direct)):
                if is_our_name(msg.body["medium"]):  # else there is no student inbox to answer
                    self._direct.append(msg)
                else:
                    self._refusals.warning("worker %s: direct request for %r dropped: not a segment of ours",
                                           self.peer_id, msg.body["medium"][:64])
        if protocol.readable(sock):
            while self._direct:
                self._decline(self._direct.popleft().body, "the worker has broker work waiting")
            return
        works, slots = [], 0
        while self._direct and slots < self.max_batch:
            body = self._direct.popleft().body
            room = self.max_batch - slots
            if len(body["slots"]) > room:  # the rest waits: a batch is at most max_batch slots
                self._direct.appendleft(Message(Command.DIRECT, {**body, "slots": body["slots"][room:]}))
                body = {**body, "slots": body["slots"][:room]}
            work = self._direct_work(body, len(works))
            if work is not None:
                works.append(work)
                slots += len(work.body["items"])
        if works:
            self._process(works, sock)

    def _direct_work(self, body: dict, number: int) -> Message | None:
        """A DIRECT as the WORK the broker would have sent (``work_id`` -1 - ``number``:
        unique in its batch, never a broker's); None (declined) when this worker cannot
        fill it as the broker would."""
        run_id, generation = body["run_id"], body["generation"]
        model = self._models.get(run_id)
        why = ("no WORK of this run seen" if model is None
               else "fan-out run" if run_id in self._shared_runs
               else "network medium" if is_tcp_medium(body["medium"])
               else "another generation" if model[0] != generation or generation < self._generation.get(run_id, 0)
               else None)
        if why is not None:
            self._decline(body, why)
            return None
        medium, stride = body["medium"], body["stride"]
        return Message(Command.DIRECT, {
            "work_id": -1 - number, "run_id": run_id, "generation": generation, "model_id": model[1],
            "model_cfg": model[2], "medium": medium,
            "items": [[medium, slot_idx, stride, request_id] for slot_idx, request_id in body["slots"]]})

    def _direct_waiting(self) -> bool:
        """A DIRECT is queued here or on the lane (a batch to overlap a deferred commit with)."""
        if self._direct:
            return True
        return self._lane is not None and bool(select.select([self._lane.fileno()], [], [], 0)[0])

    def _answer_direct(self, body: dict, failures: dict[int, str]) -> None:
        """Notify the student of a filled DIRECT (its failed slots too: no broker will);
        slots found stale are declined, so the student asks the broker."""
        slots, stale = [], []
        for idx, (_medium, slot_idx, _stride, request_id) in enumerate(body["items"]):
            why = failures.get(idx)
            if why == "stale":
                stale.append([slot_idx, request_id])
            else:
                slots.append([slot_idx, request_id, why is None])
        filled = sum(1 for row in slots if row[2])
        self.direct_filled += filled
        done, failed = self._direct_counts.get(body["run_id"], (0, 0))
        self._direct_counts[body["run_id"]] = (done + filled, failed + len(slots) - filled)
        if stale:
            self._decline({**body, "slots": stale}, "another generation")
        if slots:
            self._post(body["medium"], encode_notice(body["generation"], slots, self._lane_name, self._token))

    def _decline(self, body: dict, why: str) -> None:
        self._post(body["medium"], encode_datagram(Command.DECLINED, {
            "generation": body["generation"], "slots": body["slots"], "reason": why}))

    def _post(self, segment: str, data: bytes, give_up: float | None = None) -> None:
        """Send an answer to a DIRECT; kept and sent again for ``ANSWER_RETRY_S`` while it
        cannot be delivered (see ``notices.py``)."""
        if self._outbox is None:
            return
        delivery = self._outbox.post(segment, data)
        if delivery is Delivery.SENT or (delivery is Delivery.GONE and not _segment_exists(segment)):
            return  # sent, or its student is gone (it unlinks its segment after its inbox)
        now = time.monotonic()
        give_up = now + ANSWER_RETRY_S if give_up is None else give_up
        if now < give_up:
            self._unsent.append((segment, data, give_up))
        else:
            log.info("worker %s: gave up answering a direct request of %s (its inbox is gone)",
                     self.peer_id, segment)

    def _retry_unsent(self) -> None:
        unsent, self._unsent = self._unsent, []
        for segment, data, give_up in unsent:
            self._post(segment, data, give_up)

    def _shut_lane(self) -> None:
        """Stopping: decline every DIRECT still queued (here or on the lane), and try
        once more for answers that could not be sent (a full inbox may have room now)."""
        if self._lane is None:
            return
        self._direct.extend(self._lane.shut())
        self._lane = self._lane_name = None
        while self._direct:
            self._decline(self._direct.popleft().body, "the worker is stopping")
        deadline = time.monotonic() + 0.2  # short: a student that is gone makes us wait it all
        while self._unsent and time.monotonic() < deadline:
            self._retry_unsent()
            if self._unsent:
                time.sleep(0.01)

    # ------------------------------------------------------------------ fan-out
    def _fill_shared(self, body: dict) -> dict[int, dict[int, str]]:
        """Fill a fan-out WORK: compute its sources once, copy them into their copies,
        commit the slots of runs whose generation is current. Returns failures."""
        work_id = body["work_id"]
        try:
            sources = _shared_sources(body)
        except ProtocolError as exc:
            log.warning("worker %s: %s", self.peer_id, exc.reason)
            return {work_id: dict.fromkeys(range(len(body["items"])), exc.reason[:200])}
        failed: dict[int, dict[int, str]] = {}
        runs, live = self._shared_targets(body, failed)
        where = {idx: target for run in runs for idx, target in zip(run.idxs, run.targets, strict=True)}
        needed = sorted({sources.get(idx, idx) for run in live for idx in run.idxs} & where.keys())
        try:
            lengths = self._make(body["model_id"], body.get("model_cfg"), [where[i] for i in needed])
        except Exception as exc:  # a generator bug must not kill the worker
            log.exception("worker %s: generator failed for model %s", self.peer_id, body["model_id"])
            for run in live:
                failed.setdefault(work_id, {}).update(dict.fromkeys(run.idxs, f"generator failed: {exc!r}"[:200]))
            return failed
        self.samples_computed += len(needed)
        made = dict(zip(needed, lengths, strict=True))
        for run in live:
            self._commit_copies(run, sources, where, made, failed)
        return failed

    def _shared_targets(self, body: dict, failed: dict[int, dict[int, str]]) -> tuple[list[_Run], list[_Run]]:
        """Targets of every group of a fan-out WORK, and the runs of those whose
        generation is current (the others' items fail as "stale")."""
        runs: list[_Run] = []
        live: list[_Run] = []
        start = 0
        for run_id, generation, count in body["runs"]:
            first = len(runs)
            self._add_targets(body, generation, runs, failed, start, start + count)
            if generation < self._generation.get(run_id, 0):
                failed.setdefault(body["work_id"], {}).update(dict.fromkeys(range(start, start + count), "stale"))
            else:
                self._note_generation(run_id, generation, body["model_id"])
                self._shared_runs.add(run_id)
                live.extend(runs[first:])
            start += count
        return runs, live

    def _make(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> list[int]:
        """Generate into ``targets``; the payload length of each (-1: did not fit)."""
        if not targets:
            return []
        if self.batch_fn is not None:
            finish = self.batch_fn(model_id, model_cfg, targets)
            if callable(finish):  # copies in flight: the copies below read these payloads
                finish()
            return [self.slot_size] * len(targets)
        return [self._generate_one(model_id, model_cfg, t) for t in targets]

    def _commit_copies(self, run: _Run, sources: dict[int, int], where: dict[int, SlotTarget],
                       made: dict[int, int], failed: dict[int, dict[int, str]]) -> None:
        """Copy each copy's source payload into its slot, then commit the run's slots."""
        keep, lengths = [], []
        for pos, idx in enumerate(run.idxs):
            source = sources.get(idx, idx)
            length = made.get(source)
            if length is None:  # its source's address was bad
                failed.setdefault(run.work_id, {})[idx] = "source sample not made"
                continue
            if source != idx and length > 0:
                run.targets[pos].payload[:length] = where[source].payload[:length]
            keep.append(pos)
            lengths.append(length)
        if len(keep) < len(run.idxs):
            run = _keep(run, keep)
        self._commit(run, lengths, failed)

    # ------------------------------------------------------------------ segments
    def _segment(self, name: str, stride: int) -> _Segment:
        segment = self._segments.get(name)
        if segment is None:
            mapping = attach_segment(_segment_name(name), stride)
            segment = self._segments[name] = _Segment(memoryview(mapping))
            while len(self._segments) > MAX_ATTACHED_SEGMENTS:
                self._forget_segment(next(iter(self._segments)))
        self._segments.move_to_end(name)
        return segment

    def _maybe_drop_segments(self) -> None:
        """Unmap segments whose owner unlinked them, so their memory can be freed."""
        if time.monotonic() - self._segments_checked < SEGMENT_RECHECK_S or self._deferred is not None:
            return  # (a batch still to commit may write to any of them)
        self._segments_checked = time.monotonic()
        for name in [n for n in self._segments if not _segment_exists(_segment_name(n))]:
            self._forget_segment(name)

    def _forget_segment(self, name: str) -> None:
        segment = self._segments.pop(name)
        segment.slots.clear()
        segment.tables.clear()
        mapping = segment.view.obj
        segment.view.release()
        with contextlib.suppress(BufferError):  # a tensor view is still alive: it keeps the map
            mapping.close()

    def _close_segments(self) -> None:
        for name in list(self._segments):
            self._forget_segment(name)


def _segment_name(medium: str) -> str:
    """The shared-memory segment behind a medium name (a network medium's, mapped locally)."""
    return parse_medium(medium).segment if is_tcp_medium(medium) else medium


def _segment_exists(segment: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, segment))


def _fail_runs(runs: list[_Run], failed: dict[int, dict[int, str]], why: str) -> None:
    for run in runs:
        failed.setdefault(run.work_id, {}).update(dict.fromkeys(run.idxs, why[:200]))


def _group_by_model(works: list[Message]) -> list[list[Message]]:
    groups: dict[tuple[str, int, str], list[Message]] = {}
    for work in works:
        b = work.body
        groups.setdefault((b["run_id"], b["generation"], b["model_id"]), []).append(work)
    return list(groups.values())


def _with_generations(body: dict) -> Iterator[tuple[int, int, list]]:
    """(index, generation, item) for every item of a WORK (a fan-out WORK's groups
    each have their own generation)."""
    items = body["items"]
    if body.get("runs") is None:
        generation = body["generation"]
        for idx, item in enumerate(items):
            yield idx, generation, item
        return
    start = 0
    for _run_id, generation, count in body["runs"]:
        for idx in range(start, min(start + count, len(items))):
            yield idx, generation, items[idx]
        start += count


def _shared_sources(body: dict) -> dict[int, int]:
    """Copy item -> source item of a fan-out WORK, checked against its item count."""
    num_items = len(body["items"])
    if sum(count for _, _, count in body["runs"]) != num_items:
        raise ProtocolError(f"WORK.runs covers {sum(c for _, _, c in body['runs'])} items, "
                            f"WORK.items has {num_items}")
    sources = dict(body.get("copies") or [])
    for idx, source in sources.items():
        if not (0 <= idx < num_items and 0 <= source < num_items) or source == idx or source in sources:
            raise ProtocolError(f"WORK.copies: item {idx} cannot copy item {source}")
    return sources


def _keep(run: _Run, positions: list[int]) -> _Run:
    """The part of ``run`` at ``positions`` (the rest failed)."""
    return _Run(run.work_id, run.medium, run.stride, [run.idxs[p] for p in positions],
                [run.slot_idxs[p] for p in positions], [run.targets[p] for p in positions],
                None if run.staged is None else [run.staged[p] for p in positions])
