"""Group 9 of the hardening issue (broker side): one broker per socket directory.

Binding an ipc endpoint replaces the socket file already there, so a second broker on
the same directory used to start without a word and take every new peer from the
first. It is now refused, naming the running broker's pid, and the first serves on.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from distill.pipeline import Broker
from distill.pipeline.broker import report
from distill.pipeline.endpoints import BrokerRunningError
from tests import peers
from tests.hostile import fetch_stats

pytestmark = pytest.mark.timeout(60)


def _wait_for_stats(endpoint: str, proc, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while fetch_stats(endpoint, timeout_s=0.5) is None:
        assert proc.is_alive() and time.monotonic() < deadline, "the first broker did not start"


def _serving_since(endpoint: str, uptime_s: float) -> bool:
    """The broker answers with a later uptime than ``uptime_s`` (STATS answers are kept up
    to ``report.MAX_AGE_S``, so a reply right away may repeat the last one)."""
    deadline = time.monotonic() + report.MAX_AGE_S + 5.0
    while time.monotonic() < deadline:
        stats = fetch_stats(endpoint, timeout_s=0.5)
        if stats is not None and stats["uptime_s"] > uptime_s:
            return True
        time.sleep(0.1)
    return False


def test_a_second_broker_on_the_same_socket_directory_is_refused_with_the_first_s_pid(
        procs, endpoints, broker_kwargs) -> None:
    first = procs.start(peers.run_broker, endpoints, name="broker")
    _wait_for_stats(endpoints["frontend"], first)
    uptime = fetch_stats(endpoints["frontend"])["uptime_s"]
    with pytest.raises(BrokerRunningError, match=rf"another broker \(pid {first.pid}\) is serving the sockets in"):
        Broker(**broker_kwargs).start()
    assert _serving_since(endpoints["frontend"], uptime), "the first broker no longer serves its sockets"
    os.kill(first.pid, signal.SIGKILL)  # a broker that died leaves no lock behind
    first.join(10)
    second = Broker(**broker_kwargs).start()
    try:
        assert fetch_stats(endpoints["frontend"]) is not None
    finally:
        second.stop()
