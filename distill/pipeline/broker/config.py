"""BrokerConfig: every setting of a broker in one typed, frozen object.

``Broker(config=BrokerConfig(...))`` is the library's way (one object to build, pass
and compare, as torchtitan's components take one ``Config``); the seed README's
keywords (``Broker(frontend_endpoint=..., heartbeat_interval_s=...)``) stay and
override the config's fields. Every bound on what peers can make the broker hold or
do is a field here: the defaults leave room for large jobs and cap the broker's
memory at a few hundred MiB whatever peers send; each refusal names the field to raise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from distill.pipeline import protocol
from distill.pipeline.auth import CurveConfig
from distill.pipeline.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS

MAX_WORK_ITEMS = 4096
"""Slots in one WORK (of all its runs): its DONE, with a 200-character reason for every
slot, still fits in the broker's BROKER_MAX_MESSAGE_BYTES."""
WORK_TIMEOUT_FACTOR = 10.0
"""Derived deadline of a WORK: this many times the slowest recent batch of its model."""
WORK_TIMEOUT_MIN_BEATS = 10
"""... and never less than this many heartbeat intervals (a GC pause is not a hang)."""
RUN_GRACE_BEATS = 10
"""Derived ``run_grace_s``: this many heartbeat intervals (a peer is given up on after
``heartbeat_liveness`` of them; its run is kept a while longer, for it to come back)."""


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """A broker's endpoints, liveness, limits and keys (see the module docstring)."""

    frontend_endpoint: str | None = None
    """Students (ROUTER); None: ``ipc://<socket dir>/frontend.sock`` (``endpoints.py``)."""
    backend_endpoint: str | None = None
    """Workers (ROUTER); None: the default socket directory's ``backend.sock``."""
    control_endpoint: str | None = None
    """Leaders (ROUTER): SET_MODEL, STOP, STATS."""
    control_pub_endpoint: str | None = None
    """Broadcasts (PUB): MODEL, STOP."""
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    """The poll timeout and the pace every peer is asked to beat at."""
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    """Intervals of silence after which a peer is declared gone."""
    max_queued_per_run: int = 1_000_000
    """Slots one run may have queued."""
    max_queued: int = 1_000_000
    """Slots queued over all runs (a queued slot costs about 150 bytes), shared fairly: a
    run may hold this over the number of runs asking, a connection its run's share over
    the run's connections asking (``runs.RunTable.make_room``)."""
    max_queued_per_student: int = 8_192
    """Slots one student connection may have queued. A consumer process never needs more
    than it owns (pipeline.slot_count); keep it below protocol.BROKER_SNDHWM."""
    max_students: int = 16_384
    """Student peers: every rank's client and every DataLoader worker is one."""
    max_workers: int = 4_096
    max_runs: int = 1_024
    """Runs (the jobs of a sweep). A new run takes the place of one that never had a live
    peer, or of one with no model, queue or student; runs in use are kept."""
    run_grace_s: float | None = None
    """How long a run is kept (its model, generation and leader) once it has no live peer:
    no student, no WORK in flight, no heartbeat from its leader. None: RUN_GRACE_BEATS
    heartbeat intervals."""
    max_worker_credit: int = 65_536
    """Slots one worker may hold at once, whatever its READY says."""
    max_stride_bytes: int = 1 << 40
    """Largest slot stride a REQUEST may name."""
    max_slots_per_medium: int = 1 << 20
    """Slot indices a REQUEST may name: 0 .. max_slots_per_medium - 1."""
    max_mediums_per_student: int = 16
    """Mediums (segments) one student connection may own."""
    max_model_cfg_bytes: int = protocol.MAX_CFG_BYTES
    """A run's ``model_cfg``, packed."""
    max_retained_cfg_bytes: int = 64 << 20
    """What the ``model_cfg`` of all runs may weigh together (see ``limits.cfg_cost``)."""
    work_timeout_s: float | None = None
    """How long a worker may take for a WORK, or hold DIRECT work without finishing a
    batch, before it is quarantined like a silent worker (its heartbeat thread may beat
    on while its batch function hangs). None: WORK_TIMEOUT_FACTOR x the slowest recent
    batch of that model, at least WORK_TIMEOUT_MIN_BEATS heartbeats; a worker's first
    batch of a model WORK_TIMEOUT_FACTOR x the slowest first batch measured in its run
    (and no less); ``first_work_timeout_s`` while nothing of either was measured
    (``deadline.py``)."""
    first_work_timeout_s: float = 600.0
    """The deadline of a first batch while no batch of its run or model has been measured
    (a teacher's first batch may compile kernels or load weights)."""
    curve: CurveConfig | None = None
    """CurveZMQ keys: every socket a CURVE server admitting only the allowed clients."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("max_") or field.name == "heartbeat_liveness":
                _check_positive_int(field.name, value)
        for name in ("heartbeat_interval_s", "first_work_timeout_s"):
            _check_positive_seconds(name, getattr(self, name))
        for name in ("work_timeout_s", "run_grace_s"):
            if getattr(self, name) is not None:
                _check_positive_seconds(name, getattr(self, name))
        for name in ("frontend_endpoint", "backend_endpoint", "control_endpoint", "control_pub_endpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"BrokerConfig.{name}={value!r}: must be an endpoint string or None")
        if self.curve is not None and not isinstance(self.curve, CurveConfig):
            raise ValueError(f"BrokerConfig.curve={self.curve!r}: must be a CurveConfig or None")

    @property
    def run_grace(self) -> float:
        """``run_grace_s``, or its derived value (seconds)."""
        return RUN_GRACE_BEATS * self.heartbeat_interval_s if self.run_grace_s is None else self.run_grace_s

    @classmethod
    def build(cls, config: BrokerConfig | None = None, **options: Any) -> BrokerConfig:
        """``config`` (default: all defaults) with ``options`` replacing its fields; an
        option that is not a field is refused by name."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"Broker() got unexpected keyword argument(s) {', '.join(unknown)}; "
                            f"the settings are the fields of BrokerConfig")
        base = config if config is not None else cls()
        if not isinstance(base, BrokerConfig):
            raise TypeError(f"Broker(config=...) takes a BrokerConfig, got {type(base).__name__}")
        return dataclasses.replace(base, **options) if options else base


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Broker({name}={value!r}): must be a positive integer")


def _check_positive_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Broker({name}={value!r}): must be a positive number of seconds")
