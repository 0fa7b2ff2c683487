"""mode=stats: the broker's counters, printed live (one STATS round trip per interval)."""

from __future__ import annotations

import logging
import time

import zmq
from omegaconf import DictConfig

from distill.modes.process import configure_logging
from distill.pipeline import protocol
from distill.pipeline.auth import ClientKeys, secure_client
from distill.pipeline.protocol import Command
from distill.train.transport import curve_config, endpoints

log = logging.getLogger(__name__)

STATS_COLUMNS = ("workers", "students", "queued", "in_flight", "completed", "discarded", "requeued",
                 "quarantined", "failed", "completed_per_s")


def fetch_stats(frontend_endpoint: str, timeout_ms: int = 2000, keys: ClientKeys | None = None) -> dict | None:
    """One STATS round trip; None when the broker does not answer."""
    sock = secure_client(protocol.configure(zmq.Context.instance().socket(zmq.DEALER)), keys)
    sock.connect(frontend_endpoint)
    try:
        protocol.send(sock, Command.STATS, {})
        if not sock.poll(timeout_ms):
            return None
        return protocol.recv(sock).body["stats"]
    finally:
        sock.close(linger=0)


def format_stats(stats: dict) -> str:
    return "  ".join(f"{key}={stats[key]:.1f}" if isinstance(stats[key], float) else f"{key}={stats[key]}"
                     for key in STATS_COLUMNS)


def run_stats(cfg: DictConfig) -> None:
    """Print the broker's counters every ``stats_interval_s`` until Ctrl-C."""
    configure_logging(cfg)
    frontend = endpoints(cfg)["frontend"]
    curve = curve_config(cfg)
    keys = curve.client_keys() if curve is not None else None
    try:
        while True:
            stats = fetch_stats(frontend, keys=keys)
            print(format_stats(stats) if stats else f"no answer from {frontend}", flush=True)
            time.sleep(cfg.stats_interval_s)
    except KeyboardInterrupt:
        pass
