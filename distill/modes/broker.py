"""mode=broker: the router every worker and student connects to; it runs until killed."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from distill.config import typed_config
from distill.modes.process import configure_logging, exit_on_sigterm
from distill.modes.stats import stats_command
from distill.pipeline import Broker
from distill.pipeline.mediums.shm import sweep_orphans
from distill.transport import broker_kwargs

log = logging.getLogger(__name__)


def run_broker(cfg: DictConfig) -> None:
    """Serve until killed (Ctrl-C or SIGTERM); sweep shared memory crashed owners left behind."""
    configure_logging(cfg)
    exit_on_sigterm()
    sweep_orphans()
    broker = Broker(**broker_kwargs(typed_config(cfg)))
    log.info("this broker's counters: %s", stats_command(cfg))
    try:
        broker.run()
    except KeyboardInterrupt:
        log.info("broker interrupted")
