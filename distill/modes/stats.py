"""mode=stats: the broker's counters, printed live (one STATS round trip per interval).

A broker's sockets are where its settings put them (``pipeline.socket_dir``, or
``pipeline.broker_host``/``broker_port``); a ``mode=local`` run's are in a private directory
named at random. So every broker's log prints :func:`stats_command`, the one command that reaches
it, and this mode says which endpoint it asks and gives up, in one line and a nonzero exit
(``BrokerNotFound``), when nothing answers there for ``stats_wait_s``: a wrong directory must not
look like an idle broker.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time

from omegaconf import DictConfig

from distill.config import typed_config
from distill.errors import BrokerNotFound
from distill.modes.process import configure_logging
from distill.pipeline.endpoints import runtime_dir
from distill.pipeline.observe import STATS_TIMEOUT_MS, fetch_stats
from distill.train.progress import duration
from distill.transport import curve_config, endpoints

log = logging.getLogger(__name__)

STATS_COLUMNS = ("workers", "students", "queued", "in_flight", "completed", "discarded", "requeued",
                 "quarantined", "failed", "completed_per_s")
def format_stats(stats: dict) -> str:
    return "  ".join(f"{key}={stats[key]:.1f}" if isinstance(stats[key], float) else f"{key}={stats[key]}"
                     for key in STATS_COLUMNS)


def stats_command(cfg: DictConfig, socket_dir: str | None = None) -> str:
    """The ``mode=stats`` command that reaches the broker of ``cfg`` (its sockets in
    ``socket_dir`` when given: mode=local's private directory), to paste as it is."""
    pipeline = cfg.pipeline
    if pipeline.broker_host:
        where = [f"pipeline.broker_host={pipeline.broker_host}", f"pipeline.broker_port={pipeline.broker_port}"]
    else:
        where = [f"pipeline.socket_dir={socket_dir or pipeline.socket_dir or runtime_dir()}"]
    if pipeline.auth_keys_dir:
        where += [f"pipeline.auth_keys_dir={pipeline.auth_keys_dir}", f"pipeline.auth_client={pipeline.auth_client}"]
    return shlex.join([sys.executable, "-m", "distill", "mode=stats", *where])


def run_stats(cfg: DictConfig) -> None:
    """Print the broker's counters every ``stats_interval_s`` until Ctrl-C; raise
    :class:`BrokerNotFound` once nothing has answered for ``stats_wait_s``."""
    configure_logging(cfg)
    config = typed_config(cfg)
    frontend = endpoints(config)["frontend"]
    curve = curve_config(config)
    keys = curve.client_keys() if curve is not None else None
    log.info("asking the broker at %s for its counters every %gs (giving up after %gs without an answer)",
             frontend, cfg.stats_interval_s, cfg.stats_wait_s)
    last_answer = started = time.monotonic()
    answered = False
    try:
        while True:
            stats = fetch_stats(frontend, timeout_ms=_fetch_timeout_ms(cfg), keys=keys)
            now = time.monotonic()
            if stats:
                answered, last_answer = True, now
                print(format_stats(stats), flush=True)
            else:
                silent_s = now - last_answer
                if silent_s >= cfg.stats_wait_s:
                    raise BrokerNotFound(_no_broker(frontend, silent_s, answered, now - started))
                print(f"waiting for the broker at {frontend}: no answer for {duration(silent_s)}", flush=True)
            time.sleep(cfg.stats_interval_s)
    except KeyboardInterrupt:
        pass


def _fetch_timeout_ms(cfg: DictConfig) -> int:
    """One round trip's wait: never past ``stats_wait_s`` (a short wait is a short wait)."""
    return max(1, int(min(STATS_TIMEOUT_MS, 1000 * cfg.stats_wait_s)))


def _no_broker(frontend: str, silent_s: float, answered: bool, elapsed_s: float) -> str:
    """The one line that ends mode=stats when no broker answers."""
    if answered:
        return (f"the broker at {frontend} stopped answering {duration(silent_s)} ago "
                f"(it answered earlier, in {duration(elapsed_s)} of asking); has it exited?")
    return (f"no broker answered at {frontend} in {duration(silent_s)}: is one running there? A broker's log "
            "(mode=broker, mode=local) prints the mode=stats command that reaches it; "
            "stats_wait_s=<seconds> waits longer")
