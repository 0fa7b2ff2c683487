"""Child processes of the benchmarks: started with spawn, each reporting when it is
ready, dying with the parent, and stopped (SIGTERM, then SIGKILL) however the run ends."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

import torch
import torch.multiprocessing

from distill.pipeline import Broker, setup_logging
from distill.pipeline.auth import CurveConfig

SPAWN = torch.multiprocessing.get_context("spawn")
PR_SET_PDEATHSIG = 1


def child_init(parent_pid: int) -> None:
    """Every child: die with the parent, leave Ctrl-C to it, exit at once on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
    torch.set_num_threads(1)
    setup_logging("WARNING")


def run_broker(parent_pid: int, ready, endpoints: dict[str, str], curve: CurveConfig | None = None) -> None:
    child_init(parent_pid)
    broker = Broker(**{f"{name}_endpoint": ep for name, ep in endpoints.items()}, curve=curve)
    ready.set()
    broker.run()


class Children:
    """Spawned children, each started once ready, stopped (SIGTERM, then SIGKILL) on exit."""

    pids: set[int] = set()
    """Every child pid of this run, for the shared-memory sweep at the end."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, target: Callable, *args: object) -> int:
        """Start ``target(parent_pid, ready, *args)``; returns its pid once it is ready."""
        ready = SPAWN.Event()
        proc = SPAWN.Process(target=target, args=(os.getpid(), ready, *args), daemon=True)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C is ours alone
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        self.procs.append(proc)
        Children.pids.add(proc.pid)
        while not ready.wait(0.1):
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} exited with code {proc.exitcode}")
        return proc.pid

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(3)
