"""POSIX shared memory: the default medium (students and workers on one machine).

A student creates one segment of ``slot_count * slot_stride`` bytes; workers map it
by name and write samples straight into its slots.

Ownership and hygiene:

- Segments are named ``dst_<run>_<pid>_<n>`` so a worker can refuse names that are
  not ours, and are created 0600 (private to the user) with ``O_EXCL``.
- The space is reserved up front (``posix_fallocate``): a full ``/dev/shm`` gives a
  clear error at creation instead of a SIGBUS on first touch.
- The owner holds an ``flock`` on the segment for its whole life. The kernel drops
  it when the owner dies, however it dies, so :func:`sweep_orphans` can tell a
  leftover segment (lock free) from a live one (lock held) without trusting pids.
- Only the owner unlinks (on ``close``, context exit, interpreter exit). Nothing
  here registers with ``multiprocessing.resource_tracker``: attaching processes
  neither unlink nor warn about segments they do not own.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref

from distill.pipeline.mediums.base import MediumBase
from distill.pipeline.notices import sweep_inboxes

log = logging.getLogger(__name__)

SHM_PREFIX = "dst_"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^dst_[A-Za-z0-9]{1,16}_\d{1,10}_\d{1,10}$")
_counter = itertools.count()


class ShmSpaceError(ValueError):
    """Not enough free shared memory for the requested slots."""


def new_run_id() -> str:
    """A short random run id (fits macOS's 31-character shm names)."""
    return secrets.token_hex(4)


def is_our_name(name: str) -> bool:
    """True for names this project creates (workers attach to nothing else)."""
    return bool(_NAME_RE.match(name))


def segment_name(run_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9]", "", run_id)[:16] or "run"
    return f"{SHM_PREFIX}{safe}_{os.getpid()}_{next(_counter)}"


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where there is no such mount."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_shm_space(nbytes: int, what: str = "these slots") -> None:
    """Raise ShmSpaceError with sizing advice when /dev/shm cannot hold ``nbytes``."""
    free = shm_free_bytes()
    if free is not None and nbytes > free:
        raise ShmSpaceError(
            f"{SHM_DIR} has {free / 2**20:.1f} MiB free, {what} need {nbytes / 2**20:.1f} MiB; "
            "raise --shm-size (docker) or the tmpfs size, or lower slot_count / the sample size"
        )


class SharedMemoryManager(MediumBase):
    """A slot-structured POSIX shared-memory segment.

    ``read_only=True`` creates and owns the segment (the seed README's naming: the
    student only reads it); ``read_only=False`` attaches to an existing one by
    ``name`` (workers write into it).
    """

    def __init__(self, slot_count: int, slot_stride: int, read_only: bool = True,
                 run_id: str | None = None, name: str | None = None) -> None:
        if slot_count <= 0 or slot_stride <= 0:
            raise ValueError(f"slot_count ({slot_count}) and slot_stride ({slot_stride}) must be > 0")
        self._slot_count = slot_count
        self._slot_stride = slot_stride
        self.owner = read_only
        self.run_id = run_id or new_run_id()
        size = slot_count * slot_stride
        if self.owner:
            self._name = name or segment_name(self.run_id)
            self._fd, self._mmap = _create(self._name, size)
            self._finalizer = weakref.finalize(self, _release, self._mmap, self._fd, self._name, True)
        else:
            if name is None:
                raise ValueError("attaching to shared memory needs the segment's name (name=...)")
            self._name = name
            self._fd = -1
            self._mmap = attach_segment(name, size)
            self._finalizer = weakref.finalize(self, _release, self._mmap, -1, name, False)
        self._buf = memoryview(self._mmap)

    @property
    def buf_name(self) -> str:
        return self._name

    @property
    def buf(self) -> memoryview:
        if self._buf is None:
            raise RuntimeError(f"shared memory {self._name} is closed")
        return self._buf

    def close(self) -> None:
        """Unmap; the owner also unlinks (so ``with`` blocks leave nothing behind)."""
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        self._finalizer()

    def unlink(self) -> None:
        """Remove the name now (owner only). Mapped views stay valid until close."""
        if not self.owner:
            raise PermissionError(f"{self._name}: only the owner may unlink")
        _unlink(self._name)


def _create(name: str, size: int) -> tuple[int, mmap.mmap]:
    check_shm_space(size)
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.fchmod(fd, 0o600)  # umask could only have narrowed it; make it exact
        _reserve(fd, name, size)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise


def _reserve(fd: int, name: str, size: int) -> None:
    os.ftruncate(fd, size)
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            free = shm_free_bytes()
            raise ShmSpaceError(
                f"could not reserve {size / 2**20:.1f} MiB for {name}: {SHM_DIR} has "
                f"{(free or 0) / 2**20:.1f} MiB free; raise --shm-size or lower slot_count"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def attach_segment(name: str, min_size: int) -> mmap.mmap:
    """Map an existing segment of ours for writing, after checking it is safe to."""
    if not is_our_name(name):
        raise PermissionError(f"refusing to attach {name!r}: not a distill segment name")
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"refusing to attach {name!r}: not private to this user")
        if st.st_size < min_size:
            raise ValueError(f"segment {name!r} has {st.st_size} bytes, expected >= {min_size}")
        return mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)


def _release(mapping: mmap.mmap, fd: int, name: str, owner: bool) -> None:
    try:
        mapping.close()
    except BufferError:
        log.debug("shared memory %s still has exported views; it stays mapped until they go", name)
    if owner:
        _unlink(name)
        os.close(fd)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def list_segments() -> list[str]:
    """Names of this project's segments in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if is_our_name(n))
    except FileNotFoundError:
        return []


def sweep_orphans(min_age_s: float = 2.0, inbox_dir: str | os.PathLike | None = None) -> list[str]:
    """Unlink our segments whose owner is gone (nobody holds their lock), and the notice
    inboxes (``notices.py``, in ``inbox_dir`` or the default socket directory) of
    segments that are gone. Returns the segments."""
    swept = []
    now = time.time()
    for name in list_segments():
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_ctime < min_age_s:
                continue  # its creator may not have taken the lock yet
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live owner holds it
        finally:
            os.close(fd)
        _unlink(name)
        swept.append(name)
    sweep_inboxes(lambda segment: os.path.exists(os.path.join(SHM_DIR, segment)), inbox_dir,
                  min_age_s=min_age_s)
    if swept:
        log.info("swept %d orphaned shared-memory segment(s): %s", len(swept), ", ".join(swept))
    return swept
