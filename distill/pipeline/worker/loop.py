"""The worker's loop: receives WORK (batches of slot addresses) and DIRECTs, hands them
to its batches (``batches.py``), keeps in touch with the broker.

Invariants to keep when editing:

- every WORK already waiting on the socket (up to ``max_batch`` slots of one model) is
  drained before the batch is filled, so small requests are batched;
- broker WORK comes before DIRECTs (``_serve_direct``);
- a batch left to commit (``Batches.pending``) may still write to any mapped segment:
  segments are dropped only when none is.

The sample functions (``generator_fn``, ``batch_fn``) are called through ``fill.py``;
what is claimed, written and committed, and in which order, is ``batches.py``'s.
Students on this machine also ask the worker directly (``direct.py``). See
docs/pipeline.md, sections The Python API and GPU paths.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import zmq

from distill.pipeline import protocol, sizing
from distill.pipeline.auth import secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import FillProgress, Heartbeater, new_writer_id, process_token
from distill.pipeline.mediums.tcp import TcpSender
from distill.pipeline.notices import NoticeOutbox, RequestLane
from distill.pipeline.protocol import Command, Message, ProtocolError
from distill.pipeline.settings import merge
from distill.pipeline.throttle import LogThrottle
from distill.pipeline.worker.batches import Batches, Generations
from distill.pipeline.worker.cfgs import ModelConfigs
from distill.pipeline.worker.commit import Committer
from distill.pipeline.worker.config import BatchFn, GeneratorFn, WorkerConfig
from distill.pipeline.worker.direct import DirectLane, NoLane
from distill.pipeline.worker.fill import Filler
from distill.pipeline.worker.segments import Segments

log = logging.getLogger(__name__)

IDLE_BEAT_S = 0.1
"""A worker whose DIRECT backlog has stayed empty this long beats at once (``_tell_emptied``)."""


class Worker:
    """Fills student slots on request (see module docstring).

    ``Worker(generator_fn=..., slot_size=...)`` as in the seed README, or with
    ``batch_fn=`` and ``batch_config=``; every setting is a field of
    :class:`WorkerConfig`, given as ``config=`` and/or as keyword arguments.
    """

    def __init__(self, generator_fn: GeneratorFn | None = None, slot_size: int | None = None,
                 backend_endpoint: str | None = None, control_pub_endpoint: str | None = None,
                 worker_id: int | str | None = None, *, batch_fn: BatchFn | None = None,
                 config: WorkerConfig | None = None, **options: Any) -> None:
        if (generator_fn is None) == (batch_fn is None):
            raise ValueError("Worker needs exactly one of generator_fn= (per sample) or batch_fn= (batched)")
        self.config = merge(WorkerConfig, config, {
            "slot_size": slot_size, "backend_endpoint": backend_endpoint,
            "control_pub_endpoint": control_pub_endpoint, "worker_id": worker_id, **options}, "Worker")
        cfg = self.config
        self.generator_fn = generator_fn
        self.batch_fn = batch_fn
        self.slot_size = cfg.payload_bytes
        self.backend_endpoint = cfg.backend_endpoint or default_endpoint("backend")
        self.control_pub_endpoint = cfg.control_pub_endpoint or default_endpoint("control_pub")
        self.worker_id = cfg.worker_id if cfg.worker_id is not None else os.getpid()
        self.peer_id = f"worker-{self.worker_id}-{os.urandom(3).hex()}"
        self.max_batch = cfg.max_batch if cfg.max_batch is not None else self._chosen_batch()
        self.capacity = self.max_batch * cfg.prefetch_batches
        self._keys = cfg.curve.client_keys() if cfg.curve is not None else None  # checked here, not in run()
        self._generations = Generations()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token = process_token()
        self.writer_id = new_writer_id()
        """This worker's claims and commits in slot headers carry it (``claims.py``)."""
        self._sender = TcpSender()
        decode = cfg.batch_config.decode if cfg.batch_config is not None else None
        self._segments = Segments(self.slot_size, decode)
        self._filler = Filler(cfg, generator_fn, batch_fn, self._segments, self._sender, self.writer_id,
                              self.peer_id)
        self._committer = Committer(self.writer_id, cfg.checksum, self._sender, self.peer_id, self._segments)
        self._outbox: NoticeOutbox | None = None
        self._cfgs = ModelConfigs()
        """The model configs WORKs sent us, by digest (a WORK carries its model's once)."""
        self._heart: Heartbeater | None = None
        self._reported_backlog = 0
        """The DIRECT backlog our last heartbeat told the broker (its thread writes it)."""
        self._empty_since: float | None = None
        """Since when our DIRECT backlog is empty while our last beat said it was not."""
        self._refusals = LogThrottle(log)
        self._progress = FillProgress()
        """Batches finished, told with every heartbeat (a hung batch function stops it)."""
        self._batches = Batches(self.peer_id, self._filler, self._committer, self._segments, self._progress,
                                self._generations, self._send)

    def _chosen_batch(self) -> int:
        """``max_batch`` left out: a byte budget of samples per call (``sizing.py``)."""
        chosen = sizing.worker_batch(self.slot_size)
        sizing.log_choice("Worker", "max_batch", chosen, self.slot_size,
                          f"{sizing.WORKER_BATCH_BYTES >> 20} MiB of samples per call, at most "
                          f"{sizing.MAX_WORKER_BATCH}")
        return chosen

    # ------------------------------------------------------------------ public API
    @property
    def batch_config(self) -> BatchConfig | None:
        return self.config.batch_config

    @property
    def generation(self) -> int:
        """Newest generation seen (of the last run served)."""
        return self._generations.of(self._generations.last_run)

    @property
    def model_id(self) -> str | None:
        return self._generations.model_id

    @property
    def samples_written(self) -> int:
        return self._committer.samples_written

    @property
    def samples_computed(self) -> int:
        """Samples the generator made (fewer than ``samples_written`` under fan-out)."""
        return self._filler.samples_computed

    @property
    def direct_filled(self) -> int:
        """Samples written for DIRECT requests (the broker never saw them)."""
        return self._lane.filled

    def run(self) -> None:
        """Serve until STOP is published or :meth:`stop` is called (blocking)."""
        cfg = self.config
        ctx = zmq.Context()
        sock = secure_client(protocol.configure(ctx.socket(zmq.DEALER)), self._keys)
        sock.setsockopt(zmq.ROUTING_ID, self.peer_id.encode())
        sock.setsockopt(zmq.SNDTIMEO, protocol.SEND_RETRY_MS)  # see _send
        sock.connect(self.backend_endpoint)
        sub = secure_client(protocol.configure(ctx.socket(zmq.SUB)), self._keys)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.control_pub_endpoint)
        heart = Heartbeater(self.backend_endpoint, self.peer_id, "worker", interval_s=cfg.heartbeat_interval_s,
                            liveness=cfg.heartbeat_liveness, keys=self._keys, extra=self._beat_report).start()
        self._heart = heart
        self._open_lane()
        try:
            self._serve(sock, sub, heart)
        finally:
            self._lane.shut()
            if self._outbox is not None:
                self._outbox.close()
            heart.stop()
            with contextlib.suppress(zmq.Again):  # no route to the broker (refused key): skip BYE
                protocol.send(sock, Command.BYE, {"peer_id": self.peer_id})
            sock.close(linger=100)
            sub.close(linger=0)
            ctx.term()
            self._segments.close()
            self._sender.close()
            log.info("worker %s stopped after %d samples", self.peer_id, self.samples_written)

    def _open_lane(self) -> None:
        """With notices, the outbox and (with direct requests) the lane's socket; else none."""
        cfg = self.config
        if not cfg.notices:
            return
        self._outbox = NoticeOutbox(cfg.socket_dir)
        lane = RequestLane.open(self.peer_id, cfg.socket_dir) if cfg.direct_requests else None
        self._batches.lane = DirectLane(self.peer_id, self._outbox, lane, self._token, self.max_batch)

    @property
    def _lane(self) -> DirectLane | NoLane:
        """Notices and DIRECTs (``direct.py``): the batches' lane, opened by :meth:`run` when
        notices are on (a :class:`NoLane` until then, and without them)."""
        return self._batches.lane

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
        lane = self._lane.fileno()
        if lane is not None:
            poller.register(lane, zmq.POLLIN)
        idle_ms = self.config.heartbeat_interval_s * 1000
        try:
            while not self._stop.is_set():
                wait_ms = 0 if self._lane.queued else 10 if self._lane.busy else self._idle_wait_ms(idle_ms)
                events = dict(poller.poll(wait_ms))
                if sub in events and self._on_published(sub):
                    return
                if sock in events:
                    self._batches.process(self._collect_work(sock), sock)
                if lane is not None and (lane in events or self._lane.queued):
                    self._serve_direct(sock)
                self._lane.retry_unsent()
                self._tell_emptied(heart)
                if heart.refusal is not None:  # the broker will never answer: stop with the reason
                    raise PermissionError(f"worker {self.peer_id}: {heart.refusal}")
                if heart.forgotten.is_set() or not heart.broker_alive:
                    self._rejoin(sock, heart)
                if not self._batches.pending:  # (a batch still to commit may write to any of them)
                    self._segments.drop_unlinked()
        finally:
            self._batches.finish_deferred(sock)

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
        return self._lane.report()

    def _beat_report(self) -> dict:
        """What every heartbeat carries: the DIRECT fills and the batches finished."""
        report = {**self._direct_report(), **self._progress.report()}
        self._reported_backlog = report.get("backlog", 0)
        return report

    def _tell_emptied(self, heart: Heartbeater) -> None:
        """Beat early once our DIRECT backlog has stayed empty for ``IDLE_BEAT_S`` while our
        last beat said it was not.

        The broker counts that backlog as load when it splits a run's slots among workers
        (``broker/dispatch.spread``). A worker that has just finished a departed student's
        DIRECT batch, or whose lanes went elsewhere, would otherwise be passed over for up
        to a heartbeat interval while it idles (its slots sticking to the workers fed
        instead). Not at the instant it empties: a worker in steady work empties after
        every batch and gets its slots back a round trip later, and beats taken at those
        instants would tell the broker that every worker is always idle, a slow one
        included (which then got more than its share of the slots)."""
        if self._lane.backlog or not self._reported_backlog:
            self._empty_since = None
            return
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
        elif now - self._empty_since >= IDLE_BEAT_S:
            self._reported_backlog = 0  # asked once per emptying
            self._empty_since = None
            heart.beat_soon()

    def _idle_wait_ms(self, idle_ms: float) -> float:
        """How long the loop may wait for a message: until an early beat is due, at most."""
        if self._empty_since is None:
            return idle_ms
        return max(1.0, min(idle_ms, (self._empty_since + IDLE_BEAT_S - time.monotonic()) * 1000))

    def _rejoin(self, sock: zmq.Socket, heart: Heartbeater) -> None:
        forgotten = heart.forgotten.is_set()
        log.warning("worker %s: broker at %s %s; registering again", self.peer_id, self.backend_endpoint,
                    "forgot us" if forgotten else _silence(heart))
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
                self._done_unwritten(sock, msg.body)

    def _on_published(self, sub: zmq.Socket) -> bool:
        """Apply a MODEL or STOP broadcast; True when the worker must stop."""
        try:
            msg = protocol.recv_published(sub)
        except ProtocolError as exc:
            self._refusals.warning("bad broadcast: %s", exc.reason)
            return False
        if msg.command is Command.STOP:
            return msg.body.get("run_id") is None
        if msg.command is Command.MODEL:
            self._generations.note(msg.body["run_id"], msg.body["generation"], msg.body["model_id"])
        return False

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
                if not self._cfgs.resolve(msg.body):
                    self._refuse_unknown_cfg(sock, msg.body)
                    continue
                works.append(msg)
                slots += len(msg.body["items"])
            elif msg.command is Command.ERROR:
                self._refusals.warning("broker error: %s", msg.body["reason"])
            else:
                reason = f"command {msg.command.name} not accepted by a worker"
                self._refusals.warning("worker %s: %s", self.peer_id, reason)
                self._send(sock, Command.ERROR, {"reason": reason, "command": msg.command.name})
        return works

    def _refuse_unknown_cfg(self, sock: zmq.Socket, body: dict) -> None:
        """A WORK names a model config we do not have (``cfgs.py``): nothing is filled, the
        broker is told to send it again, the slots go back to their students ("stale")."""
        log.info("worker %s: WORK %d names a model config we no longer have; asking for it again",
                 self.peer_id, body["work_id"])
        self._done_unwritten(sock, body, unknown_cfg=True)

    def _done_unwritten(self, sock: zmq.Socket, body: dict, **extra: bool) -> None:
        """DONE for a WORK of which nothing was written: every slot "stale" (asked again)."""
        items = len(body["items"])
        self._send(sock, Command.DONE, {"peer_id": self.peer_id, "work_id": body["work_id"], "num_items": items,
                                        "failed": [[idx, "stale"] for idx in range(items)], **extra})

    # ------------------------------------------------------------------ direct requests
    def _serve_direct(self, sock: zmq.Socket) -> None:
        """Fill DIRECT requests (up to about ``max_batch`` slots per call). Broker WORK
        comes first: what waits is filled before them, and if it was for a student none of
        the queued DIRECTs come from, they are all declined, so that the students waiting
        on the broker keep their share. WORK for the same students only is no reason to
        decline: that sent the DIRECTs to the broker, whose WORK for them then kept waiting
        here, and so on (4 KiB samples, a ring of 4,096 slots: 88% of DIRECTs declined)."""
        self._lane.take()
        if protocol.readable(sock):
            broker_works = self._collect_work(sock)
            self._batches.process(broker_works, sock)
            if self._lane.others_in(broker_works):
                self._lane.decline_all("the worker has broker work waiting for other students")
                return
        works = self._lane.next_batch(self._batches.direct_model)
        if works:
            self._batches.process(works, sock)


def _silence(heart: Heartbeater) -> str:
    """How long the broker has been silent, as the worker's log says it."""
    if heart.last_answer is None:
        return "has not answered yet"
    return f"silent for {time.monotonic() - heart.last_answer:.0f}s"
