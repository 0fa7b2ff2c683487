"""The socket directory: private, never reached through a symbolic link, one broker's at a time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distill.pipeline.endpoints import LOCK_NAME, BrokerLock, BrokerRunningError, prepare_endpoint


def test_a_socket_directory_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    """A link planted where the socket directory goes (/tmp/distill-<uid>) could point our
    sockets, and everything that trusts the directory, into a directory of someone's choice."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "sock"
    link.symlink_to(real)
    with pytest.raises(PermissionError, match="symbolic link"):
        prepare_endpoint(f"ipc://{link}/frontend.sock")
    with pytest.raises(PermissionError, match="symbolic link"):
        BrokerLock().acquire([f"ipc://{link}/frontend.sock"])
    prepare_endpoint(f"ipc://{real}/frontend.sock")  # the real directory itself is fine


def test_the_broker_lock_is_exclusive_names_the_holder_and_ends_with_it(tmp_path: Path) -> None:
    endpoints = [f"ipc://{tmp_path}/sock/frontend.sock", "tcp://127.0.0.1:5555",
                 f"ipc://{tmp_path}/sock/backend.sock", f"ipc://{tmp_path}/other/control.sock"]
    first = BrokerLock()
    first.acquire(endpoints)
    assert (tmp_path / "sock" / LOCK_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(BrokerRunningError, match=rf"pid {os.getpid()}\) is serving the sockets in {tmp_path}/sock"):
        BrokerLock().acquire(endpoints)
    with pytest.raises(BrokerRunningError, match="other"):
        BrokerLock().acquire([f"ipc://{tmp_path}/other/control.sock"])
    first.release()
    again = BrokerLock()
    again.acquire(endpoints)
    again.release()


def test_a_lock_file_that_is_a_link_or_not_a_file_is_refused(tmp_path: Path) -> None:
    sock = tmp_path / "sock"
    sock.mkdir(mode=0o700)
    (sock / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match=LOCK_NAME):
        BrokerLock().acquire([f"ipc://{sock}/frontend.sock"])
    (sock / LOCK_NAME).unlink()
    os.mkfifo(sock / LOCK_NAME, 0o600)  # opened without blocking, then refused
    with pytest.raises(PermissionError, match="not a regular file"):
        BrokerLock().acquire([f"ipc://{sock}/frontend.sock"])
