"""CurveZMQ over TCP loopback with real processes: allowed peers run normally; a peer
without an allowed key gets no service, no work, and cannot switch the model."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from distill.pipeline import Broker, StudentClient, Worker, protocol
from distill.pipeline.auth import CurveConfig, create_keys, secure_client
from distill.pipeline.protocol import Command
from tests import peers
from tests.conftest import MP

ROOT = Path(__file__).parents[2]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """Keys of the broker and of two allowed clients, 'worker' and 'student'."""
    create_keys(tmp_path / "keys", ["worker", "student"])
    return tmp_path / "keys"


@pytest.fixture
def rogue(tmp_path: Path, keys: Path) -> CurveConfig:
    """A client that knows the broker's public key but whose own key is not allowed."""
    create_keys(tmp_path / "rogue", ["student"])
    shutil.copy(keys / "server.key", tmp_path / "rogue" / "server.key")
    return CurveConfig.from_keys_dir(tmp_path / "rogue", "student")


def _broker(endpoints: dict[str, str], keys: Path) -> Broker:
    return Broker(**{f"{k}_endpoint": v for k, v in endpoints.items()}, heartbeat_interval_s=0.2,
                  curve=CurveConfig.from_keys_dir(keys)).start()


@pytest.mark.timeout(120)
def test_allowed_worker_and_student_complete_a_run(procs, tcp_endpoints, keys) -> None:
    broker = _broker(tcp_endpoints, keys)
    worker = procs.start(peers.run_worker, tcp_endpoints, name="worker",
                         curve=CurveConfig.from_keys_dir(keys, "worker"))
    results = MP.Queue()
    student = procs.start(peers.run_student, tcp_endpoints, 0, 200, results, leader=True, batch_size=8,
                          name="student", curve=CurveConfig.from_keys_dir(keys, "student"))
    (result,) = procs.collect(results, 1, [worker, student], timeout_s=90)
    procs.join(student, 30)
    assert result["samples"] >= 200
    assert (result["corrupt"], result["duplicates"]) == (0, 0)
    assert result["sources"] == 2  # both DataLoader workers authenticated and were served
    # Fills served by DIRECT reach the broker's count with the worker's next heartbeats
    # (every 0.2 s), not with the samples: wait a few of them.
    deadline = time.monotonic() + 5
    while broker.stats.completed < 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert broker.stats.completed >= 200 and broker.stats.bad_messages == 0
    broker.stop()


@pytest.mark.timeout(90)
def test_student_without_allowed_key_gets_no_service_and_cannot_switch_model(
        tcp_endpoints, keys, rogue) -> None:
    broker = _broker(tcp_endpoints, keys)
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=tcp_endpoints["backend"], control_pub_endpoint=tcp_endpoints["control_pub"],
                    heartbeat_interval_s=0.2, curve=CurveConfig.from_keys_dir(keys, "worker")).start()
    eps = [tcp_endpoints[name] for name in ("frontend", "control", "control_pub")]
    with StudentClient(0, 4, peers.batch_config(), *eps,
                       heartbeat_interval_s=0.2, curve=CurveConfig.from_keys_dir(keys, "student")) as leader:
        leader.hello()
        generation = leader.set_model("m", {"layers": [0]})
        with StudentClient(0, 4, peers.batch_config(), *eps, heartbeat_interval_s=0.2,
                           curve=rogue) as intruder:  # rank 0: it would be allowed to lead, but for its key
            with pytest.raises(PermissionError, match="refused this peer's key"):
                intruder.hello()
            with pytest.raises(PermissionError, match="refused this peer's key"):
                intruder.set_model("evil")
            with pytest.raises(PermissionError, match="refused this peer's key"):
                intruder.request_sample(timeout_ms=5000)
            # Once ZeroMQ has given up on the refused connection the pool has no route to the
            # broker at all: a send then waits for one, and must still end with the reason.
            with StudentClient(0, 4, peers.batch_config(), *eps, heartbeat_interval_s=0.2,
                               curve=rogue) as late:
                time.sleep(3)
                for attempt in (late.hello, lambda: late.request_sample(timeout_ms=5000)):
                    with pytest.raises(PermissionError, match="refused this peer's key"):
                        attempt()
        # A raw CURVE socket with the rogue key, sending SET_MODEL and STOP itself: no answer.
        ctx = zmq.Context.instance()
        sock = secure_client(protocol.configure(ctx.socket(zmq.DEALER)), rogue.client_keys())
        sock.connect(tcp_endpoints["control"])
        _send_if_taken(sock, Command.SET_MODEL, {"run_id": "default", "model_id": "evil", "model_cfg": None,
                                                 "leader_epoch": 2**62, "peer_id": "evil",
                                                 "leader_secret": "evil-leader-secret"})
        _send_if_taken(sock, Command.STOP, {})
        assert not sock.poll(1500)
        sock.close(linger=0)
        # A client without any key cannot even complete the handshake.
        plain = protocol.configure(ctx.socket(zmq.DEALER))
        plain.connect(tcp_endpoints["control"])
        _send_if_taken(plain, Command.SET_MODEL, {"run_id": "default", "model_id": "evil", "model_cfg": None,
                                                  "leader_epoch": 2**62, "peer_id": "evil",
                                                  "leader_secret": "evil-leader-secret"})
        assert not plain.poll(1000)
        plain.close(linger=0)
        run = broker.stats.per_run["default"]
        assert (run["generation"], run["model_id"]) == (generation, "m")
        assert broker.stats.students == 1 and broker.stats.bad_messages == 0
        ref = leader.request_sample(timeout_ms=20_000)  # the allowed student is still served
        assert ref is not None and ref.generation == generation
        leader.release_slot(ref.slot_id)
    assert worker.model_id == "m"  # the worker never heard of "evil", nor of a STOP
    worker.stop()
    broker.stop()


