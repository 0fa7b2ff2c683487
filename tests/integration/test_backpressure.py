"""Back-pressure: a flood of requests or peers, or a student that stops consuming,
cannot grow the broker's memory without bound. Queues and peer tables are capped,
the excess is refused with an ERROR naming the limit, and well-behaved peers on the
same broker keep being served."""

from __future__ import annotations

import re
import time

import pytest
import torch
import zmq

from distill.modes.stats import fetch_stats
from distill.pipeline import StudentClient, protocol
from distill.pipeline.mediums.shm import SharedMemoryManager
from distill.pipeline.protocol import Command, ProtocolError
from distill.pipeline.slot import slot_stride
from tests import peers
from tests.procfs import rss_bytes

LIMITS = {"max_queued_per_student": 256, "max_students": 64, "max_workers": 16, "max_runs": 16,
          "max_queued": 4096}
MAX_GROWTH_BYTES = 6 * 2**20
"""RSS the broker may gain between the end of the first and of the second flood."""
LIMIT_RE = re.compile(r"over the broker's (\w+); raise it with pipeline\.\1=N")


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # a flooder that never waits (0 = no limit)
    sock.connect(endpoint)
    return sock


def _limits_named(sock: zmq.Socket, quiet_ms: int = 300) -> dict[str, int]:
    """Read every reply until ``quiet_ms`` of silence; count the limits the ERRORs name."""
    named: dict[str, int] = {}
    while sock.poll(quiet_ms):
        try:
            msg = protocol.recv(sock)
        except ProtocolError:
            continue
        if msg.command is Command.ERROR and (match := LIMIT_RE.search(msg.body["reason"])):
            named[match.group(1)] = named.get(match.group(1), 0) + 1
    return named


def _flood(endpoints: dict[str, str], round_idx: int) -> dict[str, int]:
    """200,000 slot requests, 5,000 student HELLOs, 1,000 worker READYs and 1,000 new
    runs, without waiting for answers. Returns the limits named in the refusals."""
    frontend, backend, control = (_dealer(endpoints[n]) for n in ("frontend", "backend", "control"))
    try:
        for i in range(2000):  # fresh request ids each time (repeats of queued ones are dropped)
            frontend.send_multipart(protocol.encode(Command.REQUEST, {
                "run_id": "default", "peer_id": "flooder", "generation": 0, "medium": "dst_flood_1_1",
                "stride": 4160, "slots": [[j, i * 100 + j] for j in range(100)]}))
            if i < 1000:
                protocol.send(control, Command.SET_MODEL, {"run_id": f"run-{round_idx}-{i}", "model_id": "m",
                                                           "leader_epoch": 1, "peer_id": "flooder",
                                                           "leader_secret": "flooder-leader-secret"})
                protocol.send(backend, Command.READY, {"peer_id": f"w-{round_idx}-{i}", "credit": 0,
                                                       "max_batch": 1})
        for i in range(5000):
            protocol.send(frontend, Command.HELLO, {"run_id": "default", "peer_id": f"s-{round_idx}-{i}"})
        named: dict[str, int] = {}
        for sock in (frontend, backend, control):
            for name, count in _limits_named(sock).items():
                named[name] = named.get(name, 0) + count
        return named
    finally:
        for sock in (frontend, backend, control):
            sock.close(0)


def _start_broker(procs, endpoints: dict[str, str], limits: dict[str, int]):
    """A broker process with ``limits``, once it answers (spawning it takes seconds on a loaded machine)."""
    broker = procs.start(peers.run_limited_broker, endpoints, limits, name="broker")
    deadline = time.monotonic() + 60
    while fetch_stats(endpoints["frontend"], timeout_ms=1000) is None:
        assert broker.is_alive() and time.monotonic() < deadline, "the broker did not start"
    return broker


def _consume(client: StudentClient, generation: int, count: int) -> None:
    for _ in range(count):
        ref = client.request_sample(timeout_ms=30_000)
        assert ref is not None, "the well-behaved student was not served"
        assert torch.equal(ref.tensors["x"], peers.expected_x(ref.request_id, generation))
        client.release_slot(ref.slot_id)


