"""BrokerPatience: what tells a student that its broker runs (its process, when known), and
the settings that bound a call's wait; the waits themselves run against real brokers in
tests/integration/test_slow_broker.py."""

from __future__ import annotations

import subprocess

import pytest

from distill.pipeline import PoolConfig
from distill.pipeline.liveness import BrokerPatience


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