@pytest.mark.timeout(90)
def test_worker_without_allowed_key_gets_no_work(tcp_endpoints, keys, rogue) -> None:
    broker = _broker(tcp_endpoints, keys)
    eps = [tcp_endpoints[name] for name in ("frontend", "control", "control_pub")]
    with StudentClient(0, 4, peers.batch_config(), *eps,
                       heartbeat_interval_s=0.2, curve=CurveConfig.from_keys_dir(keys, "student")) as client:
        client.hello()
        generation = client.set_model("m")
        intruder = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                          backend_endpoint=tcp_endpoints["backend"],
                          control_pub_endpoint=tcp_endpoints["control_pub"], heartbeat_interval_s=0.2,
                          curve=rogue)
        started = time.monotonic()
        with pytest.raises(PermissionError, match="refused this peer's key"):
            intruder.run()  # stops with the reason instead of waiting for work forever
        assert time.monotonic() - started < 30
        assert client.request_sample(timeout_ms=1000) is None
        assert intruder.samples_written == 0
        assert (broker.stats.workers, broker.stats.dispatched) == (0, 0)
        allowed = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                         backend_endpoint=tcp_endpoints["backend"],
                         control_pub_endpoint=tcp_endpoints["control_pub"], heartbeat_interval_s=0.2,
                         curve=CurveConfig.from_keys_dir(keys, "worker")).start()
        ref = client.request_sample(timeout_ms=20_000)
        assert ref is not None and ref.generation == generation
        client.release_slot(ref.slot_id)
    allowed.stop()
    broker.stop()


@pytest.mark.timeout(120)
def test_mode_keys_writes_private_secrets(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    cmd = [sys.executable, "-m", "distill", "mode=keys", f"keys_dir={keys_dir}", "keys_clients=[w0,s1]",
           f"hydra.run.dir={tmp_path / 'run'}", "hydra.output_subdir=null"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pipeline.auth_client=w0" in out.stdout and "server.key_secret" in out.stdout
    modes = {str(p.relative_to(keys_dir)): stat.S_IMODE(p.stat().st_mode) for p in keys_dir.rglob("*")}
    assert modes == {"server.key": 0o644, "server.key_secret": 0o600, "clients": 0o700,
                     "clients/w0.key": 0o644, "clients/w0.key_secret": 0o600,
                     "clients/s1.key": 0o644, "clients/s1.key_secret": 0o600}
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700  # (refusing to overwrite: unit tests)


def _send_if_taken(sock: zmq.Socket, command: Command, body: dict) -> None:
    """Send, unless ZeroMQ will not take the message: between a refused handshake and the
    next try a DEALER has no connection to queue on, and a send would wait for one for good
    (it did, once, on a loaded machine). Not taken is as refused as taken and dropped."""
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    with contextlib.suppress(zmq.Again):
        protocol.send(sock, command, body)
