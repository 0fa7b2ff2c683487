"""Default endpoints, and the private directory that holds IPC sockets.

IPC sockets are files: anyone who can reach the file can talk to the broker. They
live in a directory only this user can enter (0700), by default
``$XDG_RUNTIME_DIR/distill`` or ``/tmp/distill-<uid>``.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_NAMES = ("frontend", "backend", "control", "control_pub")


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


def prepare_endpoint(endpoint: str) -> None:
    """Before binding an ipc endpoint: make its directory private to the user, or refuse
    one that another user owns or could enter (an ipc socket has no other protection)."""
    if not endpoint.startswith("ipc://"):
        return
    directory = Path(endpoint[len("ipc://"):]).parent
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to another user; choose another socket directory")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{directory} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                              "anyone who can enter it could talk to the broker; run "
                              f"`chmod 700 {directory}` or choose a private socket directory "
                              "(pipeline.socket_dir)")
