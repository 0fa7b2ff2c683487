"""Default endpoints, the private directory that holds IPC sockets, and its broker lock.

IPC sockets are files: anyone who can reach the file can talk to the broker. They
live in a directory only this user can enter (0700), by default
``$XDG_RUNTIME_DIR/distill`` or ``/tmp/distill-<uid>``. The directory is opened
without following a symlink (``O_NOFOLLOW``) and checked through that descriptor, so
a link planted in /tmp cannot point our sockets into a directory of someone's choice.

Binding an ipc endpoint replaces a socket file that is already there, so a second
broker started on the same directory would silently take every new peer from the
first. A broker therefore holds an exclusive ``flock`` on ``broker.lock`` in each of
its socket directories while it serves; a second one is refused with the first's pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_NAMES = ("frontend", "backend", "control", "control_pub")
LOCK_NAME = "broker.lock"


class BrokerRunningError(OSError):
    """Another broker serves this socket directory (the message names its pid)."""


def runtime_dir() -> Path:
    """The per-user directory for IPC sockets (created 0700 on first use)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "distill" if base else Path(tempfile.gettempdir()) / f"distill-{os.getuid()}"
    return path


def default_endpoint(name: str, directory: str | Path | None = None) -> str:
    """``ipc://<dir>/<name>.sock`` for one of SOCKET_NAMES."""
    if name not in SOCKET_NAMES:
        raise ValueError(f"unknown socket {name!r}; expected one of {SOCKET_NAMES}")
    return f"ipc://{Path(directory or runtime_dir()) / name}.sock"


def ipc_directory(endpoint: str) -> Path | None:
    """The directory of an ``ipc://`` endpoint's socket file (None for other transports)."""
    if not endpoint.startswith("ipc://"):
        return None
    return Path(endpoint[len("ipc://"):]).parent


def prepare_endpoint(endpoint: str) -> None:
    """Before binding an ipc endpoint: make its directory private to the user, or refuse
    one that another user owns or could enter (an ipc socket has no other protection)."""
    directory = ipc_directory(endpoint)
    if directory is not None:
        prepare_directory(directory)


def prepare_directory(directory: Path) -> None:
    """Create ``directory`` private (0700) if it is missing; refuse it if it is not ours alone."""
    if not os.path.lexists(directory):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(open_private_dir(directory))


def open_private_dir(directory: Path) -> int:
    """A descriptor of ``directory``, after checking (through it, not the path) that it is
    a real directory of ours that nobody else can enter."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(directory):
            raise PermissionError(f"{directory} is a symbolic link; give a real directory as the socket "
                                  "directory (pipeline.socket_dir), not a link to one") from None
        raise PermissionError(f"{directory} cannot be used as a socket directory: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{directory} belongs to another user; choose another socket directory")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"{directory} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                                  "anyone who can enter it could talk to the broker; run "
                                  f"`chmod 700 {directory}` or choose a private socket directory "
                                  "(pipeline.socket_dir)")
    except BaseException:
        os.close(fd)
        raise
    return fd


class BrokerLock:
    """The exclusive lock a broker holds on each of its socket directories while it serves."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def acquire(self, endpoints: list[str]) -> None:
        """Lock every ipc directory of ``endpoints``; refuse if another broker holds one."""
        directories = dict.fromkeys(d for ep in endpoints if (d := ipc_directory(ep)) is not None)
        try:
            for directory in directories:
                prepare_directory(directory)
                self._fds.append(_lock_directory(directory))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # the flock goes with the last descriptor
        self._fds.clear()


def _lock_directory(directory: Path) -> int:
    """Open (not following links) and flock ``<directory>/broker.lock``; write our pid in it."""
    dir_fd = open_private_dir(directory)
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise PermissionError(f"{directory / LOCK_NAME} cannot be opened ({exc.strerror}); remove it") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{directory / LOCK_NAME} is not a regular file of ours; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BrokerRunningError(
                f"another broker (pid {_read_pid(fd)}) is serving the sockets in {directory}: stop it, or give "
                "this broker other endpoints (pipeline.socket_dir, or Broker(frontend_endpoint=...))") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return str(int(os.pread(fd, 32, 0).decode().strip()))
    return "unknown"
