"""Direct completion notices: a worker tells a student on its machine "filled" itself.

The broker's round trip for one batch of slots is four ZeroMQ hops (REQUEST, WORK,
DONE, COMPLETE) through three processes, each hop waking a ZeroMQ I/O thread on
both ends. For large samples on few cores those wake-ups, not the copy, decide how
many slots must be in flight, and a ring that fits the CPU cache then starves
(README, "Transport"). This module takes the last two hops off the critical path
for workers that write a student's shared memory:

- A student whose medium is shared memory binds a Unix datagram socket (its
  *inbox*) named after its segment, in a private socket directory (mode 0700:
  only this user can send to it): ``endpoints.runtime_dir``, or the ``notice_dir``
  the student and its workers are both given (the app: ``pipeline.socket_dir``).
- A worker that has written and committed slots of such a segment sends the
  student one datagram per (segment, generation): a COMPLETE body,
  ``{"generation": g, "slots": [[slot, request_id, true], ...]}``, with no I/O
  thread on either side, then says DONE to the broker with ``notified`` naming the
  segments it reached. The broker does its bookkeeping (credit, dedupe, stats,
  DISCARDED for stale work, failures) and sends COMPLETE only for what was not
  notified.

A notice is only ever a hint that gets the same checks as the broker's COMPLETE
(pending slot with that request id, header of that generation and request id),
so a late, repeated or forged notice is refused like a foreign COMPLETE. Failed
and stale slots are never notified: they still go through the broker. A notice
that cannot be sent (no inbox: another machine, another socket directory, a
network-medium student, a student gone; or its queue is full: the kernel holds at
most ``net.unix.max_dgram_qlen`` datagrams per inbox, often 10) costs nothing but
the fallback: the worker does not list that segment, and the broker completes it.
"""

from __future__ import annotations

import contextlib
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
MAX_PATH_BYTES = 107
"""sun_path holds 108 bytes with the terminating NUL (Linux)."""
MAX_NOTICE_BYTES = 1 << 20
"""Largest datagram an inbox reads, and so the largest a worker sends (about 65,000
slots; the kernel's send buffer, ``net.core.wmem_default``, usually caps it lower)."""
INBOX_BUFFER_BYTES = 1 << 20
MAX_CACHED_PATHS = 1024


def inbox_dir(directory: str | os.PathLike | None = None) -> Path:
    """The directory of the inboxes: ``directory``, or by default the user's socket directory."""
    return Path(directory) if directory is not None else runtime_dir()


def notice_path(segment: str, directory: str | os.PathLike | None = None) -> Path:
    """Where the inbox of the student that owns ``segment`` lives."""
    return inbox_dir(directory) / f"{segment}{NOTICE_SUFFIX}"


def encode_notice(generation: int, slots: list[list]) -> bytes:
    """One datagram: the three frames of a COMPLETE message, msgpack'ed together."""
    frames = protocol.encode(Command.COMPLETE, {"generation": generation, "slots": slots})
    return msgpack.packb(frames, use_bin_type=True)


def decode_notice(data: bytes | memoryview) -> Message:
    """Parse and validate one datagram; ProtocolError on anything but a COMPLETE."""
    try:
        frames = msgpack.unpackb(data, raw=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"notice is not msgpack ({type(exc).__name__})") from None
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise ProtocolError("notice must be a list of frames")
    msg = protocol.decode(frames)
    if msg.command is not Command.COMPLETE:
        raise ProtocolError(f"command {msg.command.name} not accepted in a notice")
    return msg


def sweep_inboxes(segment_exists: Callable[[str], bool], directory: str | os.PathLike | None = None,
                  min_age_s: float = 2.0) -> list[str]:
    """Remove inboxes whose segment is gone (their owner died without closing them).
    An owner makes its segment before its inbox and removes the inbox first, so a
    live owner's inbox always has its segment. Returns the segments swept."""
    directory = inbox_dir(directory)
    swept, now = [], time.time()
    try:
        paths = [p for p in directory.iterdir() if p.name.endswith(NOTICE_SUFFIX)]
    except OSError:
        return swept
    for path in paths:
        segment = path.name[:-len(NOTICE_SUFFIX)]
        with contextlib.suppress(OSError):
            if not segment_exists(segment) and now - path.lstat().st_mtime >= min_age_s:
                path.unlink()
                swept.append(segment)
    return swept


class NoticeInbox:
    """A student's end: a bound, non-blocking Unix datagram socket (see module docstring).
    Its file goes when it is closed, garbage-collected or the interpreter exits, and
    :func:`sweep_inboxes` takes those of owners that were killed."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path = path
        self._buffer = bytearray(MAX_NOTICE_BYTES)
        self._view = memoryview(self._buffer)
        self._finalizer = weakref.finalize(self, _remove, sock, path)

    @classmethod
    def open(cls, segment: str, directory: str | os.PathLike | None = None) -> NoticeInbox | None:
        """Bind the inbox of ``segment``; None (notices then go through the broker) when
        the socket directory is not private to this user or the socket cannot be made."""
        path = notice_path(segment, directory)
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            log.info("no direct notices: %s is longer than a Unix socket path may be", path)
            return None
        try:
            prepare_endpoint(f"ipc://{path}")  # the directory must be this user's alone
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError as exc:
            log.info("no direct notices for %s: %s", segment, exc)
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, INBOX_BUFFER_BYTES)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a leftover of a crashed owner of the same name
            sock.bind(os.fspath(path))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            log.info("no direct notices for %s: %s", segment, exc)
            return None
        return cls(sock, path)

    def fileno(self) -> int:
        return self._sock.fileno()

    def receive(self) -> list[Message]:
        """Every notice waiting now (bad datagrams are logged and dropped)."""
        messages = []
        while True:
            try:
                size = self._sock.recv_into(self._buffer)
            except (BlockingIOError, InterruptedError):
                return messages
            try:
                messages.append(decode_notice(self._view[:size]))
            except ProtocolError as exc:
                log.warning("%s: bad notice dropped: %s", self.path.name, exc.reason)

    def close(self) -> None:
        """Close and remove the socket file (idempotent)."""
        self._finalizer()


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

    def send(self, segment: str, generation: int, slots: list[list]) -> bool:
        """Notify the owner of ``segment``; False when it cannot be reached now (the
        broker's COMPLETE must then carry these slots)."""
        data = encode_notice(generation, slots)
        if len(data) > MAX_NOTICE_BYTES:  # an inbox would read it truncated, and drop it
            self.missed += 1
            return False
        path = self._paths.get(segment)
        if path is None:
            if len(self._paths) >= MAX_CACHED_PATHS:
                self._paths.clear()
            path = self._paths[segment] = os.fspath(notice_path(segment, self._directory))
        try:
            self._sock.sendto(data, path)
        except OSError as exc:
            self.missed += 1
            if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ENOBUFS):
                log.debug("notice to %s not sent: %s", segment, exc)
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._sock.close()


def _remove(sock: socket.socket, path: Path) -> None:
    sock.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
