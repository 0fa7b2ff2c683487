"""The leader secret on disk: made once per run, private, read back whole by every start."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest

from distill.pipeline.leadership import SECRET_BYTES, run_secret, secret_file_name


def _secret_into(directory: str, run_id: str, out: mp.Queue) -> None:
    out.put(run_secret(Path(directory), run_id))


def test_the_first_start_makes_a_private_secret_and_later_starts_read_it(tmp_path: Path) -> None:
    directory = tmp_path / "sockets"
    first = run_secret(directory, "run-a")
    assert len(first) == 2 * SECRET_BYTES
    assert run_secret(directory, "run-a") == first  # a restarted job leads its run again
    assert run_secret(directory, "run-b") != first  # another run, another secret
    path = directory / secret_file_name("run-a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert [p.name for p in directory.iterdir() if ".secret." in p.name] == []  # no temporary left


def test_ranks_starting_together_agree_on_one_secret(tmp_path: Path) -> None:
    out: mp.Queue = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_secret_into, args=(str(tmp_path / "s"), "r", out))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    secrets = {out.get(timeout=60) for _ in procs}
    for proc in procs:
        proc.join(timeout=30)
    assert len(secrets) == 1


def test_a_secret_file_others_can_read_or_a_link_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "sockets"
    run_secret(directory, "r")
    path = directory / secret_file_name("r")
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="not a private file"):
        run_secret(directory, "r")
    path.unlink()
    (tmp_path / "elsewhere").write_text("x" * 32)
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        run_secret(directory, "r")


def test_a_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "open"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        run_secret(directory, "r")
