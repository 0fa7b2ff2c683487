"""Experiment tracking: the figures of metrics.jsonl, also in TensorBoard, W&B or MLflow.

One writer per run, fed from the same events as metrics.jsonl: ``StudentContext.log_metrics``
appends a record to the file and hands it to the run's tracker. Only the leader (rank 0) opens
one; the other ranks hold a ``NoTracker``. A record's numbers become scalars tagged
``stage_<i>/<event>/<key>``, nested keys joined with ``/`` (``stage_0/val/layer_losses/1``), at
the record's ``step`` (a ``stage_end``: its ``steps``); a record of no stage (the final ``eval``)
is tagged ``<event>/<key>``. Strings, booleans and lists stay in metrics.jsonl alone. The
composed config is logged once, as hyperparameters.

The libraries are optional extras, imported when their tracker opens (TensorBoard's writer
through torch). ``check_tracking`` refuses a missing one, or an MLflow store the installed
MLflow cannot open, before any process starts. A tracker that fails in the middle of a run
is switched off with a warning: the run goes on, and metrics.jsonl keeps every record.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from distill.config import Config, TrackingBackend, plain
from distill.errors import ConfigError

log = logging.getLogger(__name__)

PLACE_KEYS = frozenset({"event", "stage", "step"})
"""A record's keys that place its figures (tag and step) rather than being figures."""
DEFAULT_PROJECT = "distill"
PROJECT_ENV = {TrackingBackend.wandb: "WANDB_PROJECT", TrackingBackend.mlflow: "MLFLOW_EXPERIMENT_NAME"}
"""The library's own variable naming the project, honoured when ``tracking.project`` is null."""
TENSORBOARD_SUBDIR = "tensorboard"
TENSORBOARD_FLUSH_S = 10
"""Seconds between two writes of TensorBoard's event file: a live dashboard lags by this much."""


@dataclass(frozen=True)
class Package:
    """What a backend imports and how a user installs it."""

    module: str
    pip: str

    @property
    def extra(self) -> str:
        """Its extra in pyproject.toml, named as the module: ``pip install 'distill[wandb]'``."""
        return self.module


PACKAGES = {
    TrackingBackend.tensorboard: Package("tensorboard", "tensorboard"),
    TrackingBackend.wandb: Package("wandb", "wandb"),
    TrackingBackend.mlflow: Package("mlflow", "mlflow-skinny"),
}
"""backend -> the package it needs."""


@dataclass(frozen=True)
class Scalars:
    """The numbers of one metrics.jsonl record, as a tracker logs them."""

    stage: int | None
    """The stage the record belongs to; None for a figure of the whole run (``eval``)."""
    step: int
    values: dict[str, float]
    """tag -> value."""


def scalars(record: dict[str, Any]) -> Scalars:
    """The scalars of one metrics.jsonl record (see the module's docstring for the tags)."""
    stage = record.get("stage")
    event = str(record.get("event", "metrics"))
    prefix = f"{stage_section(int(stage))}/{event}" if stage is not None else event
    step = record.get("step", record.get("steps", 0))
    figures = {key: value for key, value in record.items() if key not in PLACE_KEYS}
    return Scalars(None if stage is None else int(stage), int(step),
                   {f"{prefix}/{key}": value for key, value in _numbers(figures)})


def stage_section(stage: int) -> str:
    """The tag prefix of a stage's figures, which wandb also steps on its own (``<section>/step``)."""
    return f"stage_{stage}"


