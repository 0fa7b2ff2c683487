"""Group 8 of issue 21: other local users (and unlucky timing) cannot block or break
the shared-memory medium.

- Entries in /dev/shm named like ours that are not regular files of this user (a FIFO,
  a symlink, a directory, another user's file) are left alone by the orphan sweep, which
  neither blocks on them nor fails: a SlotPool starts, in a fresh process, in seconds.
- A sweep that runs while a large segment is being created (its space reserved) never
  removes it: the creator holds the owner lock from the first instant.
- A process forked from an owner that exits normally leaves the owner's segment alone.
- (Issue 37, item 5.) Files planted under the names a student's segment would take
  cannot stop it from starting: its names carry a random part, and a name found taken
  is given up for another (``tests/unit/pipeline/mediums/test_shm.py`` tests that retry).

The planted entries exist only around the sweep that must skip them (other processes
of this user sweep /dev/shm too), and a FIFO's readers are released before it goes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from distill.pipeline import Broker
from distill.pipeline.mediums.shm import SHM_DIR, SharedMemoryManager, list_segments, sweep_segment
from tests import peers

SWEEP_IN_A_NEW_PROCESS = """
import sys, time
from distill.pipeline import SlotPool
started = time.monotonic()
pool = SlotPool("ipc:///nonexistent/frontend.sock", "neighbours", 2, 64, lambda: 0, lambda _: None)
pool.close()
print(f"{time.monotonic() - started:.2f}", flush=True)
"""


@contextlib.contextmanager
def _planted(kinds: list[str]) -> Iterator[list[str]]:
    """Entries named like our segments that are not ours to touch, removed afterwards."""
    tag = os.getpid()
    paths = []
    try:
        for n, kind in enumerate(kinds):
            path = Path(SHM_DIR) / f"dst_neighbour_{tag}_{n}"
            if kind == "fifo":
                os.mkfifo(path, 0o600)
            elif kind == "symlink":
                path.symlink_to("/etc/hostname")
            elif kind == "directory":
                path.mkdir(mode=0o700)
            elif kind == "foreign":  # another user's readable file (root can make one)
                path.write_bytes(bytes(64))
                os.chmod(path, 0o644)
                os.chown(path, 65534, 65534)
            paths.append(path)
            os.utime(path, (time.time() - 3600,) * 2, follow_symlinks=False)  # old enough to sweep
        yield [p.name for p in paths]
    finally:
        for path in paths:
            _remove(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # a reader blocked on the FIFO is let go first
        for _ in range(10):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_the_sweep_skips_what_is_not_ours_and_never_blocks_on_it() -> None:
    kinds = ["fifo", "symlink", "directory"] + (["foreign"] if os.geteuid() == 0 else [])
    with _planted(kinds) as names:
        proc = subprocess.Popen([sys.executable, "-c", SWEEP_IN_A_NEW_PROCESS], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail("SlotPool() blocked on an entry of /dev/shm that is not a segment of ours")
        assert proc.returncode == 0, err[-2000:]
        assert float(out.strip()) < 10
        assert set(names) <= set(list_segments()), "the sweep removed what was not its to remove"


@pytest.mark.timeout(60)
def test_a_segment_being_created_is_never_swept() -> None:
    """A sweep with no age margin, in a loop, while a 256 MiB segment is created and reserves
    its space: the creation succeeds and the segment is the owner's."""
    name = f"dst_creating_{os.getpid()}_0"
    swept, done = [], threading.Event()

    def sweep() -> None:
        while not done.is_set():
            if sweep_segment(name, min_age_s=0):
                swept.append(time.monotonic())

    sweeper = threading.Thread(target=sweep, daemon=True)
    sweeper.start()
    try:
        with SharedMemoryManager(1, 256 << 20, run_id="creating", name=name) as owner:
            done.set()
            sweeper.join(10)
            # With no age margin a sweep can take the new file in the instant before its
            # creator locks it; the creator then creates it again (at most 8 tries). From the
            # lock on, through the 256 MiB reservation, nothing removes it: the name is the
            # owner's file, and a sweep now leaves it.
            assert len(swept) < 8, swept
            assert not sweep_segment(name, min_age_s=0), "a sweep removed a live owner's segment"
            st = os.stat(os.path.join(SHM_DIR, name))
            assert (st.st_dev, st.st_ino) == (os.fstat(owner._fd).st_dev, os.fstat(owner._fd).st_ino)
    finally:
        done.set()
        sweeper.join(10)


FORK_AND_EXIT = """
import os, sys
from distill.pipeline.mediums.shm import SharedMemoryManager, list_segments
owner = SharedMemoryManager(2, 64, run_id="forked")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the interpreter runs its exit handlers in the child
os.waitpid(pid, 0)
print(owner.buf_name in list_segments(), flush=True)
owner.close()
print(owner.buf_name in list_segments(), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_forked_child_that_exits_leaves_its_parents_segment() -> None:
    result = subprocess.run([sys.executable, "-c", FORK_AND_EXIT], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "False"], "the child unlinked its parent's live segment"


def _squat(names: list[str]) -> list[Path]:
    """Plant empty files under ``names``, as another local user would (root makes them
    that user's; otherwise they are ours, and young enough that no sweep takes them)."""
    paths = []
    for name in names:
        path = Path(SHM_DIR) / name
        path.write_bytes(b"")
        paths.append(path)
        with contextlib.suppress(PermissionError):
            os.chown(path, 65534, 65534)
    return paths


@pytest.mark.timeout(120)
def test_files_planted_under_a_students_names_do_not_stop_it(procs, endpoints, broker_kwargs) -> None:
    """The squatter of issue 37 knows the student's pid (here: it waits for it) and plants
    every name of the ``dst_<run>_<pid>_<n>`` form its segment could take; the student,
    started in a fresh process, still starts, and takes verified samples from a worker."""
    spawn = mp.get_context("spawn")
    pids, results, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    planted: list[Path] = []
    try:
        procs.start(peers.run_worker, endpoints, name="worker")
        student = procs.start(peers.run_squatted_student, endpoints, pids, go, results, name="student")
        pid = pids.get(timeout=60)
        planted = _squat([f"dst_default_{pid}_{n}" for n in range(64)])
        go.set()
        (name,) = procs.collect(results, 1, [student], timeout_s=90)
        procs.join(student, 30)
        assert name not in {path.name for path in planted}
        assert all(path.exists() for path in planted), "the squatter's files are not the student's to remove"
    finally:
        go.set()
        for path in planted:
            path.unlink(missing_ok=True)
        broker.stop()
