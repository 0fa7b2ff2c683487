"""Reading the broker's sockets so that no peer can starve the others.

ZeroMQ hands a ROUTER's messages out one peer at a time, which is fair in messages but
not in cost: a small message (HELLO, DONE, a REQUEST of a few slots) costs microseconds,
a large one up to ~20 ms to unpack, and a flooding peer sends nothing but large ones. So
messages are read as they come (cheap: a copy) and

- small ones (at most BULK_BYTES) are handled at once;
- large ones are *parked* per peer and handled one at a time, round robin over peers,
  with the time they took charged: after a parked message that took ``t``, parked
  messages wait ``t * (1 / PARKED_SHARE - 1)``. All parked work together thus gets at
  most PARKED_SHARE of the broker's time while small messages keep coming; once no small
  message has come for QUIET_S, nobody waits behind the parked ones and they are handled
  back to back (a burst of large messages is not stretched tenfold on an idle broker);
- a peer's messages stay in order: once it has one parked, the small ones behind it
  are parked too;
- small messages whose answer costs more than reading them (DEAR_COMMANDS: STATS, STOP,
  which build a snapshot, ``report.py``) are parked as well, each counted as DEAR_BYTES:
  what they cost is charged to their sender like a large message's;
- a peer with MAX_PARKED_BYTES waiting loses what it sends beyond that (counted in
  STATS ``throttled``, logged with the peer): with ZeroMQ's own bound (BROKER_RCVHWM
  messages of at most BROKER_MAX_MESSAGE_BYTES) that is all one peer can park in the
  broker. A peer that is not flooding never has more than a message or two parked.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import zmq

from distill.pipeline import protocol
from distill.pipeline.stats import BrokerStats
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

BULK_BYTES = protocol.UNCOUNTED_BODY_BYTES
"""Messages larger than this may be costly to unpack: they are parked (see module docstring)."""
PARKED_SHARE = 0.1
"""The most of the broker's time that parked (large) messages get while small ones keep coming."""
MAX_PARKED_BYTES = 4 * 2**20
"""What one peer may have parked; what it sends beyond that is dropped."""
QUIET_S = 0.05
"""With no small message for this long, parked messages no longer wait their turn."""
DRAIN_BUDGET_S = 0.001
"""Longest one socket is read in one pass of the loop: then the other sockets, the parked
messages and the dispatcher get their turn (a DONE waits a millisecond, not a flood)."""
DRAIN_MAX_MESSAGES = 256
DEAR_COMMANDS = frozenset({protocol.Command.STATS.value, protocol.Command.STOP.value})
"""Small messages handled within the parked share (see the module docstring)."""
DEAR_BYTES = BULK_BYTES
"""What a parked dear message counts against MAX_PARKED_BYTES: at most 1,024 per peer wait."""

_RCVMORE = int(zmq.RCVMORE)
Route = Callable[[zmq.Socket, bytes, list[bytes], "str | None"], None]
"""Handles one message: the socket, the sender's identity, the frames after it, its key."""


class Ingress:
    """Reads sockets, handles small messages at once and parked large ones fairly."""

    def __init__(self, route: Route, counters: BrokerStats, *, keyed: bool) -> None:
        self._route = route
        self._counters = counters
        self._keyed = keyed
        self._parked: OrderedDict[tuple[int, bytes], deque[tuple[zmq.Socket, list[bytes], str | None, int]]] = \
            OrderedDict()
        self._parked_bytes: dict[tuple[int, bytes], int] = {}
        self._parked_free_at = 0.0
        self._small_at = 0.0
        """When a small message was last handled (perf_counter)."""
        self._drops = LogThrottle(log)

    def drain(self, sock: zmq.Socket) -> None:
        """Take the messages waiting on ``sock``, for at most DRAIN_BUDGET_S."""
        deadline = time.perf_counter() + DRAIN_BUDGET_S
        for _ in range(DRAIN_MAX_MESSAGES):
            identity, frames, key, size = self._recv(sock)
            peer = (id(sock), identity)
            dear = len(frames) > 1 and frames[1] in DEAR_COMMANDS
            if size <= BULK_BYTES and peer not in self._parked and not dear:
                self._small_at = time.perf_counter()
                self._route(sock, identity, frames, key)
            else:
                self._park(sock, peer, frames, key, max(size, DEAR_BYTES) if dear else size)
            if not protocol.readable(sock) or time.perf_counter() > deadline:
                return

    def _recv(self, sock: zmq.Socket) -> tuple[bytes, list, str | None, int]:
        """(identity, frames, CurveZMQ key, bytes) of one message. Frames after the first
        three are not copied out of ZeroMQ (a large body may only be dropped); a frame is
        ``bytes`` or, when large, a ``zmq.Frame`` that :meth:`_frames` turns into bytes."""
        identity = sock.recv()
        frames: list = []
        key = None
        while sock.getsockopt(_RCVMORE):
            if len(frames) < 2:  # the tag and the command: small
                frames.append(sock.recv())
                continue
            frame = sock.recv(copy=False)
            if self._keyed and key is None:
                key = _key(frame)
            frames.append(frame.bytes if len(frame) <= BULK_BYTES else frame)
        return identity, frames, key, sum(len(frame) for frame in frames)

    def _park(self, sock: zmq.Socket, peer: tuple[int, bytes], frames: list, key: str | None,
              size: int) -> None:
        parked = self._parked_bytes.get(peer, 0)
        if parked + size > MAX_PARKED_BYTES:
            self._counters.throttled += 1
            self._drops.warning("%r has %d bytes of messages waiting (the most one peer may): dropped a "
                                "%d-byte message", peer[1][:64], parked, size)
            return
        self._parked.setdefault(peer, deque()).append((sock, frames, key, size))
        self._parked_bytes[peer] = parked + size

    @property
    def waiting_s(self) -> float | None:
        """Seconds until a parked message may be handled (None: nothing parked)."""
        if not self._parked:
            return None
        return max(0.0, self._free_at() - time.perf_counter())

    def _free_at(self) -> float:
        """When the next parked message may be handled: its turn, or sooner once small
        messages stopped coming (QUIET_S)."""
        return min(self._parked_free_at, self._small_at + QUIET_S)

    def serve_parked(self) -> None:
        """Handle the next parked message (of the next peer in turn), if its time has come."""
        now = time.perf_counter()
        if not self._parked or now < self._free_at():
            return
        peer, queue = next(iter(self._parked.items()))
        sock, frames, key, size = queue.popleft()
        self._parked_bytes[peer] -= size
        if queue:
            self._parked.move_to_end(peer)  # round robin: the next peer's turn
        else:
            del self._parked[peer]
            del self._parked_bytes[peer]
        try:
            self._route(sock, peer[1], [f if isinstance(f, bytes) else f.bytes for f in frames], key)
        finally:
            done = time.perf_counter()
            self._parked_free_at = done + (done - now) * (1 / PARKED_SHARE - 1)


def _key(frame: zmq.Frame) -> str | None:
    """The CurveZMQ public key (z85) the frame's connection authenticated with (its ZAP user id)."""
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:  # no ZAP handler on this socket: no key
        return None
