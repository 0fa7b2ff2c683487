"""A worker on "another machine": its own network namespace, reached over a veth pair,
and its own /dev/shm (a private tmpfs), so it can neither map the student's slots nor
reach the broker on loopback. It joins the broker over TCP and delivers every sample
through the student's data socket (the network medium), byte for byte.

Needs root and ``ip netns`` (iproute2) and ``unshare``; skipped where they are not
permitted (most CI containers)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distill.pipeline import Broker, StudentClient
from tests import peers

REPO = Path(__file__).resolve().parents[2]
SUBNET = f"10.231.{os.getpid() % 250}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"
NAMESPACE = f"dstfan{os.getpid()}"
VETH_HOST, VETH_NS = f"dfv{os.getpid() % 100000}h", f"dfv{os.getpid() % 100000}n"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace joined to this one by a veth pair (HOST_IP here, NS_IP there)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs root, iproute2 and unshare")
    try:
        _ip("netns", "add", NAMESPACE)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"network namespaces not permitted here: {getattr(exc, 'stderr', exc)!r}")
    try:
        _ip("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        _ip("link", "set", VETH_NS, "netns", NAMESPACE)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", VETH_HOST)
        _ip("link", "set", VETH_HOST, "up")
        for args in (("addr", "add", f"{NS_IP}/30", "dev", VETH_NS), ("link", "set", VETH_NS, "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", NAMESPACE, "ip", *args)
        yield NAMESPACE
    finally:
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True, timeout=10)  # takes the veth pair


def _free_ports(host: str, count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _start_isolated_worker(namespace: str, endpoints: dict[str, str]) -> subprocess.Popen:
    """``peers.run_worker`` in ``namespace``, with a private tmpfs on /dev/shm."""
    code = f"import json; from tests import peers; peers.run_worker(json.loads({json.dumps(json.dumps(endpoints))}))"
    script = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -c '{code}'"
    return subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--mount", "--propagation", "private",
                             "sh", "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.timeout(120)
def test_worker_in_another_namespace_fills_slots_over_the_network(namespace: str) -> None:
    ports = _free_ports(HOST_IP, 4)
    endpoints = {name: f"tcp://{HOST_IP}:{port}"
                 for name, port in zip(("frontend", "backend", "control", "control_pub"), ports, strict=True)}
    broker = Broker(**{f"{k}_endpoint": v for k, v in endpoints.items()}, heartbeat_interval_s=0.2).start()
    worker = _start_isolated_worker(namespace, endpoints)
    try:
        with StudentClient(0, 32, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2, medium="tcp",
                           tcp_host=HOST_IP) as client:
            client.hello()
            generation = client.set_model("m")
            peers.consume_verified(client, generation, 200, timeout_ms=60_000,
                                   what="no sample from the isolated worker")
            assert client._pool.medium.counts["received"] >= 200  # all through the data socket
        assert worker.poll() is None, f"the isolated worker exited with {worker.returncode}"
    finally:
        worker.terminate()
        worker.wait(10)
        broker.stop()
