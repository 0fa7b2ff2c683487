"""The worker: receives WORK (batches of slot addresses), fills the slots, says DONE.

The sample functions (``generator_fn``, ``batch_fn``) are called through ``fill.py``.
Invariants to keep when editing:

- every WORK already waiting on the socket (up to ``max_batch`` slots of one model) is
  drained before the sample function is called, so small requests are batched;
- each item is checked against its segment's own header and its slot claimed before
  any byte of it is written (``segments.py``, ``claims.py``); the payload is written
  first and the header last, only over a claim that still stands (``commit.py``); no
  more than a segment's fair share of its slots is claimed at once, the rest of a
  batch is filled in further calls, before DONE;
- a ``finish`` callable returned by a ``batch_fn`` (copies still in flight) is called,
  and the batch committed, only after the NEXT waiting batch has started, or at once
  when none waits: a sample is never late by more than a batch;
- a fan-out WORK (``runs``/``copies``, ``protocol.py``): only *source* items are
  computed and copied into their copies' slots, each header with its own run's
  generation; a run stale here gets no header ("stale") while its sources are still
  computed for the others.

Students on this machine also ask the worker directly (``direct.py``). See
docs/pipeline.md, sections The Python API and GPU paths.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from distill.pipeline import protocol, sizing
from distill.pipeline.auth import secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import FillProgress, Heartbeater, new_writer_id, process_token
from distill.pipeline.mediums.tcp import TcpSender, is_tcp_medium
from distill.pipeline.notices import NoticeOutbox, RequestLane
from distill.pipeline.protocol import Command, Message, ProtocolError
from distill.pipeline.settings import merge
from distill.pipeline.throttle import LogThrottle
from distill.pipeline.worker.cfgs import ModelConfigs
from distill.pipeline.worker.commit import Committer
from distill.pipeline.worker.config import BatchFn, Deferred, GeneratorFn, SlotTarget, WorkerConfig
from distill.pipeline.worker.direct import DirectLane, Model, why_not
from distill.pipeline.worker.fill import (
    Failures,
    Filler,
    Run,
    fail_runs,
    group_by_model,
    shared_sources,
    with_generations,
)
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
        self._generation: dict[str, int] = {}
        self._model_id: str | None = None
        self._last_run = protocol.DEFAULT_RUN
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
        self._lane: DirectLane | None = None
        self._cfgs = ModelConfigs()
        """The model configs WORKs sent us, by digest (a WORK carries its model's once)."""
        self._models: dict[str, Model] = {}
        """run -> (generation, model id, model cfg) of its last plain WORK: what a DIRECT may ask for."""
        self._shared_runs: set[str] = set()
        """Runs opted in to fan-out: always through the broker, which shares their samples."""
        self._heart: Heartbeater | None = None
        self._reported_backlog = 0
        """The DIRECT backlog our last heartbeat told the broker (its thread writes it)."""
        self._empty_since: float | None = None
        """Since when our DIRECT backlog is empty while our last beat said it was not."""
        self._refusals = LogThrottle(log)
        self._deferred: tuple[list[Message], Failures, Deferred] | None = None
        self._progress = FillProgress()
        """Batches finished, told with every heartbeat (a hung batch function stops it)."""

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
        return self._generation.get(self._last_run, 0)

    @property
    def model_id(self) -> str | None:
        return self._model_id

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
        return 0 if self._lane is None else self._lane.filled

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
        self._outbox = NoticeOutbox(cfg.notice_dir) if cfg.notify_students else None
        if self._outbox is not None:
            lane = RequestLane.open(self.peer_id, cfg.notice_dir) if cfg.direct_requests else None
            self._lane = DirectLane(self.peer_id, self._outbox, lane, self._token, self.max_batch)
        try:
            self._serve(sock, sub, heart)
        finally:
            if self._lane is not None:
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
        idle_ms = self.config.heartbeat_interval_s * 1000
        try:
            while not self._stop.is_set():
                queued = self._lane is not None and self._lane.queued
                busy = self._lane is not None and self._lane.busy
                events = dict(poller.poll(0 if queued else 10 if busy else self._idle_wait_ms(idle_ms)))
                if sub in events and self._on_published(sub):
                    return
                if sock in events:
                    self._process(self._collect_work(sock), sock)
                if lane is not None and (lane in events or self._lane.queued):
                    self._serve_direct(sock)
                if self._lane is not None:
                    self._lane.retry_unsent()
                    self._tell_emptied(heart)
                if heart.refusal is not None:  # the broker will never answer: stop with the reason
                    raise PermissionError(f"worker {self.peer_id}: {heart.refusal}")
                if heart.forgotten.is_set() or not heart.broker_alive:
                    self._rejoin(sock, heart)
                if self._deferred is None:  # (a batch still to commit may write to any of them)
                    self._segments.drop_unlinked()
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
        return {} if self._lane is None else self._lane.report()

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
        if self._lane is None or self._lane.backlog or not self._reported_backlog:
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

    # ------------------------------------------------------------------ filling
    def _process(self, works: list[Message], sock: zmq.Socket) -> None:
        shared = [[work] for work in works if work.body.get("runs") is not None]
        plain = [work for work in works if work.body.get("runs") is None]
        for group in shared:  # fan-out WORKs: filled and committed at once
            self._finish_deferred(sock)
            self._send_done(sock, group, self._fill_shared(group[0].body))
        for group in group_by_model(plain):
            self._fill_group(group, sock)
        if self._deferred is not None and not protocol.readable(sock) and not self._direct_waiting():
            self._finish_deferred(sock)  # no next batch to overlap with: finish now

    def _direct_waiting(self) -> bool:
        return self._lane is not None and self._lane.waiting()

    def _finish_deferred(self, sock: zmq.Socket) -> None:
        """Commit the group whose copies were left in flight, and say DONE."""
        if self._deferred is None:
            return
        group, failed, deferred = self._deferred
        self._deferred = None
        deferred()
        self._send_done(sock, group, failed)

    def _fill_group(self, group: list[Message], sock: zmq.Socket) -> None:
        """Fill every slot of WORKs of one (run, generation, model), in as many batches as
        the students' fair shares take; say DONE (the last batch may be left to commit
        while the next one fills, see the module docstring)."""
        first = group[0].body
        run_id, generation, model_id = first["run_id"], first["generation"], first["model_id"]
        failed: Failures = {}
        if generation < self._generation.get(run_id, 0):
            for work in group:
                failed[work.body["work_id"]] = dict.fromkeys(range(len(work.body["items"])), "stale")
            self._finish_deferred(sock)
            self._send_done(sock, group, failed)
            return
        self._note_generation(run_id, generation, model_id)
        if group[0].command is Command.WORK:
            self._models[run_id] = (generation, model_id, first.get("model_cfg"))
            (self._shared_runs.add if first.get("shared") else self._shared_runs.discard)(run_id)
        left = [(work.body, range(len(work.body["items"]))) for work in group]
        deferred = None
        while left:
            runs: list[Run] = []
            left = [(body, waiting) for body, idxs in left
                    if (waiting := self._filler.add_targets(body, generation, runs, failed, idxs))]
            targets = [target for run in runs for target in run.targets]
            if left and not targets:  # our own claims still pending commit fill the shares
                left = self._make_room(sock, left, failed)
                continue
            deferred = self._generate(model_id, first.get("model_cfg"), targets, runs, failed)
            self._finish_deferred(sock)  # the previous batch's copies ran during this fill
            if deferred is not None and left:
                deferred()  # more of this group to fill: its claims must be settled first
                deferred = None
        if deferred is None:
            self._send_done(sock, group, failed)
        else:
            self._deferred = group, failed, deferred

    def _make_room(self, sock: zmq.Socket, left: list[tuple[dict, list[int]]],
                   failed: Failures) -> list[tuple[dict, list[int]]]:
        """Nothing more of a group can be claimed: commit the batch left in flight (its
        claims count against the shares); with none, this worker holds no claim at all,
        so counts that say otherwise are reset (once; then the rest fails)."""
        if self._deferred is not None:
            self._finish_deferred(sock)
            return left
        if self._segments.reset_claims():
            log.error("worker %s: claim counts were out of step with its batches; reset", self.peer_id)
            return left
        _fail_waiting(left, failed, "over the student's share of writers")
        return []

    def _generate(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget],
                  runs: list[Run], failed: Failures) -> Deferred | None:
        """Fill the targets and commit them, or return the commit when copies are in flight."""
        self._filler.refuse_shrunk(runs, failed)  # (the sample function writes into the rest)
        targets = [target for run in runs for target in run.targets]
        if not targets:
            return None
        try:
            with self._progress.batch():
                lengths, finish = self._filler.generate(model_id, model_cfg, targets)
        except Exception as exc:  # a generator bug must not kill the worker
            log.exception("worker %s: generator failed for model %s", self.peer_id, model_id)
            self._committer.give_up(runs)
            fail_runs(runs, failed, f"generator failed: {exc!r}")
            return None
        if callable(finish):
            return lambda: self._finish_and_commit(finish, model_id, runs, lengths, failed)
        self._committer.commit_runs(runs, lengths, failed)
        return None

    def _finish_and_commit(self, finish: Callable[[], None], model_id: str, runs: list[Run],
                           lengths: list[int], failed: Failures) -> None:
        self._check_sizes(runs)  # a segment shrunk meanwhile: grown back for these copies, then refused
        try:
            with self._progress.batch():
                finish()
        except Exception as exc:  # a failed copy fails its slots, not the worker
            log.exception("worker %s: finishing a batch of model %s failed", self.peer_id, model_id)
            self._committer.give_up(runs)
            fail_runs(runs, failed, f"generator failed: {exc!r}")
            return
        self._committer.commit_runs(runs, lengths, failed)

    def _check_sizes(self, runs: list[Run]) -> None:
        """Before copies land in the runs' slots: a segment that shrank since it was mapped is
        grown back (so they cannot fault) and dropped (its slots fail at commit)."""
        for run in runs:
            if run.segment is not None:
                self._segments.check_size(run.segment)

    def _send_done(self, sock: zmq.Socket, group: list[Message], failed: Failures) -> None:
        for work in group:
            body = work.body
            failures = failed.get(body["work_id"], {})
            if work.command is Command.DIRECT:
                self._lane.answer(body, failures)
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
        for idx, generation, (medium, slot_idx, _stride, request_id) in with_generations(body):
            if idx not in failures and medium in self._segments and not is_tcp_medium(medium):
                rows.setdefault((medium, generation), []).append([slot_idx, request_id, True])
        # Not for a run opted in to fan-out: its slots must keep going through the broker,
        # which is what lets one teacher pass serve several runs.
        shared = body.get("runs") is not None or body.get("shared")
        lane = None if shared or self._lane is None else self._lane.name
        reached, missed = set(), set()
        for (medium, generation), slots in rows.items():
            (reached if self._outbox.send(medium, generation, slots, lane, self._token) else missed).add(medium)
        return sorted(reached - missed)

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
            self._process(broker_works, sock)
            if self._lane.others_in(broker_works):
                self._lane.decline_all("the worker has broker work waiting for other students")
                return
        works = self._lane.next_batch(self._direct_model)
        if works:
            self._process(works, sock)

    def _direct_model(self, body: dict) -> Model | str:
        run_id = body["run_id"]
        model = self._models.get(run_id)
        why = why_not(body, model, run_id in self._shared_runs, self._generation.get(run_id, 0))
        return why if why is not None else model

    # ------------------------------------------------------------------ fan-out
    def _fill_shared(self, body: dict) -> Failures:
        """Fill a fan-out WORK: compute its sources once, copy them into their copies,
        commit the slots of runs whose generation is current. Returns failures."""
        work_id = body["work_id"]
        try:
            sources = shared_sources(body)
        except ProtocolError as exc:
            self._refusals.warning("worker %s: %s", self.peer_id, exc.reason)
            return {work_id: dict.fromkeys(range(len(body["items"])), exc.reason[:200])}
        failed: Failures = {}
        runs, live = self._shared_targets(body, failed)
        self._filler.refuse_shrunk(runs, failed)  # (the sample function writes into the rest)
        where = {idx: target for run in runs for idx, target in zip(run.idxs, run.targets, strict=True)}
        needed = sorted({sources.get(idx, idx) for run in live for idx in run.idxs} & where.keys())
        try:
            lengths = self._make(body["model_id"], body.get("model_cfg"), [where[i] for i in needed])
        except Exception as exc:  # a generator bug must not kill the worker
            log.exception("worker %s: generator failed for model %s", self.peer_id, body["model_id"])
            self._committer.give_up(runs)
            for run in live:
                failed.setdefault(work_id, {}).update(dict.fromkeys(run.idxs, f"generator failed: {exc!r}"[:200]))
            return failed
        made = dict(zip(needed, lengths, strict=True))
        self._check_sizes(runs)  # sources are copied out of these segments, copies into them
        live_runs = {id(run) for run in live}
        for run in runs:
            if id(run) in live_runs:
                self._commit_copies(run, sources, where, made, failed)
            else:
                self._committer.give_up([run])
        return failed

    def _shared_targets(self, body: dict, failed: Failures) -> tuple[list[Run], list[Run]]:
        """Targets of every group of a fan-out WORK, and the runs of those whose
        generation is current (the others' items fail as "stale")."""
        runs: list[Run] = []
        live: list[Run] = []
        start = 0
        for run_id, generation, count in body["runs"]:
            first = len(runs)
            self._filler.add_targets(body, generation, runs, failed, range(start, start + count), share=False)
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
        with self._progress.batch():
            lengths, finish = self._filler.generate(model_id, model_cfg, targets)
            if callable(finish):  # copies in flight: the copies below read these payloads
                finish()
        return lengths

    def _commit_copies(self, run: Run, sources: dict[int, int], where: dict[int, SlotTarget],
                       made: dict[int, int], failed: Failures) -> None:
        """Copy each copy's source payload into its slot, then commit the run's slots."""
        keep, lengths, unmade = [], [], []
        for pos, idx in enumerate(run.idxs):
            source = sources.get(idx, idx)
            length = made.get(source)
            if length is None:  # its source's address was bad
                failed.setdefault(run.work_id, {})[idx] = "source sample not made"
                unmade.append(pos)
                continue
            if source != idx and length > 0:
                run.targets[pos].payload[:length] = where[source].payload[:length]
            keep.append(pos)
            lengths.append(length)
        if unmade:
            lost = Run(run.work_id, run.medium, run.stride, run.segment, None,
                       [run.idxs[p] for p in unmade], [run.slot_idxs[p] for p in unmade],
                       [run.targets[p] for p in unmade])
            self._committer.give_up([lost])
            run.keep(keep)
        self._committer.commit(run, lengths, failed)


def _fail_waiting(left: list[tuple[dict, list[int]]], failed: Failures, why: str) -> None:
    for body, idxs in left:
        failed.setdefault(body["work_id"], {}).update(dict.fromkeys(idxs, why))


def _silence(heart: Heartbeater) -> str:
    """How long the broker has been silent, as the worker's log says it."""
    if heart.last_answer is None:
        return "has not answered yet"
    return f"silent for {time.monotonic() - heart.last_answer:.0f}s"
