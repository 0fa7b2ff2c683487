"""Heartbeats (the ZeroMQ guide's Paranoid Pirate pattern), from their own thread.

A peer's main thread may be busy for a long time (a teacher forward, a training
step), so heartbeats are sent by a daemon thread on a socket of its own. The
broker answers each HEARTBEAT with its instance id: silence from the broker for ``HEARTBEAT_LIVENESS``
intervals means it is gone, a new instance id that it restarted, and a RECONNECT
answer that it has forgotten us. Either way the owner re-registers.

A student's calls that wait for the broker's answer (HELLO, SET_MODEL, STOP) wait as
long as the broker shows signs of life, and no longer (:class:`BrokerPatience`); an
ERROR in answer ends the wait at once (:class:`BrokerRefusal`, with the broker's reason).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import ClientKeys, HandshakeWatch, secure_client
from distill.pipeline.protocol import Command, ProtocolError

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3
MIN_INTERVAL_S = 0.01
EARLY_BEAT_GAP_S = 0.1
"""An early beat (``Heartbeater.beat_soon``) comes at least this long after the last beat."""
RECONNECT_INTERVAL_INIT_S = 0.1
RECONNECT_INTERVAL_MAX_S = 5.0
BROKER_SILENCE_S = 10.0
"""A call gives up on a broker it has heard nothing from for this long (when it cannot ask
the broker's process)."""
BROKER_WAIT_S = 600.0
"""The longest a call waits for the broker's answer, however alive the broker looks."""
WAIT_LOG_EVERY_S = 15.0
"""A call still waiting for the broker says so this often: for what, where, how long, and the
broker's signs of life (a broker starting on a loaded machine may take minutes)."""


BEAT_SUFFIX = b"/beat"
"""Ends the routing identity of a peer's heartbeat socket (:func:`beat_identity`)."""


def new_peer_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


def beat_identity(identity: bytes) -> bytes:
    """The routing identity of the heartbeat socket of the connection ``identity`` (a
    peer's own routing identity is its peer id): the broker lets a heartbeat keep alive
    only the peers of the connection it comes from, or of that connection's beat socket."""
    return identity + BEAT_SUFFIX


class Heartbeater:
    """Sends HEARTBEAT every ``interval_s`` to ``endpoint`` and watches the answers."""

    def __init__(self, endpoint: str, peer_id: str, role: str, *,
                 interval_s: float = HEARTBEAT_INTERVAL_S,
                 liveness: int = HEARTBEAT_LIVENESS, keys: ClientKeys | None = None,
                 first_beat_now: bool = False, extra: Callable[[], dict] | None = None) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self.refusal: str | None = None
        """Why the broker refuses our CurveZMQ handshakes (None: it does not, or no keys)."""
        self.peer_id = peer_id
        self.role = role
        self._extra = extra
        """Fields each beat carries besides who we are (a worker: its DIRECT fill counts)."""
        self.interval_s = interval_s
        self.liveness = liveness
        self.last_heard = time.monotonic()
        self.last_answer: float | None = None
        """When the broker last answered (monotonic; None: it never has)."""
        self.broker_id: str | None = None  # the broker instance that answers us
        self.forgotten = threading.Event()  # broker answered RECONNECT, or restarted
        self.introduced = threading.Event()  # some broker instance has answered (broker_id is set)
        self.workers: int | None = None
        """How many live workers the broker has, as its last answer said (None: not told)."""
        self._first_beat_s = 0.0 if first_beat_now else interval_s
        self._stop = threading.Event()
        self._soon = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{peer_id}", daemon=True)

    def start(self) -> Heartbeater:
        self._thread.start()
        return self

    def stop(self, *, wait: bool = True) -> None:
        """Stop beating; ``wait=False`` does not wait for the thread (it ends within a beat)."""
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def beat_soon(self) -> None:
        """Beat now rather than at the end of the interval (at most one beat per
        EARLY_BEAT_GAP_S): what a beat carries changed in a way the broker should know
        before it routes more work (a worker whose DIRECT backlog just emptied)."""
        self._soon.set()

    @property
    def broker_alive(self) -> bool:
        return time.monotonic() - self.last_heard < self.interval_s * self.liveness

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = secure_client(protocol.configure(ctx.socket(zmq.DEALER), hwm=10), self.keys)
        sock.setsockopt(zmq.ROUTING_ID, beat_identity(self.peer_id.encode()))
        sock.setsockopt(zmq.SNDTIMEO, int(self.interval_s * 1000))  # no route to the broker: skip a beat
        watch = HandshakeWatch(sock) if self.keys is not None else None
        sock.connect(self.endpoint)
        try:
            # The first beat waits one interval, so the owner's own first message
            # (READY, REQUEST) reaches the broker before the broker hears of us here
            # (unless the owner asks to learn the broker's instance first: first_beat_now).
            if self._first_beat_s:
                self._listen(sock, watch)
            while not self._stop.is_set():
                self._beats += 1
                body = {"peer_id": self.peer_id, "role": self.role}
                self._soon.clear()  # what an early beat was asked for goes out with this one
                if self._extra is not None:
                    body.update(self._extra())
                with contextlib.suppress(zmq.Again):
                    protocol.send(sock, Command.HEARTBEAT, body)
                self._listen(sock, watch)
        finally:
            if watch is not None:
                watch.close()
            sock.close(linger=0)

    def _listen(self, sock: zmq.Socket, watch: HandshakeWatch | None) -> None:
        """Take the broker's answers for one interval, or until an early beat is due once
        EARLY_BEAT_GAP_S have passed (and note a refused handshake)."""
        started = time.monotonic()
        deadline = started + self.interval_s
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            if self._soon.is_set() and self._beats and time.monotonic() - started >= EARLY_BEAT_GAP_S:
                return
            if sock.poll(min(left, EARLY_BEAT_GAP_S / 2) * 1000):
                self._on_reply(sock)
            if watch is not None:
                self._note_refusal(watch.refusal())

    def _note_refusal(self, refusal: str | None) -> None:
        if refusal is not None and refusal != self.refusal:
            log.error("%s: %s", self.peer_id, refusal)
        self.refusal = refusal

    def _follow_interval(self, interval_ms: int | None) -> None:
        """Beat at least as often as the broker expects: a peer that only heartbeats (a
        student served by direct requests) would otherwise be purged as silent."""
        if interval_ms and interval_ms / 1000 < self.interval_s:
            log.info("%s: beating every %d ms, as the broker expects", self.peer_id, interval_ms)
            self.interval_s = max(interval_ms / 1000, MIN_INTERVAL_S)

    def _on_reply(self, sock: zmq.Socket) -> None:
        try:
            msg = protocol.recv(sock)
        except ProtocolError as exc:
            log.warning("heartbeat: bad reply from broker: %s", exc.reason)
            return
        self.last_heard = self.last_answer = time.monotonic()
        if msg.command is Command.RECONNECT:
            self.forgotten.set()
        elif msg.command is Command.HEARTBEAT:
            self._follow_interval(msg.body.get("interval_ms"))
            self.workers = msg.body.get("workers", self.workers)
            broker_id = msg.body["peer_id"]
            if self.broker_id is not None and broker_id != self.broker_id:
                log.warning("%s: broker restarted (%s -> %s)", self.peer_id, self.broker_id, broker_id)
                self.forgotten.set()
            self.broker_id = broker_id
            self.introduced.set()



class FillProgress:
    """How many batches a worker has finished, for its heartbeats.

    The heartbeat thread beats on while the worker's batch function hangs, so a beat
    alone does not say the worker is alive: the count it carries (``batches``) does. The
    broker gives up on a worker that holds work and whose count has stood still past
    its deadline (``broker/deadline.py``). Read from the heartbeat thread: one int,
    replaced, never half-written."""

    def __init__(self) -> None:
        self.batches = 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Around one call of the sample function (or a batch's deferred ``finish``): it
        counts once it returns, or raises (a failed batch is progress too)."""
        try:
            yield
        finally:
            self.batches += 1

    def report(self) -> dict:
        return {"batches": self.batches}


# --------------------------------------------------------------------------- processes
def _host_scope() -> str:
    """Where a pid means something: this boot of this kernel, this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"
    return f"{boot}/{pidns}"


def start_time(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name in parentheses may hold spaces
    return int(fields[19]), fields[0]


def process_token(pid: int | None = None) -> str | None:
    """A name for a process that no other process will ever have on this machine:
    scope + pid + start time, so a recycled pid is not mistaken for the original."""
    pid = os.getpid() if pid is None else pid
    start = start_time(pid)
    if start is None:
        return None
    return f"{_host_scope()}:{pid}:{start[0]}"


def process_alive(token: str | None) -> bool | None:
    """Whether the process named by ``token`` still runs: None when this process
    cannot tell (no token, or another machine or pid namespace)."""
    if not token:
        return None
    scope, pid_text, started_text = (token.rsplit(":", 2) + ["", ""])[:3]
    try:
        pid, started = int(pid_text), int(started_text)
    except ValueError:
        return None
    if scope != _host_scope() or scope == "unknown":
        return None
    now = start_time(pid)
    return now is not None and now[0] == started and now[1] not in ("Z", "X")


# --------------------------------------------------------------------------- waiting for the broker
@dataclass(frozen=True)
class BrokerPatience:
    """How long a student's calls wait for the broker's answer (HELLO, SET_MODEL, STOP).

    A live broker that is merely slow is waited for, one that is gone fails the call fast.
    A broker starting on a loaded machine can take minutes before it serves (its process
    imports torch), and one starved of CPU or stopped answers nothing for as long: a fixed
    timeout takes either for a dead one. The signs of life, in this order:

    - the broker's process, when the caller knows it (``pid``: mode=local's students, whose
      broker runs beside them): exited, the call fails at once; running, the call waits;
    - else anything heard from the broker (a heartbeat answer, a message on the call's own
      socket): the call gives up after ``silence_s`` without one;

    and no call waits past ``max_wait_s``. Build it with :meth:`of`, which names the
    process as it is now (a pid recycled later is not taken for the broker).
    """

    pid: int | None = None
    token: str | None = None
    """The broker's :func:`process_token` (None with a ``pid``: it had exited already)."""
    silence_s: float = BROKER_SILENCE_S
    max_wait_s: float = BROKER_WAIT_S

    @classmethod
    def of(cls, pid: int | None, silence_s: float = BROKER_SILENCE_S,
           max_wait_s: float = BROKER_WAIT_S) -> BrokerPatience:
        token = process_token(pid) if pid is not None else None
        if pid is not None and token is None and _pid_exists(pid):
            pid = None  # it runs, but this system cannot name it (no /proc): its answers tell
        return cls(pid, token, silence_s, max_wait_s)

    def broker_runs(self) -> bool | None:
        """Whether the broker's process runs (None: not known, or not from here)."""
        if self.pid is None:
            return None
        return process_alive(self.token) if self.token is not None else False


class BrokerRefusal(RuntimeError):
    """The broker answered a call (HELLO, SET_MODEL, STOP) with an ERROR: it runs, and
    refuses; ``reason`` is its own (a limit it names, a leader it prefers)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class BrokerWait:
    """One call's wait for the broker's answer, under a :class:`BrokerPatience`.

    ``caller`` sent ``command`` to ``endpoint``; ``timeout_s`` bounds this call further (a
    caller that asks again itself).
    """

    def __init__(self, caller: str, command: Command, endpoint: str, heart: Heartbeater,
                 patience: BrokerPatience, timeout_s: float | None = None) -> None:
        self.what = f"{caller}: no answer to {command.name} from the broker at {endpoint}"
        """What is missing, as the errors say it."""
        self.refused_what = f"{caller}: the broker at {endpoint} refused {command.name}"
        self.waiting_what = f"{caller}: waiting for the broker at {endpoint} to answer {command.name}"
        self.heart = heart
        self.patience = patience
        self.limit_s = patience.max_wait_s if timeout_s is None else min(timeout_s, patience.max_wait_s)
        self.started = self._last_said = time.monotonic()
        self.last_heard: float | None = None
        """When something last came on the call's own socket (None: nothing yet)."""

    def heard(self) -> None:
        """Something came from the broker on the call's own socket."""
        self.last_heard = time.monotonic()

    def refused(self, reason: str) -> BrokerRefusal:
        """The error to raise for the broker's ERROR in answer: the wait is over."""
        return BrokerRefusal(f"{self.refused_what}: {reason}", reason)

    def check(self) -> None:
        """Raise when the call should stop waiting: ConnectionError when the broker's process
        has exited, TimeoutError past the limit or after ``silence_s`` of silence."""
        patience, now = self.patience, time.monotonic()
        runs = patience.broker_runs()
        if runs is False:
            raise ConnectionError(f"{self.what}: the broker's process (pid {patience.pid}) has exited")
        waited_s = now - self.started
        if waited_s >= self.limit_s:
            knob = "; raise broker_wait_s (pipeline.broker_wait_s) to wait longer" \
                if self.limit_s >= patience.max_wait_s else ""
            raise TimeoutError(f"{self.what} in {waited_s:.0f}s ({self._signs(runs, now)}){knob}")
        silent_s = now - max(self.started, self._heard_at() or self.started)
        if not runs and silent_s >= patience.silence_s:
            raise TimeoutError(f"{self.what}: nothing heard from the broker for {patience.silence_s:.0f}s; is "
                               "`python -m distill mode=broker` running?")
        if now - self._last_said >= WAIT_LOG_EVERY_S:
            self._last_said = now
            log.info("%s: %.0fs so far (%s; giving up after %.0fs)", self.waiting_what, waited_s,
                     self._signs(runs, now), self.limit_s)

    def _heard_at(self) -> float | None:
        """When the broker was last heard from, here or by the heartbeats (None: never)."""
        times = [t for t in (self.last_heard, self.heart.last_answer) if t is not None]
        return max(times, default=None)

    def _signs(self, runs: bool | None, now: float) -> str:
        if runs:
            return f"its process, pid {self.patience.pid}, runs"
        heard = self._heard_at()
        return f"last heard from {now - heard:.0f}s ago" if heard is not None else "never heard from"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- writers
_writers = itertools.count(1)


def new_writer_id() -> int:
    """A slot writer's id, as slot headers carry it (``slot.py``): the process id (bits
    63..32), the low 16 bits of its start time (31..16: a recycled pid is told apart)
    and a per-process counter (15..0: two workers in one process are two writers)."""
    start = start_time(os.getpid())
    ticks = 0 if start is None else start[0] & 0xFFFF
    return (os.getpid() << 32) | (ticks << 16) | (next(_writers) & 0xFFFF or 1)


def writer_alive(writer: int) -> bool | None:
    """Whether the process of a writer id still runs (None: no such id, 0)."""
    if writer <= 0:
        return None
    pid, ticks = writer >> 32, (writer >> 16) & 0xFFFF
    now = start_time(pid) if 0 < pid < 2**31 else None
    return now is not None and now[0] & 0xFFFF == ticks and now[1] not in ("Z", "X")