def _numbers(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(key path, value) of every number in ``tree``, nested dicts flattened with ``/``."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value)


def hyperparameters(cfg: Config) -> dict[str, Any]:
    """The composed config flat, ``student.lr`` -> 0.003: numbers, strings and booleans as they
    are, anything else (null, lists) as its JSON text, which every library's table accepts."""
    tree = plain(cfg, enums_as_str=True)
    return dict(_flat(tree))


def _flat(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        elif isinstance(value, bool | int | float | str):
            yield f"{prefix}{key}", value
        else:
            yield f"{prefix}{key}", json.dumps(value)


class Tracker(Protocol):
    """Where a run's records go besides metrics.jsonl."""

    def log(self, record: dict[str, Any]) -> None:
        """Log one metrics.jsonl record."""

    def close(self, failed: bool = False) -> None:
        """End the run in the tracker (``failed``: it ended on an error)."""


class NoTracker:
    """``tracking=none``, and every rank but the leader."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


class TensorBoardTracker:
    """Event files read by ``tensorboard --logdir``: scalars, the config as text and as hparams."""

    def __init__(self, log_dir: Path, cfg: Config) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard extra
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=TENSORBOARD_FLUSH_S)
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(plain(cfg, enums_as_str=True), sort_keys=False) + "```")
        for summary in hparams(hyperparameters(cfg), {}):  # into this run's file, not a subdirectory
            self.writer.file_writer.add_summary(summary)

    def log(self, record: dict[str, Any]) -> None:
        figures = scalars(record)
        for tag, value in figures.values.items():
            self.writer.add_scalar(tag, value, figures.step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run; each stage's figures are plotted against that stage's own step
    (``stage_<i>/step``, as wandb wants one increasing step per chart)."""

    def __init__(self, directory: Path, project: str, name: str, cfg: Config) -> None:
        import wandb  # the wandb extra

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(directory),
                              config=plain(cfg, enums_as_str=True))
        self.stages: set[int] = set()

    def log(self, record: dict[str, Any]) -> None:
        figures = scalars(record)
        values: dict[str, float] = dict(figures.values)
        if figures.stage is not None:
            section = stage_section(figures.stage)
            if figures.stage not in self.stages:
                self.run.define_metric(f"{section}/step")
                self.run.define_metric(f"{section}/*", step_metric=f"{section}/step")
                self.stages.add(figures.stage)
            values[f"{section}/step"] = figures.step
        if values:
            self.run.log(values)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run in experiment ``project``: metrics, and the config as parameters."""

    def __init__(self, uri: str | None, project: str, name: str, cfg: Config) -> None:
        from mlflow import MlflowClient  # the mlflow extra
        from mlflow.entities import Metric, Param

        self.metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = _mlflow_experiment(self.client, project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(key, str(value))
                                                   for key, value in hyperparameters(cfg).items()])

    def log(self, record: dict[str, Any]) -> None:
        figures = scalars(record)
        now_ms = int(time.time() * 1000)
        metrics = [self.metric(tag, value, now_ms, figures.step) for tag, value in figures.values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _mlflow_experiment(client: Any, name: str) -> str:
    """The id of experiment ``name``, created if new (a sweep's jobs may race to create it)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        return client.get_experiment_by_name(name).experiment_id


class Failsafe:
    """A tracker whose failure in the middle of a run costs the tracking, not the run."""

    def __init__(self, tracker: Tracker, backend: str) -> None:
        self.tracker: Tracker | None = tracker
        self.backend = backend

    def log(self, record: dict[str, Any]) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log(record)
        except Exception as exc:  # the library's own errors: network, store, disk
            log.warning("tracking=%s failed (%s: %s): not tracking the rest of this run; metrics.jsonl "
                        "has every record", self.backend, type(exc).__name__, exc)
            self.tracker = None

    def close(self, failed: bool = False) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.close(failed)
        except Exception as exc:
            log.warning("tracking=%s failed to close (%s: %s)", self.backend, type(exc).__name__, exc)
        self.tracker = None


def open_tracker(cfg: Config, out_dir: Path) -> Tracker:
    """The run's tracker (the leader calls this once; ``close`` it at the end of the run)."""
    tcfg = cfg.tracking
    backend = TrackingBackend(tcfg.backend)
    if backend == TrackingBackend.none:
        return NoTracker()
    name = tcfg.run_name or _run_name(out_dir)
    if backend == TrackingBackend.tensorboard:
        log_dir = Path(tcfg.dir) / name if tcfg.dir else out_dir / TENSORBOARD_SUBDIR
        tracker: Tracker = TensorBoardTracker(log_dir, cfg)
        where = f"event files in {log_dir}"
    elif backend == TrackingBackend.wandb:
        tracker = WandbTracker(Path(tcfg.dir or out_dir), _project(tcfg, backend), name, cfg)
        where = f"run {name!r} of project {_project(tcfg, backend)!r}"
    else:
        tracker = MlflowTracker(tcfg.uri, _project(tcfg, backend), name, cfg)
        where = f"run {name!r} of experiment {_project(tcfg, backend)!r} at {tracker.client.tracking_uri}"
    log.info("tracking=%s: %s", backend, where)
    return Failsafe(tracker, backend)


def _project(tcfg: Config, backend: TrackingBackend) -> str:
    return tcfg.project or os.environ.get(PROJECT_ENV[backend]) or DEFAULT_PROJECT


def _run_name(out_dir: Path) -> str:
    """The run directory, relative to the working directory when it is below it."""
    relative = os.path.relpath(out_dir)
    return str(out_dir) if relative.startswith("..") else relative


def check_tracking(cfg: Config) -> None:
    """Before any process starts: the chosen library is installed, and (MLflow) can open its store."""
    backend = TrackingBackend(cfg.tracking.backend)
    if backend == TrackingBackend.none:
        return
    package = PACKAGES[backend]
    if importlib.util.find_spec(package.module) is None:
        raise ConfigError(f"tracking={backend} needs {package.pip}: pip install 'distill[{package.extra}]' "
                          f"(or pip install {package.pip}), or tracking=none")
    if backend == TrackingBackend.mlflow:
        _check_mlflow_store(cfg.tracking.uri)


def _check_mlflow_store(uri: str | None) -> None:
    """MLflow opens its store when a client is made (no network call for a server): a store the
    installed MLflow refuses (its default sqlite file under mlflow-skinny, a file store MLflow 3
    keeps in maintenance) fails here, in one line, instead of after the broker and workers start."""
    from mlflow import MlflowClient

    try:
        MlflowClient(tracking_uri=uri)
    except Exception as exc:  # MLflow's own: MlflowException and its kin
        reason = " ".join(str(exc).split())
        reason = reason.split(". ", 1)[0][:200]
        shown = uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default store"
        raise ConfigError(f"tracking=mlflow cannot open {shown} ({type(exc).__name__}: {reason}): set "
                          "tracking.uri to a tracking server (http://host:5000), or to a file store "
                          "(file:./mlruns) with MLFLOW_ALLOW_FILE_STORE=true") from exc
