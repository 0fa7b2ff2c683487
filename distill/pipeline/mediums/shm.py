"""POSIX shared memory: the default medium (students and workers on one machine).

A student creates one segment of ``slot_count * slot_stride`` bytes of slots followed
by a 64-byte segment header (``slot.py``: the slots' geometry, the sample size, a
random nonce); workers map it by name and write samples straight into its slots,
taking the geometry from that header, never from a request.

Ownership and hygiene, which every change here must keep:

- Segments are named ``dst_<run>_<pid>_<token>`` (``<token>`` random, so the names a
  student will take cannot be squatted; at most ``MAX_NAME_CHARS``), created 0600 with
  ``O_EXCL``; a name found taken is given up for another, up to ``_CREATE_ATTEMPTS``
  (:func:`_create`). Why: docs/security.md, section Other users' files and hostile
  students.
- The creator takes an ``flock`` on the segment the moment it exists and holds it for
  the segment's whole life. The kernel drops it when the owner dies, however it dies,
  so :func:`sweep_orphans` can tell a leftover segment (lock free) from a live one
  (lock held, even while its space is still being reserved) without trusting pids.
- The sweep touches only regular files of this user (opened ``O_NOFOLLOW |
  O_NONBLOCK``, checked with ``fstat`` before anything else): a FIFO, a symlink, a
  directory or another user's file named like ours is left alone, and cannot block
  or fail the process that sweeps.
- The space is reserved up front (``posix_fallocate``): a full ``/dev/shm`` gives a
  clear error at creation instead of a SIGBUS on first touch.
- Only the creating *process* unlinks (on ``close``, context exit, interpreter exit):
  a forked child that inherited the object never does. Nothing here registers with
  ``multiprocessing.resource_tracker``: attaching processes neither unlink nor warn
  about segments they do not own.
- An attached segment keeps its file open, so :meth:`AttachedSegment.current` can tell
  when the name no longer refers to the mapped file (a stale mapping is never
  written), and :meth:`AttachedSegment.intact` when the owner shrank the file under the
  mapping (a write past its new end would be a SIGBUS in the worker).
"""

from __future__ import annotations

import _posixshmem
import base64
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from dataclasses import dataclass

from distill.pipeline.mediums.base import MediumBase
from distill.pipeline.notices import sweep_inboxes
from distill.pipeline.slot import (
    SEGMENT_HEADER_BYTES,
    SegmentHeader,
    read_segment_header,
    segment_bytes,
    set_max_claims,
    write_segment_header,
)

log = logging.getLogger(__name__)

SHM_PREFIX = "dst_"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^dst_[A-Za-z0-9]{1,16}_\d{1,10}_[A-Za-z0-9]{1,16}$")
"""Our names: the ones made now (:func:`segment_name`), and the ``dst_<run>_<pid>_<n>`` of
earlier versions (still swept, and still served by workers)."""
RUN_NAME_CHARS = 8
NAME_TOKEN_BYTES = 5
"""Random bytes in a segment's name (8 base32 characters)."""
MAX_NAME_CHARS = 30
"""Longer names than this fail on macOS (31 characters at most, the leading ``/``
included). Ours have at most 29 for pids of up to 7 digits (Linux's largest ``pid_max``;
macOS's pids have 5)."""
_OPEN_SAFELY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_ATTEMPTS = 8


class ShmSpaceError(ValueError):
    """Not enough free shared memory for the requested slots."""


def new_run_id() -> str:
    """A short random run id (fits macOS's 31-character shm names)."""
    return secrets.token_hex(4)


def is_our_name(name: str) -> bool:
    """True for names this project creates (workers attach to nothing else)."""
    return bool(_NAME_RE.match(name))


