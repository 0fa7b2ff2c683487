"""``cfg.pipeline`` -> pipeline objects: the one place that maps the config to the transport.

The broker, the teacher workers and the student ranks each build their part of the
pipeline from the same ``pipeline`` group; if each mode read the keys itself, a new
setting would have to be threaded through three places and could be forgotten in one.
Here each key is read once: the endpoints (TCP at ``pipeline.broker_host``, else ipc in
``pipeline.socket_dir``), the run id, the CurveZMQ keys, and the keyword arguments of
:class:`~distill.pipeline.Broker`, :class:`~distill.pipeline.Worker`,
:class:`~distill.pipeline.StudentClient` and :class:`~distill.pipeline.DistillIterableDataset`.

It imports neither transformers nor the models, so the broker's start stays fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from distill.config import Config
from distill.pipeline import BatchConfig, DistillIterableDataset, StudentClient
from distill.pipeline.auth import CurveConfig
from distill.pipeline.endpoints import SOCKET_NAMES, default_endpoint, runtime_dir
from distill.pipeline.leadership import run_secret
from distill.pipeline.protocol import DEFAULT_RUN

log = logging.getLogger(__name__)


ADD_WORKER_SCRIPT = "add_worker.sh"
"""In a mode=local job's run directory while it runs: the command that adds one more teacher
worker to it (written by distill.modes.local, named by the student's teacher-bound advice)."""

BROKER_LIMITS = ("max_queued", "max_queued_per_student", "max_students", "max_workers", "max_runs")
"""The broker's back-pressure limits, ``pipeline.<name>``, passed under the same names."""


def endpoints(cfg: Config) -> dict[str, str]:
    """The four broker endpoints: TCP at ``pipeline.broker_host`` (several machines), or
    ipc in ``pipeline.socket_dir`` (one machine)."""
    host = cfg.pipeline.broker_host
    if host:
        port = cfg.pipeline.broker_port
        return {name: f"tcp://{host}:{port + i}" for i, name in enumerate(SOCKET_NAMES)}
    directory = cfg.pipeline.socket_dir or runtime_dir()
    return {name: default_endpoint(name, directory) for name in SOCKET_NAMES}


def curve_config(cfg: Config) -> CurveConfig | None:
    """The CurveZMQ keys of ``pipeline.auth_keys_dir`` (None: authentication off)."""
    if not cfg.pipeline.auth_keys_dir:
        return None
    return CurveConfig.from_keys_dir(cfg.pipeline.auth_keys_dir, cfg.pipeline.auth_client)


def run_id(cfg: Config) -> str:
    """``run_id``, or else one per sweep job (so the jobs of a multirun sharing a broker
    never share a run), or else ``default``."""
    return cfg.run_id or sweep_job_run_id() or DEFAULT_RUN


def leader_secret(cfg: Config) -> str:
    """The run's leader secret (``distill.pipeline.leadership``), kept in
    ``pipeline.socket_dir`` (else the user's runtime directory): a restarted job leads its
    run again, and mode=local's supervisor can stop the run's workers."""
    return run_secret(Path(cfg.pipeline.socket_dir or runtime_dir()), run_id(cfg))


def sweep_job_run_id() -> str | None:
    """``<sweep dir name>j<job number>`` in a Hydra multirun job, None elsewhere."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep = "".join(c for c in Path(hydra_cfg.sweep.dir).name if c.isalnum())[-8:]
    return f"{sweep}j{hydra_cfg.job.num}"


def _heartbeats(cfg: Config) -> dict[str, Any]:
    return {"heartbeat_interval_s": cfg.pipeline.heartbeat_interval_s,
            "heartbeat_liveness": cfg.pipeline.heartbeat_liveness}


def broker_kwargs(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of the run's :class:`~distill.pipeline.Broker`."""
    eps = {f"{name}_endpoint": ep for name, ep in endpoints(cfg).items()}
    limits = {name: getattr(cfg.pipeline, name) for name in BROKER_LIMITS}
    return {**eps, **_heartbeats(cfg), "curve": curve_config(cfg), **limits}


def worker_kwargs(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of a teacher :class:`~distill.pipeline.Worker` (besides its batch
    function and sample layout)."""
    eps = endpoints(cfg)
    return {"backend_endpoint": eps["backend"], "control_pub_endpoint": eps["control_pub"],
            "max_batch": cfg.pipeline.worker_max_batch, **_heartbeats(cfg),
            "local_shm": cfg.pipeline.local_shm, "curve": curve_config(cfg),
            "notices": cfg.pipeline.notices, "socket_dir": cfg.pipeline.socket_dir,
            "direct_requests": cfg.pipeline.direct_requests}


def control_client(cfg: Config, rank: int, batch_config: BatchConfig) -> StudentClient:
    """A rank's control connection (stage switches, the leader's generation), patient with a
    broker that is alive but slow (``pipeline.broker_wait_s``, ``pipeline.broker_pid``). Its
    one slot (a client needs a medium; one sample of shared memory, counted by
    ``distill.train.sizing.shm_bytes``) is never asked for: each stage's samples come through
    :func:`stage_dataset`."""
    eps = endpoints(cfg)
    return StudentClient(rank, 1, batch_config, eps["frontend"], eps["control"], eps["control_pub"],
                         run_id=run_id(cfg), **_heartbeats(cfg), curve=curve_config(cfg),
                         fan_out=cfg.pipeline.fan_out, notices=False, leader_secret=leader_secret(cfg),
                         broker_wait_s=cfg.pipeline.broker_wait_s, broker_pid=cfg.pipeline.broker_pid)


def stage_dataset(cfg: Config, rank: int, generation_value: Any, batch_config: BatchConfig,
                  batch_size: int, pin_memory: bool) -> DistillIterableDataset:
    """The dataset a rank reads one stage's batches from (its own slots)."""
    return DistillIterableDataset(
        rank, generation_value, cfg.pipeline.slot_count, batch_config, endpoints(cfg)["frontend"],
        run_id=run_id(cfg), batch_size=batch_size, **_heartbeats(cfg), medium=cfg.pipeline.medium,
        tcp_host=cfg.pipeline.tcp_host, curve=curve_config(cfg), pin_memory=pin_memory,
        notices=cfg.pipeline.notices, socket_dir=cfg.pipeline.socket_dir,
        direct_requests=cfg.pipeline.direct_requests)
