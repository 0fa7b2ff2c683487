"""distill.pipeline: the data-agnostic streaming transport (broker/, worker/, student/).

The public API of the seed README: change ``from softs import ...`` to
``from distill.pipeline import ...`` and its examples run. This package imports
nothing from the rest of distill.
"""

import logging

from distill.pipeline.batch import DTYPES, BatchConfig, TensorSpec
from distill.pipeline.broker import Broker, BrokerConfig
from distill.pipeline.endpoints import default_endpoint
from distill.pipeline.liveness import BrokerRefusal
from distill.pipeline.mediums import Medium, MediumBase, SharedMemoryManager, ShmSpaceError
from distill.pipeline.protocol import PROTOCOL_VERSION, Command, ProtocolError
from distill.pipeline.stats import BrokerStats
from distill.pipeline.student import (
    DatasetConfig,
    DistillIterableDataset,
    PoolConfig,
    SampleRef,
    SlotPool,
    StudentClient,
    StudentClientConfig,
)
from distill.pipeline.worker import SlotTarget, Worker, WorkerConfig

__all__ = [
    "DTYPES", "PROTOCOL_VERSION", "BatchConfig", "Broker", "BrokerConfig", "BrokerRefusal", "BrokerStats", "Command",
    "DatasetConfig",
    "DistillIterableDataset", "Medium", "MediumBase", "PoolConfig", "ProtocolError", "SampleRef",
    "SharedMemoryManager", "ShmSpaceError", "SlotPool", "SlotTarget", "StudentClient", "StudentClientConfig",
    "TensorSpec", "Worker", "WorkerConfig", "default_endpoint", "setup_logging",
]


def setup_logging(level: int | str = "INFO") -> None:
    """Configure logging for distill's modules (applications call this; the library never does)."""
    logging.basicConfig(
        level=level if isinstance(level, int) else level.upper(),
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
    )
    logging.getLogger("distill").setLevel(level if isinstance(level, int) else level.upper())
