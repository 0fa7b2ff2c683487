"""A broker that is alive but slow is waited for; one that is gone fails the call fast.

The student's calls that wait for an answer (HELLO, SET_MODEL) wait while the broker shows
signs of life: its process runs (``broker_pid``, what mode=local tells its students), or it
answers heartbeats. A broker whose process has exited fails the call at once, naming the
process; one never heard from fails after ``broker_silence_s``; and no call waits past
``broker_wait_s``. Real broker processes (started late, stopped with SIGSTOP, killed) and
real sockets; the limits are set to a second or two so each test runs in seconds (a
broker on a loaded machine took 2 min 40 s to serve, past the old fixed 10 s), except in
the one test that uses the old API only.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from distill.pipeline import Broker, StudentClient, protocol
from distill.pipeline.protocol import Command
from tests import peers

SILENCE_S = 1.0
"""The tests' broker_silence_s: what the old fixed 10 s stands for, in seconds not tens."""


def _client(endpoints: dict[str, str], **kwargs: object) -> StudentClient:
    options = {"control_endpoint": endpoints["control"], "heartbeat_interval_s": 0.2,
               "broker_silence_s": SILENCE_S, **kwargs}
    return StudentClient(0, 2, peers.batch_config(), endpoints["frontend"],
                         control_pub_endpoint=endpoints["control_pub"], **options)


def test_a_broker_still_starting_is_waited_for(procs, endpoints) -> None:
    """HELLO sent before the broker serves (its process runs, still 'importing') is answered."""
    broker = procs.start(peers.run_late_broker, endpoints, 3 * SILENCE_S, name="late-broker")
    with _client(endpoints, broker_pid=broker.pid) as client:
        started = time.monotonic()
        client.hello()
        assert time.monotonic() - started > 2 * SILENCE_S  # it waited past the silence limit
        assert client.set_model("m") == 1


def test_a_stopped_broker_is_waited_for_and_answers_once_resumed(procs, endpoints) -> None:
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    with _client(endpoints, broker_pid=broker.pid) as client:
        client.hello()
        os.kill(broker.pid, signal.SIGSTOP)  # no heartbeat answers, no answers at all
        resume = threading.Timer(3 * SILENCE_S, os.kill, (broker.pid, signal.SIGCONT))
        resume.start()
        try:
            started = time.monotonic()
            assert client.set_model("m") == 1
            assert time.monotonic() - started > 2 * SILENCE_S
        finally:
            resume.cancel()
            os.kill(broker.pid, signal.SIGCONT)


def test_a_killed_broker_fails_the_call_at_once_naming_its_process(procs, endpoints) -> None:
    """Well before the silence limit (left at its default, 10 s): the process says it is gone."""
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    with _client(endpoints, broker_pid=broker.pid, broker_silence_s=None) as client:
        client.hello()
        os.kill(broker.pid, signal.SIGKILL)
        broker.join(10)
        started = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"SET_MODEL .*: the broker's process \(pid {broker.pid}\) "
                                                  "has exited"):
            client.set_model("m")
        assert time.monotonic() - started < 2
    with (_client(endpoints, broker_pid=broker.pid, broker_silence_s=None) as late,  # started after it died
          pytest.raises(ConnectionError, match=rf"HELLO .*\(pid {broker.pid}\) has exited")):
        late.hello()


def test_a_broker_never_heard_from_fails_after_the_silence(endpoints) -> None:
    """No process to ask and no broker: the call gives up after broker_silence_s, as before."""
    with _client(endpoints) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"no answer to HELLO .*nothing heard from the broker for 1s"):
            client.hello()
        assert SILENCE_S <= time.monotonic() - started < SILENCE_S + 2


OLD_LIMIT_S = 10.0
"""The fixed time a call waited for the broker's answer before this test was written."""


def test_heartbeats_keep_a_call_waiting_past_the_old_fixed_limit(endpoints, broker_kwargs, tmp_path: Path) -> None:
    """No process to ask, default settings (the old API only): the broker answers heartbeats
    while its answer to SET_MODEL comes after the old fixed limit (the test holds it on a
    control socket of its own). The call waits for it."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    control = protocol.configure(zmq.Context.instance().socket(zmq.ROUTER))
    control.bind(f"ipc://{tmp_path}/slow-control.sock")

    def answer_late() -> None:
        if control.poll(10_000):
            identity, msg = protocol.recv_routed(control)
            time.sleep(OLD_LIMIT_S + 1)
            protocol.send(control, Command.MODEL_SET, {"run_id": msg.body["run_id"], "generation": 7,
                                                       "model_id": msg.body["model_id"]}, identity=identity)

    slow = threading.Thread(target=answer_late, daemon=True)
    slow.start()
    try:
        with StudentClient(0, 2, peers.batch_config(), endpoints["frontend"], control.last_endpoint.decode(),
                           endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
            client.hello()
            started = time.monotonic()
            assert client.set_model("m") == 7
            assert time.monotonic() - started > OLD_LIMIT_S
    finally:
        slow.join(5)
        control.close(linger=0)
        broker.stop()


def test_a_call_gives_up_once_the_heartbeats_stop(endpoints, broker_kwargs) -> None:
    """No process to ask: a broker heard from until it stopped fails the call after the silence limit."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    try:
        with _client(endpoints) as client:
            client.hello()
            broker.stop()
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer to SET_MODEL .*nothing heard from the broker for 1s"):
                client.set_model("m")
            assert time.monotonic() - started < SILENCE_S + 2
    finally:
        broker.stop()


def test_no_call_waits_past_broker_wait_s(procs, endpoints) -> None:
    """A broker whose process runs but never answers (stopped): the call ends at the ceiling,
    saying the broker runs and which setting to raise."""
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    with StudentClient(1, 2, peers.batch_config(), endpoints["frontend"], broker_pid=broker.pid) as patient:
        patient.hello()  # the broker serves: a loaded machine may take past the 2 s ceiling to start it
    with _client(endpoints, broker_pid=broker.pid, broker_wait_s=2 * SILENCE_S) as client:
        client.hello()
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"no answer to SET_MODEL .* in 2s \(its process, pid "
                                                   rf"{broker.pid}, runs\); raise broker_wait_s"):
                client.set_model("m")
            assert time.monotonic() - started < 2 * SILENCE_S + 2
        finally:
            os.kill(broker.pid, signal.SIGCONT)
