"""Fixtures shared by every test: private endpoints, bounded processes, shm hygiene."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from distill.pipeline.mediums.shm import list_segments, owner_state

MP = mp.get_context("forkserver")
"""Test processes fork from a server that has imported torch and the pipeline once
(``tests.peers``), instead of each spawning a fresh interpreter that imports them again
(about 2 s of CPU per process, a third of the suite's time on 2 cores). A fork server's
children inherit its environment and working directory, not the test's: ``Procs.start``
hands them the test's (``_in_callers_env``)."""
MP.set_forkserver_preload(["tests.peers"])

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A suite started in the background by a script (``pytest &``) inherits SIGINT ignored,
    # and every process the tests start would too: the Ctrl-C tests could not interrupt
    # them. A terminal's Ctrl-C reaches a user's run with the default action: so here.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def shared_tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every pytest-xdist worker of this session shares (each worker has a
    base temp directory of its own under it); the base temp directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class Turn:
    """The lock every test holds under pytest-xdist: shared, or exclusive for an ``alone``
    test. Whoever wants it exclusive waits at a gate it holds meanwhile, so the other
    worker cannot keep taking shared locks between its tests and starve it."""

    def __init__(self, root: Path) -> None:
        self._gate = open(root / "turn.gate", "a")  # noqa: SIM115 (held across the test)
        self._lock = open(root / "turn.lock", "a")  # noqa: SIM115

    def take(self, exclusive: bool) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def alone_from_now(self) -> None:
        """Wait until the test beside this one (on the other worker) has ended, then hold
        the lock exclusively: what is in /dev/shm from then on is this test's doing."""
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self.take(exclusive=True)

    def close(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._gate.close()
        self._lock.close()


@pytest.fixture(autouse=True)
def xdist_turn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Turn | None]:
    """Under pytest-xdist, a test marked ``alone`` runs with no other test beside it (it
    measures rates or shares against the clock). Without xdist there is nobody beside
    any test: no lock, None."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield None
        return
    turn = Turn(shared_tmp_root(tmp_path_factory))
    turn.take(exclusive=request.node.get_closest_marker("alone") is not None)
    try:
        yield turn
    finally:
        turn.close()


@pytest.fixture(autouse=True)
def no_leaked_shared_memory(xdist_turn: Turn | None) -> Iterator[None]:
    """Fail any test that leaves one of our segments in /dev/shm.

    A leak is a segment that appeared during the test and is either ownerless (its
    owner's lock is free: the owner died without unlinking) or still owned by this
    process. Live segments of unrelated processes (another test run, a benchmark)
    are neither counted nor touched, nor is anything that is not a regular file of
    this user (looked at without blocking: ``owner_state``).

    Under pytest-xdist an ownerless segment may be the test beside this one's (a rank it
    killed, whose segments its own restart sweeps): a test that sees one waits until the
    other test has ended (``Turn.alone_from_now``), by when that test has either swept
    its segments or been failed for them by its own check, and judges what is left.
    """
    before = set(list_segments())
    yield
    leaked = _settled_leaks(before)
    if leaked and xdist_turn is not None:
        xdist_turn.alone_from_now()
        leaked = _settled_leaks(before)
    if leaked:
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        pytest.fail(f"test leaked shared memory segments: {sorted(leaked)}")


def _settled_leaks(before: set[str], wait_s: float = 5.0) -> set[str]:
    """The leaks once this test's children have had ``wait_s`` to finish exiting."""
    deadline = time.monotonic() + wait_s
    while (leaked := _leaked(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return leaked


def _leaked(before: set[str]) -> set[str]:
    mine = f"_{os.getpid()}_"
    return {name for name in set(list_segments()) - before
            if (state := owner_state(name)) in ("orphan", "live", "young") and (mine in name or state == "orphan")}


@pytest.fixture
def endpoints(tmp_path: Path) -> dict[str, str]:
    """Fresh ipc endpoints in a private temp directory (never fixed ports)."""
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o700)
    return {name: f"ipc://{sock_dir}/{name}.sock"
            for name in ("frontend", "backend", "control", "control_pub")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tcp_endpoints() -> dict[str, str]:
    """Loopback endpoints on ports the OS just handed out (keys need tcp: ipc has no handshake)."""
    return {name: f"tcp://127.0.0.1:{_free_port()}" for name in ("frontend", "backend", "control", "control_pub")}


@pytest.fixture
def broker_kwargs(endpoints: dict[str, str]) -> dict[str, str]:
    return {f"{name}_endpoint": ep for name, ep in endpoints.items()}


def _in_callers_env(env: dict[str, str], cwd: str, target: Callable, args: tuple, kwargs: dict) -> object:
    """Run ``target`` with the environment and working directory the test had when it
    started the process (what a spawned process would have had)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    return target(*args, **kwargs)


class Procs:
    """Starts processes with a time bound; kills leftovers; checks exit codes."""

    def __init__(self) -> None:
        self.procs: list[mp.Process] = []

    def start(self, target: Callable, *args: object, name: str | None = None,
              **kwargs: object) -> mp.Process:
        proc = MP.Process(target=_in_callers_env, args=(dict(os.environ), os.getcwd(), target, args, kwargs),
                          name=name)
        proc.start()
        self.procs.append(proc)
        return proc

    def join(self, proc: mp.Process, timeout_s: float, expect_code: int | None = 0) -> None:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
            pytest.fail(f"process {proc.name} did not finish in {timeout_s}s")
        if expect_code is not None:
            assert proc.exitcode == expect_code, f"{proc.name} exited with {proc.exitcode}"

    def collect(self, queue: mp.Queue, count: int, watched: list[mp.Process], timeout_s: float) -> list:
        """``count`` results from ``queue``; fails fast when a watched process dies badly."""
        import queue as queue_mod

        results, deadline = [], time.monotonic() + timeout_s
        while len(results) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"got {len(results)}/{count} results in {timeout_s}s")
            try:
                results.append(queue.get(timeout=0.5))
            except queue_mod.Empty:
                dead = [p for p in watched if p.exitcode not in (None, 0)]
                if dead:
                    pytest.fail(f"{dead[0].name} died with exit code {dead[0].exitcode}")
        return results

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture
def procs() -> Iterator[Procs]:
    helper = Procs()
    yield helper
    helper.kill_all()
