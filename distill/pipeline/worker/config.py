"""What a worker is configured with, and what its sample functions receive."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from distill.pipeline.auth import CurveConfig
from distill.pipeline.batch import BatchConfig
from distill.pipeline.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS


@dataclass
class SlotTarget:
    """One slot to fill: writable views into the student's memory (write into them;
    they are reused for the slot's next fill, so never reshape them in place)."""

    request_id: int
    generation: int
    payload: memoryview
    tensors: dict[str, torch.Tensor] | None
    failure: str | None = None
    """Why the worker did not fill it (a ``generator_fn`` sample it refused): the slot fails with it."""


GeneratorFn = Callable[[str, dict | None], "bytes | Mapping[str, torch.Tensor]"]
"""Per sample: the sample's bytes (``BatchConfig.encode``, the seed README's), or its
tensors by name (needs ``batch_config``), copied straight into the slot."""
BatchFn = Callable[[str, dict | None, list[SlotTarget]], Callable[[], None] | None]
Deferred = Callable[[], None]
"""Completes a filled group whose payload copies are in flight: finish them, commit the headers."""


@dataclass(frozen=True)
class WorkerConfig:
    """Every setting of a :class:`~distill.pipeline.worker.Worker` (the sample function aside).

    ``Worker(config=WorkerConfig(...))``; the seed README's keywords (``slot_size``,
    ``backend_endpoint``, ...) and the other keyword arguments of ``Worker`` fill the
    same fields.
    """

    slot_size: int | None = None
    """Bytes per sample (default: ``batch_config.nbytes()``)."""
    batch_config: BatchConfig | None = None
    """The sample layout: ``SlotTarget.tensors`` are views of it; needed by a ``generator_fn``
    that returns tensors by name, and by ``batch_fn`` to get ``tensors``."""
    backend_endpoint: str | None = None
    """The broker's backend (default: ``default_endpoint("backend")``)."""
    control_pub_endpoint: str | None = None
    """The broker's broadcasts (default: ``default_endpoint("control_pub")``)."""
    worker_id: int | str | None = None
    """Names the worker in its peer id and logs (default: the process id)."""
    max_batch: int | None = None
    """Slots per call of the sample function (WORKs waiting are batched up to it); None:
    chosen from the sample's bytes (``sizing.worker_batch``: 64 of 4 KiB or 256 KiB, 4 of 4 MiB)."""
    prefetch_batches: int = 2
    """Batches of credit the worker asks for: ``max_batch * prefetch_batches`` slots."""
    checksum: bool = False
    """Write a CRC32 of every payload into its header (students then verify it)."""
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    local_shm: bool = True
    """Write into a network medium's segment directly when it is on this machine."""
    curve: CurveConfig | None = None
    """CurveZMQ keys (None: authentication off)."""
    notices: bool = True
    """Tell students on this machine about filled slots directly (``notices.py``)."""
    socket_dir: str | os.PathLike | None = None
    """Where those students' inboxes are (None: the default socket directory)."""
    direct_requests: bool = True
    """Take DIRECT requests from students we notify, past the broker (``notices.py``)."""

    def __post_init__(self) -> None:
        if self.batch_config is not None and self.slot_size is not None \
                and self.batch_config.nbytes() != self.slot_size:
            raise ValueError(f"slot_size {self.slot_size} != batch_config.nbytes() {self.batch_config.nbytes()}")
        if self.slot_size is not None and self.slot_size < 0:
            raise ValueError(f"slot_size={self.slot_size}: must be >= 0")
        for name in ("max_batch", "prefetch_batches", "heartbeat_liveness"):
            value = getattr(self, name)
            if value is None and name == "max_batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Worker {name}={value!r}: must be a positive integer")
        if not self.heartbeat_interval_s > 0:
            raise ValueError(f"Worker heartbeat_interval_s={self.heartbeat_interval_s!r}: must be > 0")

    @property
    def payload_bytes(self) -> int:
        """Bytes per sample, from ``slot_size`` or the batch config."""
        if self.slot_size is not None:
            return self.slot_size
        if self.batch_config is None:
            raise ValueError("Worker needs slot_size= (bytes per sample) or batch_config=")
        return self.batch_config.nbytes()