def segment_name(run_id: str) -> str:
    """A new name for a segment of ``run_id``: nobody can tell it in advance (module docstring)."""
    safe = re.sub(r"[^A-Za-z0-9]", "", run_id)[:RUN_NAME_CHARS] or "run"
    token = base64.b32encode(secrets.token_bytes(NAME_TOKEN_BYTES)).decode().lower()
    return f"{SHM_PREFIX}{safe}_{os.getpid()}_{token}"


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
    ``name`` (workers write into it), whose segment header must describe exactly
    ``slot_count`` slots of ``slot_stride`` bytes. ``payload_bytes`` (owner) declares
    the sample size, so workers that make samples of another size refuse at once.
    """

    def __init__(self, slot_count: int, slot_stride: int, read_only: bool = True,
                 run_id: str | None = None, name: str | None = None, *, payload_bytes: int = 0) -> None:
        if slot_count <= 0 or slot_stride <= 0:
            raise ValueError(f"slot_count ({slot_count}) and slot_stride ({slot_stride}) must be > 0")
        self._slot_count = slot_count
        self._slot_stride = slot_stride
        self.owner = read_only
        self.run_id = run_id or new_run_id()
        if self.owner:
            self._name, self._fd, self._mmap = _create(name, self.run_id, segment_bytes(slot_count, slot_stride))
            self._creator_pid = os.getpid()
            self.header = SegmentHeader(slot_count, slot_stride, payload_bytes, 0, self._creator_pid,
                                        secrets.token_bytes(16))
            write_segment_header(memoryview(self._mmap), self.header)
            self._finalizer = weakref.finalize(self, _release, self._mmap, self._fd, self._name,
                                               self._creator_pid)
        else:
            if name is None:
                raise ValueError("attaching to shared memory needs the segment's name (name=...)")
            attached = attach_segment(name)
            if (attached.header.slot_count, attached.header.stride) != (slot_count, slot_stride):
                attached.close()
                raise ValueError(f"segment {name!r} holds {attached.header.slot_count} slots of "
                                 f"{attached.header.stride} bytes, not {slot_count} of {slot_stride}")
            self._name, self._fd, self._mmap, self.header = name, attached.fd, attached.mapping, attached.header
            self._creator_pid = None
            self._finalizer = weakref.finalize(self, _release, self._mmap, self._fd, name, None)
        self._whole = memoryview(self._mmap)
        self._buf = self._whole[:slot_count * slot_stride]

    @property
    def buf_name(self) -> str:
        return self._name

    @property
    def buf(self) -> memoryview:
        """The slots (the segment header behind them is not part of it)."""
        if self._buf is None:
            raise RuntimeError(f"shared memory {self._name} is closed")
        return self._buf

    def set_max_claims(self, max_claims: int) -> None:
        """Owner: how many of these slots one writer may claim at once (0: no limit)."""
        if self._whole is None:
            raise RuntimeError(f"shared memory {self._name} is closed")
        set_max_claims(self._whole, max_claims)

    def close(self) -> None:
        """Unmap; the creating process also unlinks (so ``with`` blocks leave nothing behind)."""
        if self._buf is not None:
            self._buf.release()
            self._whole.release()
            self._buf = self._whole = None
        self._finalizer()

    def unlink(self) -> None:
        """Remove the name now (the creating process only). Mapped views stay valid until close."""
        if not self.owner:
            raise PermissionError(f"{self._name}: only the owner may unlink")
        if self._creator_pid != os.getpid():
            raise PermissionError(f"{self._name}: created by process {self._creator_pid}, not this one")
        _unlink(self._name)


def _create(name: str | None, run_id: str, size: int) -> tuple[str, int, mmap.mmap]:
    """Create, lock, size and map a new segment; created again (a given name) or under a new
    name (a generated one) if a concurrent sweep removed the file in the instant before it
    was locked. A generated name that is taken already (a file someone planted there) is
    given up for another generated name; FileExistsError after ``_CREATE_ATTEMPTS`` of them."""
    check_shm_space(size)
    taken: list[str] = []
    for attempt in range(_CREATE_ATTEMPTS):
        chosen = name or segment_name(run_id)
        try:
            fd = _posixshmem.shm_open("/" + chosen, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except FileExistsError:
            if name is None:
                taken.append(chosen)
                log.warning("shared-memory name %s is taken already (not by us): trying another", chosen)
                continue
            if not _swept_in_time(chosen, attempt):
                raise
            continue  # a sweep was removing our last attempt's file under this name
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # first: a sweep now sees a live owner
            except BlockingIOError:  # a sweep holds the new, unlocked file to look at it and
                os.close(fd)         # will remove it: try again
                continue
            if os.fstat(fd).st_nlink == 0:  # swept between shm_open and flock: the name is
                os.close(fd)                 # free again (O_EXCL: nobody else's), try again
                continue
            os.fchmod(fd, 0o600)  # umask could only have narrowed it; make it exact
            _reserve(fd, chosen, size)
            return chosen, fd, mmap.mmap(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            _unlink(chosen)
            raise
    if taken:
        raise FileExistsError(errno.EEXIST, f"could not create a shared-memory segment: {len(taken)} of the "
                              f"{_CREATE_ATTEMPTS} random names tried were taken in {SHM_DIR} (e.g. {taken[0]}); "
                              "someone is planting files named like distill's segments there: see who owns "
                              f"them with `ls -l {SHM_DIR}/{SHM_PREFIX}*`")
    raise OSError(f"could not create a shared-memory segment in {_CREATE_ATTEMPTS} attempts "
                  "(another process keeps sweeping /dev/shm)")


def _swept_in_time(name: str, attempt: int) -> bool:
    """After our own attempt at ``name`` was caught by a sweep: whether the sweep has removed
    it by now (waited for briefly); a name some other owner holds stays, and is refused."""
    if attempt == 0:
        return False  # the first attempt's EEXIST is another owner's segment
    deadline = time.monotonic() + 0.05
    while os.path.exists(os.path.join(SHM_DIR, name)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


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


@dataclass
class AttachedSegment:
    """A segment of ours, mapped for writing, with the geometry its owner wrote.

    Its owner can still shrink the file (``ftruncate``) while it is mapped here, and a
    write through the mapping past the file's new end kills the writing process with
    SIGBUS. :meth:`intact` asks the kernel (``fstat``) whether every mapped byte is still
    in the file; a worker asks before each step that touches the mapping
    (``worker/segments.py``) and refuses a shrunk segment instead.
    """

    name: str
    mapping: mmap.mmap
    fd: int
    """Kept open: it names the very file that was mapped (see :meth:`current`)."""
    header: SegmentHeader
    size: int
    """Bytes mapped: the file's size when it was attached."""

    @property
    def identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the mapped file."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def current(self) -> bool:
        """Whether the name still refers to the mapped file (False once the owner unlinked
        it: writing the mapping would then reach no student)."""
        try:
            return os.fstat(self.fd).st_nlink > 0
        except OSError:
            return False

    def file_size(self) -> int:
        """The file's size now (-1 once closed)."""
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return -1

    def intact(self) -> bool:
        """Whether the file still holds every mapped byte (False once its owner shrank it:
        touching the mapping past the new end would raise SIGBUS here)."""
        return self.file_size() >= self.size

    def restore_size(self) -> None:
        """Grow a shrunk file back to the mapped size (best effort), so that a write already
        under way through the mapping lands in the file instead of faulting."""
        with contextlib.suppress(OSError):
            if 0 <= self.file_size() < self.size:
                os.ftruncate(self.fd, self.size)
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(self.fd, 0, self.size)

    def close(self) -> None:
        """Unmap (once no view of it is left) and close the file (idempotent)."""
        with contextlib.suppress(BufferError):  # a view is still alive: it keeps the map
            self.mapping.close()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1  # the number may name another file from now on: never close it again


