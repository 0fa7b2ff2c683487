"""The student of the seed README: owns slots, switches models (leader), follows (others).

:class:`StudentClient` is one :class:`~distill.pipeline.student.pool.SlotPool` (its slots and its
socket to the broker's frontend) plus the control path: the leader (rank 0) switches
the run's model with SET_MODEL and puts it back on a restarted broker; other ranks
follow the broker's MODEL broadcasts.

Invariants to keep when editing:

- ``generation_value`` (shared with the datasets of the same process tree) only ever
  moves to a generation the leader set: the broker's answer to SET_MODEL, its MODEL
  broadcast, its WELCOME;
- a switch always asks for a generation above every one this client has seen
  (``SET_MODEL.min_generation``): a restarted broker counts from 0 again, and the new
  model must never get the number of an older one whose samples are still in slots;
- leader commands carry ``leader_secret``; a restarted leader passes its predecessor's
  (``StudentClient(..., leader_secret=old.leader_secret)``) and takes over at the next
  epoch (docs/security.md, section Leaders, roles and numbers (issue 37)).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import CurveConfig, HandshakeWatch, secure_client
from distill.pipeline.batch import BatchConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import (
    BROKER_SILENCE_S,
    BROKER_WAIT_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    BrokerRefusal,
)
from distill.pipeline.protocol import DEFAULT_RUN, Command, ProtocolError
from distill.pipeline.settings import merge
from distill.pipeline.sizing import chosen_slots
from distill.pipeline.student.pool import PoolConfig, SlotPool

log = logging.getLogger(__name__)

CATCH_UP_S = 1.0
"""A follower waiting for a generation asks the broker for it this often (wait_generation)."""

__all__ = ["DEFAULT_RUN", "BrokerRefusal", "SampleRef", "SlotPool", "StudentClient", "StudentClientConfig"]


@dataclass
class SampleRef:
    """A filled slot handed to the user: views valid until ``release_slot(slot_id)``."""

    slot_id: int
    generation: int
    request_id: int
    data: memoryview
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class StudentClientConfig:
    """Every setting of a :class:`StudentClient` (the seed README's arguments first)."""

    student_rank: int | None = None
    """0 is the leader (switches the model); other ranks follow."""
    slot_count: int | None = None
    batch_config: BatchConfig | None = None
    frontend_endpoint: str | None = None
    control_endpoint: str | None = None
    control_pub_endpoint: str | None = None
    run_id: str = DEFAULT_RUN
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    medium: str = "shm"
    tcp_host: str | None = None
    leader_epoch: int | None = None
    """The leader's epoch: a command of an older epoch is refused, one past the run's next
    too. None: the broker's count (this client takes over at the run's next epoch and is
    told its number)."""
    leader_secret: str | None = None
    """What proves this client leads its run (at least 16 characters). None: a new random
    one; a restarted leader process passes its predecessor's (``client.leader_secret``)."""
    curve: CurveConfig | None = None
    fan_out: bool = False
    """Fan-out opt-in: this run's slots may get samples made for other runs of the same model."""
    notices: bool = True
    socket_dir: str | os.PathLike | None = None
    direct_requests: bool = True
    pending_deadline_s: float | None = None
    """See :class:`~distill.pipeline.student.pool.PoolConfig`."""
    broker_pid: int | None = None
    """The broker's process on this machine (mode=local sets it): HELLO, SET_MODEL and STOP
    wait while it runs and fail once it has exited (see ``PoolConfig``)."""
    broker_wait_s: float = BROKER_WAIT_S
    """The longest HELLO, SET_MODEL and STOP wait for a broker that shows signs of life."""
    broker_silence_s: float = BROKER_SILENCE_S
    """Without ``broker_pid``: give up on a broker not heard from for this long."""

    def __post_init__(self) -> None:
        missing = [name for name in ("student_rank", "batch_config") if getattr(self, name) is None]
        if missing:
            raise ValueError(f"StudentClient needs {', '.join(missing)} (the seed README's arguments)")


class StudentClient:
    """The student of the seed README: owns slots, switches models (leader), follows (others).

    ``StudentClient(student_rank, slot_count, batch_config, frontend_endpoint, ...)`` as in
    the seed README, or ``StudentClient(config=StudentClientConfig(...))``; every setting is a
    field of :class:`StudentClientConfig`, given as ``config=`` and/or as keyword arguments.
    """

    def __init__(self, student_rank: int | None = None, slot_count: int | None = None,
                 batch_config: BatchConfig | None = None, frontend_endpoint: str | None = None,
                 control_endpoint: str | None = None, control_pub_endpoint: str | None = None, *,
                 config: StudentClientConfig | None = None, **options: Any) -> None:
        cfg = self.config = merge(StudentClientConfig, config, {
            "student_rank": student_rank, "slot_count": slot_count, "batch_config": batch_config,
            "frontend_endpoint": frontend_endpoint, "control_endpoint": control_endpoint,
            "control_pub_endpoint": control_pub_endpoint, **options}, "StudentClient")
        self.student_rank = cfg.student_rank
        # Fan-out opt-in: this run's slots may get samples the teacher made for other
        # runs of the same model (one teacher pass for a whole sweep; see broker.py).
        self.fan_out = cfg.fan_out
        # The newest holder of the run's secret leads: a new process takes over at the next
        # epoch (TAKE_OVER_EPOCH until the broker says which), one left over from before is refused.
        self.leader_epoch = protocol.TAKE_OVER_EPOCH if cfg.leader_epoch is None else cfg.leader_epoch
        self.leader_secret = cfg.leader_secret or secrets.token_hex(16)
        self._keys = cfg.curve.client_keys() if cfg.curve is not None else None
        self.batch_config = cfg.batch_config
        self.run_id = cfg.run_id
        self.frontend_endpoint = cfg.frontend_endpoint or default_endpoint("frontend")
        self.control_endpoint = cfg.control_endpoint or default_endpoint("control")
        self.control_pub_endpoint = cfg.control_pub_endpoint or default_endpoint("control_pub")
        self.generation_value = mp.Value("q", 0)
        self.model_id: str | None = None
        self._model_cfg: dict | None = None
        self._gen_lock = threading.Lock()
        self._pool = SlotPool(
            generation=self._current_generation, note_generation=self._note_generation,
            config=PoolConfig(frontend_endpoint=self.frontend_endpoint, run_id=cfg.run_id,
                              slot_count=cfg.slot_count or chosen_slots("StudentClient", cfg.batch_config),
                              payload_bytes=cfg.batch_config.nbytes(),
                              heartbeat_interval_s=cfg.heartbeat_interval_s,
                              heartbeat_liveness=cfg.heartbeat_liveness, medium=cfg.medium,
                              tcp_host=cfg.tcp_host, curve=self._keys, notices=cfg.notices,
                              socket_dir=cfg.socket_dir, direct_requests=cfg.direct_requests,
                              pending_deadline_s=cfg.pending_deadline_s, broker_pid=cfg.broker_pid,
                              broker_wait_s=cfg.broker_wait_s, broker_silence_s=cfg.broker_silence_s))
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

    @property
    def live_workers(self) -> int | None:
        """How many live workers the broker had at its last heartbeat answer (None: not told
        yet): how many teachers are feeding, beside what they deliver (a student's log)."""
        return self._pool.heart.workers

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
        """Block until this client knows ``generation`` (followers, after a DDP broadcast).

        A broadcast sent before this client's subscription reached the broker is never
        seen (ZeroMQ's slow joiner), so every ``CATCH_UP_S`` without it the client asks
        the broker for the run's generation (a HELLO: its WELCOME says)."""
        deadline = time.monotonic() + timeout_s
        catch_up = time.monotonic() + CATCH_UP_S
        with self._generation_seen:
            while self.generation < generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"generation {generation} not seen in {timeout_s}s "
                                       "(is start_sub_listener() running, and has the leader switched?)")
                self._generation_seen.wait(min(left, 0.1))
                if time.monotonic() >= catch_up and self.generation < generation:
                    catch_up = time.monotonic() + CATCH_UP_S
                    self._generation_seen.release()
                    try:
                        self._catch_up(min(left, CATCH_UP_S))
                    finally:
                        self._generation_seen.acquire()
        return self.generation

    def _catch_up(self, timeout_s: float) -> None:
        """Learn the run's generation from the broker (what the leader set there)."""
        try:
            welcome = self._pool.hello(self.student_rank, timeout_ms=timeout_s * 1000)
        except TimeoutError:
            return
        self._note_generation(welcome["generation"])
        if welcome.get("model_id") is not None:
            self.model_id = welcome["model_id"]

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
            # Above every generation we know, even on a broker that restarted since (which
            # counts from 0): the new model must never get an older model's number.
            reply = self._control(Command.SET_MODEL, {"run_id": self.run_id, "model_id": model_id,
                                                      "model_cfg": model_cfg,
                                                      "min_generation": self._next_generation(),
                                                      **self._leader()})
            if reply.command is not Command.MODEL_SET:
                raise RuntimeError(f"broker answered SET_MODEL with {reply.command.name}, not MODEL_SET")
            self._note_leader(reply)
            self.model_id = model_id
            self._model_cfg = model_cfg
        self._start_keeper()
        return reply.body["generation"]

    def _next_generation(self) -> int:
        """The generation a switch asks for: one above the newest this client knows."""
        return min(self.generation + 1, protocol.MAX_INT)

    def stop_workers(self) -> None:
        """Ask the broker to publish STOP to every worker (only the leader of every run that
        has one may: the broker checks this client's ``leader_secret``)."""
        self._control(Command.STOP, {"leader_secret": self.leader_secret})

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
                    self._note_generation(msg.body["generation"])  # the broker's: the leader set it
        finally:
            sub.close(linger=0)

    def _control(self, command: Command, body: dict) -> protocol.Message:
        """Send ``command`` on a connection of its own and wait for the broker's answer, as
        long as the broker shows signs of life (``liveness.BrokerPatience``); an ERROR in
        answer is raised at once as :class:`BrokerRefusal`, with the broker's reason."""
        ctx = zmq.Context.instance()
        sock = secure_client(protocol.configure(ctx.socket(zmq.DEALER)), self._keys)
        sock.setsockopt(zmq.SNDTIMEO, protocol.SEND_RETRY_MS)  # a refused key leaves no route
        watch = HandshakeWatch(sock) if self._keys is not None else None
        sock.connect(self.control_endpoint)
        try:
            wait = self._pool.wait_for_broker(command, self.control_endpoint)

            def go_on() -> bool:
                if watch is not None and (refusal := watch.refusal()) is not None:
                    raise PermissionError(f"{command.name} not delivered: {refusal}")
                wait.check()
                return True

            protocol.send_patiently(sock, command, body, go_on)
            while not sock.poll(100):
                go_on()
            reply = protocol.recv(sock)
            if reply.command is Command.ERROR:
                raise wait.refused(reply.body["reason"])
            return reply
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
                try:
                    reply = self._control(Command.SET_MODEL, {
                        "run_id": self.run_id, "model_id": self.model_id, "model_cfg": self._model_cfg,
                        "restore_generation": self.generation, **self._leader()})
                    self._note_leader(reply)
                except BrokerRefusal as exc:
                    log.error("%s", exc)

    def _start_keeper(self) -> None:
        """Leader: restore the model on a restarted broker even if this client never asks
        for samples itself (the app's ranks read through DataLoader workers, whose pools
        notice the restart but cannot restore a model they do not know)."""
        if self._keeper is not None or self.student_rank != 0:
            return
        self._keeper = threading.Thread(target=self._keep_model, daemon=True, name="model-keeper")
        self._keeper.start()

    def _keep_model(self) -> None:
        heart = self._pool.heart
        known = heart.broker_id
        while not self._sub_stop.wait(heart.interval_s):
            broker_id = heart.broker_id
            if broker_id == known:
                continue
            if known is not None:  # a new broker instance answers: it has no model for our run
                try:
                    self._rejoin()
                except (TimeoutError, ConnectionError) as exc:
                    log.warning("%s; retrying at the next heartbeat", exc)
                    continue
            known = broker_id

    def _leader(self) -> dict[str, Any]:
        """What the leader declares with every SET_MODEL besides the model."""
        return {"leader_epoch": self.leader_epoch, "peer_id": self._pool.peer_id,
                "share_model": self.fan_out, "leader_secret": self.leader_secret}

    def _note_leader(self, reply: protocol.Message) -> None:
        """Take the generation and the epoch the broker answered a SET_MODEL with."""
        self._note_generation(reply.body["generation"])
        if reply.body.get("leader_epoch") is not None:
            self.leader_epoch = reply.body["leader_epoch"]

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
