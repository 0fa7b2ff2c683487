"""A broker's backend the test drives by hand: real ROUTER and PUB sockets that real
workers connect to, so a test can hand them WORK no real broker would send."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from distill.pipeline import protocol
from distill.pipeline.protocol import Command, ProtocolError


class FakeBroker:
    """The backend ROUTER and PUB of ``endpoints``; ``record(work_id)`` says which DONEs to keep."""

    def __init__(self, endpoints: dict[str, str], record: Callable[[int], bool] = lambda _work_id: True) -> None:
        ctx = zmq.Context.instance()
        self.router = protocol.configure(ctx.socket(zmq.ROUTER))
        self.router.bind(endpoints["backend"])
        self.pub = protocol.configure(ctx.socket(zmq.PUB))
        self.pub.bind(endpoints["control_pub"])
        self.workers: list[bytes] = []
        """Routing identities of the workers that said READY, in that order."""
        self.dones: dict[int, list] = {}
        self._record = record

    @property
    def identity(self) -> bytes:
        """The first worker's identity (b"" before any READY)."""
        return self.workers[0] if self.workers else b""

    def wait_ready(self, count: int = 1, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.workers) < count:
            assert self.router.poll(max(0.0, deadline - time.monotonic()) * 1000), "worker never said READY"
            self._receive_one()

    def drain(self) -> None:
        while protocol.readable(self.router):
            self._receive_one()

    def work(self, work_id: int, items: list[list], *, generation: int = 1, run_id: str = "fake",
             model_id: str = "m", worker: int = 0) -> None:
        """Send one WORK of ``items`` ([medium, slot, stride, request id], ...) to a worker."""
        protocol.send(self.router, Command.WORK, {"work_id": work_id, "run_id": run_id, "generation": generation,
                                                  "model_id": model_id, "items": items},
                      identity=self.workers[worker])

    def wait_done(self, work_id: int, timeout_s: float = 60) -> list:
        """The ``failed`` list of the DONE of ``work_id``."""
        deadline = time.monotonic() + timeout_s
        while work_id not in self.dones:
            assert self.router.poll(max(0.0, deadline - time.monotonic()) * 1000), f"no DONE for {work_id}"
            self._receive_one()
        return self.dones.pop(work_id)

    def _receive_one(self) -> None:
        identity, msg = protocol.recv_routed(self.router)
        assert not isinstance(msg, ProtocolError), f"worker sent garbage: {msg}"
        if msg.command is Command.HEARTBEAT:
            protocol.send(self.router, Command.HEARTBEAT, {"peer_id": "fake", "role": "broker"},
                          identity=identity)
        elif msg.command is Command.READY and identity not in self.workers:
            self.workers.append(identity)
        elif msg.command is Command.DONE and self._record(msg.body["work_id"]):
            self.dones[msg.body["work_id"]] = msg.body["failed"]

    def close(self) -> None:
        self.router.close(0)
        self.pub.close(0)
