"""Broker: the lifecycle, the poll loop and the one guarded place every message goes through.

Shape of the ZeroMQ guide's Majordomo broker: one poll loop whose timeout is the
heartbeat interval; each message goes to one handler per (socket, command); then
dead and overdue peers are purged. The loop is unbreakable: a handler or dispatch
step that raises is logged with the peer, its message dropped and counted (STATS
``errors``), and the broker serves on.

Peers are served fairly (``ingress.py``) and each socket is read for a bounded time
per pass, so a flood on one socket cannot starve the others (workers' DONEs, STATS, a
leader's SET_MODEL). What one peer can make the broker hold or send is bounded: BROKER_RCVHWM messages of at most BROKER_MAX_MESSAGE_BYTES in
ZeroMQ, MAX_PARKED_BYTES in ours; replies to students and leaders never wait, and a
connection that leaves BROKER_REPLY_HWM of them unread is dropped (``_drop_deaf``).
See docs/pipeline.md, section Limits.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import ServerKeys, start_authenticator
from distill.pipeline.broker.backend import Backend
from distill.pipeline.broker.config import BrokerConfig
from distill.pipeline.broker.control import Control
from distill.pipeline.broker.dispatch import Dispatcher
from distill.pipeline.broker.frontend import Frontend
from distill.pipeline.broker.ingress import Ingress
from distill.pipeline.broker.records import Impostor
from distill.pipeline.broker.report import StatsReport
from distill.pipeline.broker.state import BrokerState, Sockets
from distill.pipeline.endpoints import BrokerLock, default_endpoint, prepare_endpoint
from distill.pipeline.protocol import Command, ProtocolError
from distill.pipeline.stats import BrokerStats
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

Handler = Callable[[bytes, "str | None", dict], None]


class Broker:
    """Routes REQUESTs to workers and DONEs back to students (see ``distill.pipeline.broker``).

    ``Broker(config=BrokerConfig(...))``, or the seed README's keywords
    (``Broker(frontend_endpoint, backend_endpoint, control_endpoint, control_pub_endpoint,
    heartbeat_interval_s=..., max_queued=..., curve=...)``): every keyword is a field of
    :class:`BrokerConfig` and overrides ``config``'s.
    """

    def __init__(self, frontend_endpoint: str | None = None, backend_endpoint: str | None = None,
                 control_endpoint: str | None = None, control_pub_endpoint: str | None = None, *,
                 config: BrokerConfig | None = None, **options: Any) -> None:
        given = {"frontend_endpoint": frontend_endpoint, "backend_endpoint": backend_endpoint,
                 "control_endpoint": control_endpoint, "control_pub_endpoint": control_pub_endpoint}
        config = BrokerConfig.build(config, **{k: v for k, v in given.items() if v is not None}, **options)
        self.config = dataclasses.replace(config, **{
            f"{name}_endpoint": getattr(config, f"{name}_endpoint") or default_endpoint(name)
            for name in ("frontend", "backend", "control", "control_pub")})
        if self.config.max_queued_per_student > protocol.DEFAULT_HWM:
            log.warning("max_queued_per_student=%d is above a student's receive high-water mark (%d): a "
                        "student owed that many replies may lose some", self.config.max_queued_per_student,
                        protocol.DEFAULT_HWM)
        # Read (and checked) now, so a bad key fails in the caller, not in the thread.
        self._keys: ServerKeys | None = self.config.curve.server_keys() if self.config.curve else None
        self._state = BrokerState(self.config)
        self._dispatcher = Dispatcher(self._state)
        self._frontend = Frontend(self._state)
        self._backend = Backend(self._state, self._dispatcher)
        self._control = Control(self._state)
        self._report = StatsReport(self._state)
        self._refusals = LogThrottle(log)
        self._deaf = LogThrottle(log)
        self._failures = LogThrottle(log)
        self._lock_files = BrokerLock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def frontend_endpoint(self) -> str:
        return self.config.frontend_endpoint  # type: ignore[return-value]  # resolved in __init__

    @property
    def backend_endpoint(self) -> str:
        return self.config.backend_endpoint  # type: ignore[return-value]

    @property
    def control_endpoint(self) -> str:
        return self.config.control_endpoint  # type: ignore[return-value]

    @property
    def control_pub_endpoint(self) -> str:
        return self.config.control_pub_endpoint  # type: ignore[return-value]

    @property
    def instance_id(self) -> str:
        """Changes with every broker instance: peers tell a restart by it."""
        return self._state.instance_id

    @property
    def endpoints(self) -> list[str]:
        return [self.frontend_endpoint, self.backend_endpoint, self.control_endpoint, self.control_pub_endpoint]

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        """Serve until :meth:`stop` (blocking)."""
        self._lock_files.acquire(self.endpoints)
        ctx = zmq.Context()
        try:
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
                self._loop(socks)
            finally:
                for sock in socks.all():  # (not dataclasses.astuple: it would deep-copy them)
                    sock.close(linger=0)
                self._close_context(ctx, authenticator)
                log.info("broker stopped")
        finally:
            self._lock_files.release()

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
        with self._state.lock:
            return self._state.snapshot()

    def _run_guarded(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
            log.exception("broker failed")

    def _bind(self, ctx: zmq.Context) -> Sockets:
        socks: list[zmq.Socket] = []
        for name, kind, endpoint in (("frontend", zmq.ROUTER, self.frontend_endpoint),
                                     ("backend", zmq.ROUTER, self.backend_endpoint),
                                     ("control", zmq.ROUTER, self.control_endpoint),
                                     ("control_pub", zmq.PUB, self.control_pub_endpoint)):
            replies = name in ("frontend", "control")  # to peers that may not read: never wait on them
            sock = protocol.configure(ctx.socket(kind), hwm=protocol.BROKER_REPLY_HWM if replies else
                                      protocol.BROKER_SNDHWM, rcvhwm=protocol.BROKER_RCVHWM,
                                      max_message_bytes=protocol.BROKER_MAX_MESSAGE_BYTES)
            if replies:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                sock.setsockopt(zmq.SNDTIMEO, 0)
            try:
                prepare_endpoint(endpoint)
                if self._keys is not None:
                    self._keys.apply(sock, name)  # its own ZAP domain: keys are checked per socket
                sock.bind(endpoint)
            except (zmq.ZMQError, OSError) as exc:
                for s in socks + [sock]:
                    s.close(linger=0)
                if isinstance(exc, zmq.ZMQError):
                    raise OSError(f"broker cannot bind {endpoint}: {exc}; is another broker running?") from exc
                raise
            socks.append(sock)
        self._warn_if_open()
        return Sockets(*socks)

    def _warn_if_open(self) -> None:
        tcp = [ep for ep in self.endpoints if ep.startswith("tcp://")]
        if tcp and self._keys is None:
            log.warning("%s take anyone who can reach them: turn on CurveZMQ authentication "
                        "(Broker(curve=...), pipeline.auth_keys_dir) on networks you do not trust",
                        ", ".join(tcp))

    # ------------------------------------------------------------------ loop
    def _loop(self, socks: Sockets) -> None:
        state = self._state
        state.sockets = socks
        table = self._handlers(socks)
        ingress = Ingress(lambda sock, identity, frames, key: self._route(sock, identity, frames, key, table),
                          state.counters, keyed=self._keys is not None)
        poller = zmq.Poller()
        for sock in (socks.frontend, socks.backend, socks.control):
            poller.register(sock, zmq.POLLIN)
        interval_s = self.config.heartbeat_interval_s
        next_purge = time.monotonic() + interval_s
        while not self._stop.is_set():
            parked_in = ingress.waiting_s
            events = dict(poller.poll(1000 * (interval_s if parked_in is None else min(interval_s, parked_in))))
            with state.lock:
                for sock in (socks.control, socks.backend, socks.frontend):  # control first: switches win
                    if sock in events:
                        self._guarded("receive", ingress.drain, sock)
                self._guarded("parked message", ingress.serve_parked)
                self._guarded("dispatch", self._dispatcher.dispatch)
                if socks.unread:
                    self._guarded("drop deaf peers", self._drop_deaf)
                if (now := time.monotonic()) >= next_purge:
                    self._guarded("purge", self._purge, now)
                    next_purge = time.monotonic() + interval_s

    def _purge(self, now: float) -> None:
        self._backend.purge(now)
        self._frontend.purge(now)
        gone = self._state.forget_abandoned_runs(now)
        if gone:
            log.info("forgot %d run(s) without a live peer for %.1fs: %s%s", len(gone), self.config.run_grace,
                     ", ".join(run_id[:40] for run_id in gone[:5]), ", ..." if len(gone) > 5 else "")

    def _guarded(self, step: str, fn: Callable[..., None], *args: Any) -> None:
        """Run a step of the loop; an exception is a bug to log and count, never the end."""
        try:
            fn(*args)
        except Exception:
            self._state.counters.errors += 1
            self._failures.warning("broker %s step failed (the broker serves on): %s", step,
                                   traceback.format_exc(limit=8))

    def _route(self, sock: zmq.Socket, identity: bytes, frames: list[bytes], key: str | None,
               table: dict[tuple[int, Command], Handler]) -> None:
        """One message to its handler; every way it can go wrong ends here, answered."""
        try:
            msg = protocol.decode(frames)
        except ProtocolError as exc:
            self._refuse(sock, identity, exc.reason)
            return
        handler = table.get((id(sock), msg.command))
        if handler is None:
            self._refuse(sock, identity, f"command {msg.command.name} not accepted on this socket", msg.command)
            return
        try:
            handler(identity, key, msg.body)
        except Impostor as exc:
            self._state.counters.foreign += 1
            self._refuse(sock, identity, exc.reason, msg.command)
        except ProtocolError as exc:
            self._refuse(sock, identity, exc.reason, msg.command, getattr(exc, "slots", None))
        except Exception:
            self._state.counters.errors += 1
            self._failures.warning("%s from %r failed (message dropped, the broker serves on): %s",
                                   msg.command.name, identity[:64], traceback.format_exc(limit=8))

    def _handlers(self, socks: Sockets) -> dict[tuple[int, Command], Handler]:
        f, b, c = id(socks.frontend), id(socks.backend), id(socks.control)
        front, back, control = self._frontend, self._backend, self._control
        return {
            (f, Command.HELLO): front.on_hello,
            (f, Command.REQUEST): front.on_request,
            (f, Command.HEARTBEAT): front.on_heartbeat,
            (f, Command.STATS): lambda ident, key, body: self._on_stats(socks.frontend, ident, body),
            (f, Command.BYE): front.on_bye,
            (b, Command.READY): back.on_ready,
            (b, Command.DONE): back.on_done,
            (b, Command.HEARTBEAT): back.on_heartbeat,
            (b, Command.BYE): back.on_bye,
            (b, Command.ERROR): back.on_error,
            (c, Command.SET_MODEL): control.on_set_model,
            (c, Command.STOP): control.on_stop,
            (c, Command.STATS): lambda ident, key, body: self._on_stats(socks.control, ident, body),
        }

    def _on_stats(self, sock: zmq.Socket, identity: bytes, body: dict) -> None:
        self._state.send.reply(sock, identity, self._report.frames(body.get("run_id")))

    def _drop_deaf(self) -> None:
        """Connections whose replies no longer fit (BROKER_REPLY_HWM unread): count what was
        dropped, log it (throttled), and forget their students as if they had missed their
        heartbeats (one that beats again is told RECONNECT)."""
        state = self._state
        unread, state.send.unread = state.send.unread, {}
        for (sock_name, identity), dropped in unread.items():
            state.counters.dropped_replies += dropped
            self._deaf.warning("%s peer %r reads none of its replies: %d dropped, its students forgotten",
                               sock_name, identity[:64], dropped)
            if sock_name == "frontend":
                self._frontend.drop_connection(identity)

    def _refuse(self, sock: zmq.Socket, identity: bytes, reason: str, command: Command | None = None,
                slots: list | None = None) -> None:
        """Count, log (throttled) and answer a refused message with an ERROR saying why."""
        state = self._state
        state.counters.bad_messages += 1
        self._refusals.warning("refused message from %r: %s", identity[:64], reason)
        body: dict[str, Any] = {"reason": reason[:protocol.MAX_STRING_CHARS]}
        if command is not None:
            body["command"] = command.name
        if slots:  # a well-formed REQUEST over a limit: the student asks again later
            if state.echo.take(identity, len(slots)):
                body["slots"] = slots
            else:
                state.counters.throttled += 1
        state.send.reply(sock, identity, protocol.encode(Command.ERROR, body))