def attach_segment(name: str) -> AttachedSegment:
    """Map an existing segment of ours for writing, after checking it is safe to: our
    name, a regular file of this user, private, and a segment header that describes it."""
    if not is_our_name(name):
        raise PermissionError(f"refusing to attach {name!r}: not a distill segment name")
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, mode=0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"refusing to attach {name!r}: not a private file of this user")
        if st.st_size < SEGMENT_HEADER_BYTES:
            raise ValueError(f"segment {name!r} has {st.st_size} bytes: no segment header")
        mapping = mmap.mmap(fd, st.st_size)
        header, problem = _read_header(mapping, fd)
        if header is None:
            mapping.close()
            raise ValueError(f"segment {name!r}: {problem}")
    except BaseException:
        os.close(fd)
        raise
    return AttachedSegment(name, mapping, fd, header, st.st_size)


def _read_header(mapping: mmap.mmap, fd: int) -> tuple[SegmentHeader | None, str]:
    """The segment header at the end of ``mapping``, or None and why not. No view of the
    mapping outlives this call (a traceback kept alive would keep one, and the mapping
    could then not be closed)."""
    if os.fstat(fd).st_size < len(mapping):  # shrunk under us: its header may be past the end
        return None, "it shrank while it was being mapped"
    try:
        return read_segment_header(memoryview(mapping)), ""
    except ValueError as exc:
        return None, str(exc)


