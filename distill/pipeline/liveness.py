"""Heartbeats (the ZeroMQ guide's Paranoid Pirate pattern), from their own thread.

A peer's main thread may be busy for a long time (a teacher forward, a training
step), so heartbeats are sent by a daemon thread on a socket of its own. The
broker answers each HEARTBEAT with its instance id: silence from the broker for ``HEARTBEAT_LIVENESS``
intervals means it is gone, a new instance id that it restarted, and a RECONNECT
answer that it has forgotten us. Either way the owner re-registers.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import zmq

from distill.pipeline import protocol
from distill.pipeline.protocol import Command, ProtocolError

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3
RECONNECT_INTERVAL_INIT_S = 0.1
RECONNECT_INTERVAL_MAX_S = 5.0


def new_peer_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


class Heartbeater:
    """Sends HEARTBEAT every ``interval_s`` to ``endpoint`` and watches the answers."""

    def __init__(self, endpoint: str, peer_id: str, role: str, *,
                 interval_s: float = HEARTBEAT_INTERVAL_S,
                 liveness: int = HEARTBEAT_LIVENESS, first_beat_now: bool = False) -> None:
        self.endpoint = endpoint
        self.peer_id = peer_id
        self.role = role
        self.interval_s = interval_s
        self.liveness = liveness
        self.last_heard = time.monotonic()
        self.broker_id: str | None = None  # the broker instance that answers us
        self.forgotten = threading.Event()  # broker answered RECONNECT, or restarted
        self.introduced = threading.Event()  # some broker instance has answered (broker_id is set)
        self._first_beat_s = 0.0 if first_beat_now else interval_s
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{peer_id}", daemon=True)

    def start(self) -> Heartbeater:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    @property
    def broker_alive(self) -> bool:
        return time.monotonic() - self.last_heard < self.interval_s * self.liveness

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = protocol.configure(ctx.socket(zmq.DEALER), hwm=10)
        sock.connect(self.endpoint)
        try:
            # The first beat waits one interval, so the owner's own first message
            # (READY, REQUEST) reaches the broker before the broker hears of us here
            # (unless the owner asks to learn the broker's instance first: first_beat_now).
            while not self._stop.wait(0 if self._beats else self._first_beat_s):
                self._beats += 1
                protocol.send(sock, Command.HEARTBEAT, {"peer_id": self.peer_id, "role": self.role})
                deadline = time.monotonic() + self.interval_s
                while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    if sock.poll(min(left, 0.1) * 1000):
                        self._on_reply(sock)
        finally:
            sock.close(linger=0)

    def _on_reply(self, sock: zmq.Socket) -> None:
        try:
            msg = protocol.recv(sock)
        except ProtocolError as exc:
            log.warning("heartbeat: bad reply from broker: %s", exc.reason)
            return
        self.last_heard = time.monotonic()
        if msg.command is Command.RECONNECT:
            self.forgotten.set()
        elif msg.command is Command.HEARTBEAT:
            broker_id = msg.body["peer_id"]
            if self.broker_id is not None and broker_id != self.broker_id:
                log.warning("%s: broker restarted (%s -> %s)", self.peer_id, self.broker_id, broker_id)
                self.forgotten.set()
            self.broker_id = broker_id
            self.introduced.set()

