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
from distill.pipeline.endpoints import BrokerRunningError
from tests import peers
from tests.hostile import fetch_stats

pytestmark = pytest.mark.timeout(60)


def _wait_for_stats(endpoint: str, proc, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while fetch_stats(endpoint, timeout_s=0.5) is None:
        assert proc.is_alive() and time.monotonic() < deadline, "the first broker did not start"


def test_a_second_broker_on_the_same_socket_directory_is_refused_with_the_first_s_pid(
        procs, endpoints, broker_kwargs) -> None:
    first = procs.start(peers.run_broker, endpoints, name="broker")
    _wait_for_stats(endpoints["frontend"], first)
    uptime = fetch_stats(endpoints["frontend"])["uptime_s"]
    with pytest.raises(BrokerRunningError, match=rf"another broker \(pid {first.pid}\) is serving the sockets in"):
        Broker(**broker_kwargs).start()
    stats = fetch_stats(endpoints["frontend"])
    assert stats is not None and stats["uptime_s"] > uptime, "the first broker no longer serves its sockets"
    os.kill(first.pid, signal.SIGKILL)  # a broker that died leaves no lock behind
    first.join(10)
    second = Broker(**broker_kwargs).start()
    try:
        assert fetch_stats(endpoints["frontend"]) is not None
    finally:
        second.stop()
