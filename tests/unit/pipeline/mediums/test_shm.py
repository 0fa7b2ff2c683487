"""Shared memory: private, owned, unlinked, swept; attachers never unlink or warn."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distill.pipeline.mediums import shm as shm_module
from distill.pipeline.mediums.shm import (
    MAX_NAME_CHARS,
    SHM_DIR,
    SharedMemoryManager,
    ShmSpaceError,
    check_shm_space,
    is_our_name,
    list_segments,
    segment_name,
    sweep_orphans,
)


def test_segment_is_private_and_unlinked_on_close() -> None:
    shm = SharedMemoryManager(slot_count=4, slot_stride=128, run_id="t1")
    path = f"/dev/shm/{shm.buf_name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "t1" in shm.buf_name and is_our_name(shm.buf_name)
    assert shm.nbytes == 512
    shm.close()
    assert not os.path.exists(path)


def test_context_exit_unlinks() -> None:
    with SharedMemoryManager(slot_count=2, slot_stride=64) as shm:
        name = shm.buf_name
        assert name in list_segments()
    assert name not in list_segments()


def test_slot_views_are_bounds_checked() -> None:
    with SharedMemoryManager(slot_count=2, slot_stride=64) as shm:
        assert len(shm.slot_view(1)) == 64
        with pytest.raises(IndexError):
            shm.slot_view(2)


def test_attach_refuses_foreign_names() -> None:
    with pytest.raises(PermissionError, match="not a distill segment"):
        SharedMemoryManager(1, 64, read_only=False, name="psm_foreign")
    with pytest.raises(PermissionError):
        SharedMemoryManager(1, 64, read_only=False, name="../etc/passwd")


def test_attacher_sees_writes_and_cannot_unlink() -> None:
    with SharedMemoryManager(slot_count=2, slot_stride=64) as owner:
        other = SharedMemoryManager(2, 64, read_only=False, name=owner.buf_name)
        other.slot_view(1)[:3] = b"abc"
        assert bytes(owner.slot_view(1)[:3]) == b"abc"
        with pytest.raises(PermissionError):
            other.unlink()
        other.close()
        assert owner.buf_name in list_segments()


def test_no_resource_tracker_warning_or_unlink_from_attaching_process() -> None:
    with SharedMemoryManager(slot_count=2, slot_stride=64) as owner:
        code = ("from distill.pipeline.mediums.shm import SharedMemoryManager as S;"
                f"s = S(2, 64, read_only=False, name={owner.buf_name!r}); s.slot_view(0)[:1] = b'x'; s.close()")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr
        assert owner.buf_name in list_segments()
        assert bytes(owner.slot_view(0)[:1]) == b"x"


def test_orphans_of_killed_owners_are_swept() -> None:
    code = ("import os; from distill.pipeline.mediums.shm import SharedMemoryManager as S;"
            "s = S(2, 64, run_id='orphan'); print(s.buf_name, flush=True); os._exit(0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = result.stdout.strip()
    assert name in list_segments()
    with SharedMemoryManager(slot_count=1, slot_stride=64) as live:
        swept = sweep_orphans(min_age_s=0)
        assert name in swept
        assert live.buf_name not in swept  # its owner (us) holds the lock
        assert live.buf_name in list_segments()
    assert name not in list_segments()


def test_too_large_a_segment_gives_sizing_advice() -> None:
    with pytest.raises(ShmSpaceError, match="slot_count"):
        check_shm_space(2**60)
    with pytest.raises(ShmSpaceError):
        SharedMemoryManager(slot_count=2**20, slot_stride=2**40)


def test_ctrl_c_unlinks_the_owners_segment() -> None:
    code = ("import time; from distill.pipeline.mediums.shm import SharedMemoryManager as S;"
            "s = S(2, 64, run_id='ctrlc'); print(s.buf_name, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    name = proc.stdout.readline().strip()
    assert name in list_segments()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in stderr
    assert name not in list_segments()


def test_segment_names_cannot_be_told_in_advance_and_fit_macos() -> None:
    """Issue 37, item 5: a name carries 40 random bits; with the longest run id and a
    7-digit pid it is still within macOS's 31 characters (leading ``/`` included)."""
    names = {segment_name("r" * 16) for _ in range(100)}
    assert len(names) == 100
    assert all(is_our_name(name) and name.startswith(f"dst_{'r' * 8}_{os.getpid()}_") for name in names)
    longest = max(len(name) - len(str(os.getpid())) + 7 for name in names)
    assert longest <= MAX_NAME_CHARS <= 30
    assert is_our_name("dst_default_1234_0")  # an earlier version's name: still swept, still served


@contextlib.contextmanager
def _planted(name: str) -> Iterator[Path]:
    """An empty file under ``name``, as a squatter plants it (another user's, as root)."""
    path = Path(SHM_DIR) / name
    path.write_bytes(b"")
    with contextlib.suppress(PermissionError):
        os.chown(path, 65534, 65534)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def test_a_generated_name_found_taken_is_given_up_for_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    squatted = segment_name("squat")
    fresh = iter([squatted])
    monkeypatch.setattr(shm_module, "segment_name", lambda run_id: next(fresh, None) or segment_name(run_id))
    with _planted(squatted) as path, SharedMemoryManager(2, 64, run_id="squat") as owner:
        assert owner.buf_name != squatted and is_our_name(owner.buf_name)
        assert path.exists() and path.stat().st_size == 0, "the squatter's file is not ours to touch"
        owner.slot_view(1)[:3] = b"abc"


def test_a_creator_stops_with_a_clear_error_when_every_name_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    squatted = segment_name("squat")
    monkeypatch.setattr(shm_module, "segment_name", lambda run_id: squatted)
    with _planted(squatted), pytest.raises(FileExistsError, match="random names tried were taken"):
        SharedMemoryManager(2, 64, run_id="squat")
