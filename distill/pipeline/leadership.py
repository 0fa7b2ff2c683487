"""A run's leader secret, kept on disk so that a restarted leader is still the run's leader.

One file per run id, private to the user (a 0600 file in a 0700 directory: anyone who
can read it leads the run), created by the job's first start and read by every later
one. The file is made whole before it gets its name (written under a temporary name,
then linked), so a rank that reads it while another creates it never sees half a
secret. Why: docs/security.md, section Leaders, roles and numbers (issue 37).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from pathlib import Path

from distill.pipeline.endpoints import open_private_dir, prepare_directory

SECRET_BYTES = 16
"""Random bytes in a secret (32 hex characters; the broker needs at least 16 characters)."""


def secret_file_name(run_id: str) -> str:
    """The file's name for ``run_id`` (hashed: any run id makes a safe, short name)."""
    return f"leader-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}.secret"


def run_secret(directory: Path, run_id: str) -> str:
    """The leader secret of ``run_id`` kept in ``directory`` (made private if missing):
    read if a start of this run made it, else made now."""
    prepare_directory(directory)
    dir_fd = open_private_dir(directory)
    try:
        name = secret_file_name(run_id)
        secret = _read(dir_fd, name)
        return secret if secret is not None else _create(dir_fd, name)
    finally:
        os.close(dir_fd)


def _read(dir_fd: int, name: str) -> str | None:
    """The secret in ``name``, None if there is none; refuse a file another user could read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"leader secret file {name} is not a private file of this user "
                                  "(mode 0600); remove it to let the next start make a new one")
        secret = file.read().strip()
    if len(secret) < 2 * SECRET_BYTES:
        raise PermissionError(f"leader secret file {name} holds {len(secret)} characters, not "
                              f"{2 * SECRET_BYTES}; remove it to let the next start make a new one")
    return secret


def _create(dir_fd: int, name: str) -> str:
    """Write a new secret under a temporary name and link it to ``name``; if another process
    linked its own first, that one is the run's."""
    secret = secrets.token_hex(SECRET_BYTES)
    temporary = f"{name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secret)
        try:
            os.link(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileExistsError:
            existing = _read(dir_fd, name)
            if existing is None:
                raise FileNotFoundError(f"leader secret file {name} was removed while it was made") from None
            return existing
        return secret
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=dir_fd)
