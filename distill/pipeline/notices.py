"""Direct completion notices and request lanes: the Unix datagrams between a worker and
the students on its machine, past the broker.

A student with a shared-memory medium binds an *inbox* named after its segment in the
private (0700) socket directory (``endpoints.runtime_dir``, or the ``socket_dir`` both
sides are given); a worker that committed slots of that segment sends it one datagram
per (segment, generation), a COMPLETE body ``{"generation": g, "slots": [[slot,
request_id, true], ...]}``, then names the segment in ``DONE.notified``. A worker's
*lane* (``<peer_id>.lane``) takes the students' DIRECT requests the other way.

Invariants to keep when editing:

- a notice is only a hint: it gets every check of the broker's COMPLETE, so a late,
  repeated or forged one is refused; failed and stale slots are never notified, and a
  notice that cannot be sent is left to the broker (the segment is not listed);
- a worker fills a DIRECT only for a run and generation whose model the broker gave it,
  and answers everything else DECLINED; it keeps an answer it cannot deliver now and
  retries it for ``ANSWER_RETRY_S`` (the broker cannot complete a fill it never
  dispatched);
- a student never asks the broker for a slot a live worker holds by a DIRECT, not even
  after a broker restart (two writers could race on it).

See docs/pipeline.md, sections Notices and Direct requests.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import msgpack

from distill.pipeline import protocol
from distill.pipeline.endpoints import prepare_endpoint, runtime_dir
from distill.pipeline.protocol import Command, Message, ProtocolError

log = logging.getLogger(__name__)

NOTICE_SUFFIX = ".notice"
LANE_SUFFIX = ".lane"
MAX_PATH_BYTES = 107
"""sun_path holds 108 bytes with the terminating NUL (Linux)."""
MAX_NOTICE_BYTES = 1 << 20
"""Largest datagram an inbox reads, and so the largest a worker sends (about 65,000
slots; the kernel's send buffer, ``net.core.wmem_default``, usually caps it lower)."""
INBOX_BUFFER_BYTES = 1 << 20
MAX_CACHED_PATHS = 1024
ANSWER_RETRY_S = 10.0
"""How long a worker keeps trying to deliver the answer to a DIRECT request."""


def inbox_dir(directory: str | os.PathLike | None = None) -> Path:
    """The directory of the inboxes: ``directory``, or by default the user's socket directory."""
    return Path(directory) if directory is not None else runtime_dir()


def notice_path(segment: str, directory: str | os.PathLike | None = None) -> Path:
    """Where the inbox of the student that owns ``segment`` lives."""
    return inbox_dir(directory) / f"{segment}{NOTICE_SUFFIX}"


def lane_path(peer_id: str, directory: str | os.PathLike | None = None) -> Path:
    """Where the request lane of the worker ``peer_id`` lives."""
    return inbox_dir(directory) / f"{peer_id}{LANE_SUFFIX}"


def encode_datagram(command: Command, body: dict) -> bytes:
    """One datagram: the three frames of a message, msgpack'ed together."""
    return msgpack.packb(protocol.encode(command, body), use_bin_type=True)


def encode_notice(generation: int, slots: list[list], lane: str | None = None,
                  process: str | None = None) -> bytes:
    """A COMPLETE datagram; ``lane`` and ``process`` name the worker's request lane."""
    body = {"generation": generation, "slots": slots}
    if lane is not None:
        body["lane"], body["process"] = lane, process
    return encode_datagram(Command.COMPLETE, body)


def decode_datagram(data: bytes | memoryview, accepted: frozenset[Command]) -> Message:
    """Parse and validate one datagram; ProtocolError on garbage or a command not ``accepted``."""
    try:
        frames = msgpack.unpackb(data, raw=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"datagram is not msgpack ({type(exc).__name__})") from None
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise ProtocolError("datagram must be a list of frames")
    msg = protocol.decode(frames)
    if msg.command not in accepted:
        raise ProtocolError(f"command {msg.command.name} not accepted here")
    return msg


INBOX_COMMANDS = frozenset({Command.COMPLETE, Command.DECLINED})
LANE_COMMANDS = frozenset({Command.DIRECT})


def decode_notice(data: bytes | memoryview) -> Message:
    """A datagram of a student's inbox: COMPLETE or DECLINED."""
    return decode_datagram(data, INBOX_COMMANDS)


def sweep_inboxes(segment_exists: Callable[[str], bool], directory: str | os.PathLike | None = None,
                  min_age_s: float = 2.0) -> list[str]:
    """Remove inboxes whose segment is gone (their owner died without closing them),
    and request lanes nobody is bound to (their worker was killed). An owner makes its
    segment before its inbox and removes the inbox first, so a live owner's inbox
    always has its segment. Returns the names swept."""
    directory = inbox_dir(directory)
    swept, now = [], time.time()
    try:
        paths = [p for p in directory.iterdir() if p.name.endswith((NOTICE_SUFFIX, LANE_SUFFIX))]
    except OSError:
        return swept
    for path in paths:
        with contextlib.suppress(OSError):
            if now - path.lstat().st_mtime < min_age_s:
                continue
            if path.name.endswith(NOTICE_SUFFIX):
                name = path.name[:-len(NOTICE_SUFFIX)]
                orphan = not segment_exists(name)
            else:
                name, orphan = path.name, not _bound(path)
            if orphan:
                path.unlink()
                swept.append(name)
    return swept


def _bound(path: Path) -> bool:
    """Whether a process is bound to the datagram socket file at ``path`` (connecting
    sends nothing; it is refused when nobody is)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:
            return False
        except OSError:
            return True  # cannot tell: leave it
    return True


class _BoundEnd:
    """A bound, non-blocking Unix datagram socket whose file goes when it is closed,
    garbage-collected or the interpreter exits."""

    def __init__(self, sock: socket.socket, path: Path, accepted: frozenset[Command]) -> None:
        self._sock = sock
        self.path = path
        self._inode = os.stat(path).st_ino
        self._accepted = accepted
        self._buffer = bytearray(MAX_NOTICE_BYTES)
        self._view = memoryview(self._buffer)
        self._finalizer = weakref.finalize(self, _remove, sock, path)

    @staticmethod
    def _bind(path: Path, what: str) -> socket.socket | None:
        """The socket bound at ``path``, or None (logged) when the directory is not private
        to this user or the socket cannot be made."""
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            log.info("no %s: %s is longer than a Unix socket path may be", what, path)
            return None
        try:
            prepare_endpoint(f"ipc://{path}")  # the directory must be this user's alone
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError as exc:
            log.info("no %s at %s: %s", what, path, exc)
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, INBOX_BUFFER_BYTES)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a leftover of a crashed owner of the same name
            sock.bind(os.fspath(path))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            log.info("no %s at %s: %s", what, path, exc)
            return None
        return sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def present(self) -> bool:
        """Whether our socket file is still where senders look for it (not removed or replaced)."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def receive(self, limit: int | None = None) -> list[Message]:
        """The datagrams waiting now, up to ``limit`` read (bad ones are logged and dropped)."""
        messages, reads = [], 0
        while limit is None or reads < limit:
            reads += 1
            try:
                size = self._sock.recv_into(self._buffer)
            except (BlockingIOError, InterruptedError):
                return messages
            try:
                messages.append(decode_datagram(self._view[:size], self._accepted))
            except ProtocolError as exc:
                log.warning("%s: bad datagram dropped: %s", self.path.name, exc.reason)
        return messages

    def close(self) -> None:
        """Close and remove the socket file (idempotent)."""
        self._finalizer()


class NoticeInbox(_BoundEnd):
    """A student's end (see module docstring): notices and declines come in, and its
    DIRECT requests go out from the same socket."""

    @classmethod
    def open(cls, segment: str, directory: str | os.PathLike | None = None) -> NoticeInbox | None:
        """Bind the inbox of ``segment``; None (notices then go through the broker) when
        the socket directory is not private to this user or the socket cannot be made."""
        path = notice_path(segment, directory)
        sock = cls._bind(path, "direct notices")
        return None if sock is None else cls(sock, path, INBOX_COMMANDS)

    def send_to(self, path: str, data: bytes) -> bool:
        """Send one datagram to the socket at ``path``; False when it was not queued
        there (gone, nobody bound, queue full)."""
        try:
            self._sock.sendto(data, path)
        except OSError:
            return False
        return True


class RequestLane(_BoundEnd):
    """A worker's end for DIRECT requests (see module docstring)."""

    @classmethod
    def open(cls, peer_id: str, directory: str | os.PathLike | None = None) -> RequestLane | None:
        path = lane_path(peer_id, directory)
        sock = cls._bind(path, "request lane")
        return None if sock is None else cls(sock, path, LANE_COMMANDS)

    def shut(self) -> list[Message]:
        """Stop taking requests: remove the file first (a student's send then fails and it
        asks the broker), then return what was already queued, to be declined."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        waiting = self.receive()
        self.close()
        return waiting


class Delivery(enum.Enum):
    """What became of a datagram a worker sent to an inbox."""

    SENT = "sent"
    BUSY = "busy"
    """The inbox's queue is full now: the student is alive, try again later."""
    GONE = "gone"
    """No inbox (another machine or directory, or its student is gone), or too large."""


class NoticeOutbox:
    """A worker's end: one unbound, non-blocking datagram socket for every inbox."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._directory = inbox_dir(directory)
        self._paths: dict[str, str] = {}
        """segment -> its inbox's path (the worker maps at most MAX_ATTACHED_SEGMENTS)."""
        self.sent = 0
        self.missed = 0

    def send(self, segment: str, generation: int, slots: list[list], lane: str | None = None,
             process: str | None = None) -> bool:
        """Notify the owner of ``segment``; False when it cannot be reached now (the
        broker's COMPLETE must then carry these slots)."""
        return self.post(segment, encode_notice(generation, slots, lane, process)) is Delivery.SENT

    def post(self, segment: str, data: bytes) -> Delivery:
        """Send one datagram to the inbox of ``segment``'s owner."""
        if len(data) > MAX_NOTICE_BYTES:  # an inbox would read it truncated, and drop it
            self.missed += 1
            return Delivery.GONE
        path = self._paths.get(segment)
        if path is None:
            if len(self._paths) >= MAX_CACHED_PATHS:
                self._paths.clear()
            path = self._paths[segment] = os.fspath(notice_path(segment, self._directory))
        try:
            self._sock.sendto(data, path)
        except OSError as exc:
            self.missed += 1
            if exc.errno in (errno.EAGAIN, errno.ENOBUFS):
                return Delivery.BUSY
            if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                log.debug("notice to %s not sent: %s", segment, exc)
            return Delivery.GONE
        self.sent += 1
        return Delivery.SENT

    def close(self) -> None:
        self._sock.close()


def _remove(sock: socket.socket, path: Path) -> None:
    sock.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
