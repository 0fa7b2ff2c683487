"""BrokerPatience: what tells a student that its broker runs (its process, when known), and
the settings that bound a call's wait; the waits themselves run against real brokers in
tests/integration/test_slow_broker.py."""

from __future__ import annotations

import logging
import re
import subprocess

import pytest

from distill.pipeline import PoolConfig, StudentClient, liveness
from distill.pipeline.liveness import BrokerPatience
from tests import peers


def test_the_broker_s_process_is_named_when_the_patience_is_made() -> None:
    assert BrokerPatience.of(None).broker_runs() is None  # not known: the broker's answers tell
    broker = subprocess.Popen(["sleep", "30"])
    patience = BrokerPatience.of(broker.pid)
    assert patience.broker_runs() is True
    broker.kill()
    broker.wait()
    assert patience.broker_runs() is False
    assert BrokerPatience.of(broker.pid).broker_runs() is False  # gone before the student started


@pytest.mark.parametrize(("setting", "message"), [
    ({"broker_wait_s": 0}, r"broker_wait_s=0: must be > 0 seconds \(pipeline\.broker_wait_s\)"),
    ({"broker_wait_s": float("nan")}, "broker_wait_s=nan"),
    ({"broker_silence_s": -1.0}, "broker_silence_s=-1.0"),
    ({"broker_pid": 0}, "broker_pid=0: a process id"),
])
def test_bad_wait_settings_are_refused_naming_them(setting: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PoolConfig(**setting)


def test_a_call_waiting_for_the_broker_says_for_what_where_and_how_long(
        endpoints, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A student whose broker's process runs but does not serve yet (a broker starting on a
    loaded machine) says now and then what it waits for, instead of nothing for minutes."""
    monkeypatch.setattr(liveness, "WAIT_LOG_EVERY_S", 0.2)
    broker = subprocess.Popen(["sleep", "30"])  # runs, and never answers
    try:
        with StudentClient(0, 1, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], broker_pid=broker.pid, broker_wait_s=1.0) as client, \
                caplog.at_level(logging.INFO, logger="distill.pipeline.liveness"), \
                pytest.raises(TimeoutError, match="no answer to HELLO"):
            client.hello()
    finally:
        broker.kill()
        broker.wait()
    said = [r.getMessage() for r in caplog.records if "waiting for the broker" in r.getMessage()]
    assert len(said) >= 2, caplog.text
    assert re.fullmatch(rf"student-\w+: waiting for the broker at {re.escape(endpoints['frontend'])} to answer "
                        rf"HELLO: \d+s so far \(its process, pid {broker.pid}, runs; giving up after 1s\)", said[0])
