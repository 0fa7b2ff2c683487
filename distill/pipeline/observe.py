"""One-shot calls an operator makes on a broker: its statistics (STATS, on the frontend)
and the end of a run or of every run (STOP, on the control socket).

``mode=stats`` and ``mode=local``'s shutdown make them; a script watching a job can too.
Each call opens its own socket, sends one message and closes it: nothing is kept between
calls, so a broker that restarted in between is simply asked again.
"""

from __future__ import annotations

import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import AuthError, ClientKeys, secure_client
from distill.pipeline.protocol import Command

STATS_TIMEOUT_MS = 2000
"""The longest one STATS round trip waits by default (a live broker answers in milliseconds)."""
STOP_LINGER_MS = 500
"""How long ``send_stop`` gives the message to leave before closing its socket."""


def fetch_stats(frontend_endpoint: str, timeout_ms: int = STATS_TIMEOUT_MS,
                keys: ClientKeys | None = None) -> dict | None:
    """The broker's statistics (``stats.BrokerStats`` as a dict), or None when it does not
    answer within ``timeout_ms``."""
    sock = _socket(frontend_endpoint, keys)
    try:
        protocol.send(sock, Command.STATS, {})
        if not sock.poll(timeout_ms):
            return None
        return protocol.recv(sock).body["stats"]
    finally:
        sock.close(linger=0)


def send_stop(control_endpoint: str, keys: ClientKeys | None = None, leader_secret: str | None = None) -> bool:
    """Ask the broker to tell every worker to stop (STOP, the run's secret when the broker
    wants one). False when it could not be sent (no broker, a refused key): a caller
    shutting a job down goes on to end the processes itself."""
    try:
        sock = _socket(control_endpoint, keys)
    except (zmq.ZMQError, AuthError):
        return False
    try:
        protocol.send(sock, Command.STOP, {} if leader_secret is None else {"leader_secret": leader_secret})
        sock.poll(STOP_LINGER_MS)
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)


def _socket(endpoint: str, keys: ClientKeys | None) -> zmq.Socket:
    sock = secure_client(protocol.configure(zmq.Context.instance().socket(zmq.DEALER)), keys)
    sock.connect(endpoint)
    return sock