def _release(mapping: mmap.mmap, fd: int, name: str, creator_pid: int | None) -> None:
    """Unmap; the creating process (and no process forked from it) unlinks and unlocks."""
    try:
        mapping.close()
    except BufferError:
        log.debug("shared memory %s still has exported views; it stays mapped until they go", name)
    if creator_pid is not None and os.getpid() == creator_pid:
        _unlink(name)
    with contextlib.suppress(OSError):
        os.close(fd)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def list_segments() -> list[str]:
    """Names of this project's form in /dev/shm (whatever the files are: see ``owner_state``)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if is_our_name(n))
    except FileNotFoundError:
        return []


def owner_state(name: str, min_age_s: float = 0.0) -> str:
    """What the entry ``name`` in /dev/shm is, without ever blocking on it:
    ``"foreign"`` (not a regular file of this user: not ours to judge), ``"gone"``,
    ``"young"`` (younger than ``min_age_s``), ``"live"`` (its owner holds the lock) or
    ``"orphan"`` (nobody holds it)."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, _OPEN_SAFELY)
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "foreign"  # a symlink (ELOOP), a file we may not read, ...
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return "foreign"
        if time.time() - st.st_ctime < min_age_s:
            return "young"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return "live"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "orphan"
    finally:
        os.close(fd)


def sweep_orphans(min_age_s: float = 2.0, inbox_dir: str | os.PathLike | None = None) -> list[str]:
    """Unlink our segments whose owner is gone (nobody holds their lock), and the notice
    inboxes (``notices.py``, in ``inbox_dir`` or the default socket directory) of
    segments that are gone. Entries that are not regular files of this user are left
    alone (module docstring). Returns the segments."""
    swept = []
    for name in list_segments():
        if sweep_segment(name, min_age_s):
            swept.append(name)
    sweep_inboxes(lambda segment: os.path.exists(os.path.join(SHM_DIR, segment)), inbox_dir,
                  min_age_s=min_age_s)
    if swept:
        log.info("swept %d orphaned shared-memory segment(s): %s", len(swept), ", ".join(swept))
    return swept


def sweep_segment(name: str, min_age_s: float = 2.0) -> bool:
    """Unlink the segment ``name`` if it is an orphan of ours (a regular file of this
    user that nobody holds locked, older than ``min_age_s``); True when it was."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, _OPEN_SAFELY)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        if time.time() - st.st_ctime < min_age_s:
            return False  # its creator may not have taken the lock yet
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live owner holds it
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # the name is another file by now (a new owner's)
        try:
            _posixshmem.shm_unlink("/" + name)
        except OSError as exc:
            log.debug("could not sweep %s: %s", name, exc)
            return False
        return True
    finally:
        os.close(fd)