@pytest.mark.timeout(180)
def test_a_flood_is_refused_memory_stays_bounded_and_a_good_student_is_served(procs, endpoints) -> None:
    broker = _start_broker(procs, endpoints, LIMITS)
    procs.start(peers.run_worker, endpoints, name="worker")
    with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("m")
        _consume(client, generation, 20)
        rss = []
        for round_idx in range(2):
            named = _flood(endpoints, round_idx)
            stats = fetch_stats(endpoints["frontend"])
            assert stats is not None and broker.is_alive()
            assert {"max_queued_per_student", "max_students", "max_workers"} <= set(named), named
            assert stats["queued"] <= LIMITS["max_queued_per_student"] + 8, stats
            assert stats["students"] <= LIMITS["max_students"] and stats["workers"] <= LIMITS["max_workers"]
            assert stats["runs"] <= LIMITS["max_runs"] and stats["refused"] > 0
            # The new runs (SET_MODELs alone, no live peer) took each other's places, not the
            # good student's run (issue 37: they used to fill the table for the broker's life).
            assert stats["per_run"]["default"]["generation"] == generation, stats["per_run"].get("default")
            _consume(client, generation, 20)  # served during the aftermath of the flood
            rss.append(rss_bytes(broker.pid))
        assert rss[1] - rss[0] < MAX_GROWTH_BYTES, f"broker grew {rss}"


@pytest.mark.timeout(120)
def test_a_student_that_stops_consuming_cannot_grow_the_broker(procs, endpoints) -> None:
    limits = {"max_queued_per_student": 16}
    broker = _start_broker(procs, endpoints, limits)
    workers = [procs.start(peers.run_worker, endpoints, name=f"worker{i}") for i in range(2)]
    stride = slot_stride(peers.batch_config().nbytes())
    with StudentClient(0, 16, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client, \
            SharedMemoryManager(slot_count=16, slot_stride=stride) as shm:
        client.hello()
        generation = client.set_model("m")
        assert client.request_sample(timeout_ms=30_000) is not None  # asked for all 16 slots; stops here
        # Never reads, and asks for its 16 slots again and again, each time under new request
        # ids (a repeat of the same ids would be dropped as a duplicate, not refused).
        stuck = _dealer(endpoints["frontend"])
        try:
            samples, rss = [], []
            for i in range(3000):
                stuck.send_multipart(protocol.encode(Command.REQUEST, {
                    "run_id": "default", "peer_id": "stuck", "generation": generation, "medium": shm.buf_name,
                    "stride": stride, "slots": [[slot, 16 * i + slot] for slot in range(16)]}))
                if i % 300 == 299:
                    time.sleep(0.05)
                    stats = fetch_stats(endpoints["frontend"])
                    assert stats is not None
                    samples.append((stats["queued"], stats["in_flight"]))
                    rss.append(rss_bytes(broker.pid))
            assert max(q for q, _ in samples) <= 16 + 16, samples  # the stuck student's cap + the client's
            stats = fetch_stats(endpoints["frontend"])
            assert stats["refused"] > 0
            assert all(w.is_alive() for w in workers) and broker.is_alive()
            assert rss[-1] - rss[1] < MAX_GROWTH_BYTES, f"broker grew {rss}"
        finally:
            stuck.close(0)


@pytest.mark.timeout(120)
def test_a_student_refused_at_a_limit_backs_off_and_gets_every_sample(procs, endpoints, broker_kwargs) -> None:
    """A legitimate student over the broker's queue limit is told which requests were
    refused; it pauses and asks again, and nothing it asked for is lost."""
    from distill.pipeline import Broker

    broker = Broker(**broker_kwargs, max_queued=3).start()
    procs.start(peers.run_worker, endpoints, name="worker", max_batch=2)
    with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        client.hello()
        generation = client.set_model("m")
        peers.consume_verified(client, generation, 40, what="refused requests were never asked for again")
        assert client._pool.counts["refused"] > 0
    assert broker.stats.refused > 0
    broker.stop()
