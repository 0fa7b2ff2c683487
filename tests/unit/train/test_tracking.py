"""Experiment tracking: a real stage (a real broker and teacher worker, threads of this
process) trained with tracking=tensorboard|wandb|mlflow, read back with each library's own
reader (TensorBoard's EventAccumulator, ``wandb leet inspect`` on the offline run, an MLflow
file store through ``MlflowClient``), must hold every number metrics.jsonl holds, under its
stage, at its step, and the composed config; a missing library is refused in one line."""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig

from distill.errors import ConfigError
from distill.model.evaluate import EvalResult
from distill.results.finish import eval_record
from distill.train.context import METRICS_FILE, close_context
from distill.train.layer_stage import LayerTask
from distill.train.tracking import check_tracking, open_tracker, scalars
from distill.train.trainer import StageTrainer, train_stage
from tests.tiny_teachers import tiny_llama
from tests.unit.train.test_trainer import _cfg, _context, pipeline_for  # noqa: F401 (fixture)

VOCAB = 96
READ_TIMEOUT_S = 60
Figures = dict[tuple[str, int], float]
"""(tag, step) -> value, as a tracker holds a run's scalars."""


# -- each library's own reader


def tensorboard_figures(log_dir: Path) -> tuple[Figures, dict[str, Any]]:
    """Scalars and hparams of the event files in ``log_dir``, read by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    figures = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    hparams = {key: value.number_value if value.HasField("number_value") else value.string_value
               for key, value in start.hparams.items()}
    (text,) = events.Tensors("config/text_summary")
    hparams["<text>"] = text.tensor_proto.string_val[0].decode()
    return figures, hparams


def wandb_figures(wandb_dir: Path) -> tuple[Figures, dict[str, Any], int]:
    """History, config and exit code of the offline run in ``wandb_dir``, read by ``wandb leet inspect``."""
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=READ_TIMEOUT_S, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    figures: Figures = {}
    for record in records:
        if record["type"] != "history":
            continue
        item = record["history"]["item"]
        sections = {key.split("/")[0] for key in item if key.startswith("stage_")}
        step = int(item[f"{sections.pop()}/step"]) if sections else 0
        figures.update({(key, step): float(value) for key, value in item.items()
                        if not key.startswith("_") and not key.endswith("/step")})
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    (exit_record,) = [r["exit"] for r in records if r["type"] == "exit"]
    return figures, run["config"]["update"], int(exit_record.get("exit_code", 0))


def mlflow_figures(uri: str) -> tuple[Figures, dict[str, str], str]:
    """Metric histories, params and status of the one run in the store at ``uri``, read by MlflowClient."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "distill"]
    (run,) = client.search_runs([experiment.experiment_id])
    figures = {(key, m.step): m.value for key in run.data.metrics
               for m in client.get_metric_history(run.info.run_id, key)}
    return figures, run.data.params, run.info.status


# -- what metrics.jsonl says they must hold, written out per event


def expected_figures(records: list[dict]) -> Figures:
    """The tags a tracker must hold for these records: one line per figure, not the tracker's own code."""
    out: Figures = {}
    for r in records:
        at = f"stage_{r.get('stage')}/{r['event']}"
        if r["event"] == "train":
            for key in ("loss", "lr", "grad_norm", "samples_per_s", "wait_fraction"):
                out[(f"{at}/{key}", r["step"])] = r[key]
            out.update({(f"{at}/layer_losses/{layer}", r["step"]): v for layer, v in r["layer_losses"].items()})
        elif r["event"] == "val":
            out.update({(f"{at}/layer_losses/{layer}", r["step"]): v for layer, v in r["layer_losses"].items()})
            out.update({(f"{at}/student_losses/{layer}", r["step"]): v for layer, v in r["student_losses"].items()})
        elif r["event"] == "stage_end":
            for key in ("steps", "tokens", "wall_s", "best_step", "wait_fraction", "delivered_samples_per_s"):
                out[(f"{at}/{key}", r["steps"])] = r[key]
        elif r["event"] == "eval":
            out[("eval/student", 0)] = r["student"]
            out[("eval/teacher", 0)] = r["teacher"]
            out.update({(f"eval/per_layer/{layer}", 0): v for layer, v in r["per_layer"].items()})
            out.update({(f"eval/timings/{key}", 0): v for key, v in r["timings"].items()})
    return out


def assert_holds(figures: Figures, records: list[dict]) -> None:
    """Every number of metrics.jsonl is in ``figures`` (float32 in TensorBoard), and no text is."""
    expected = expected_figures(records)
    missing = sorted(set(expected) - set(figures))
    assert not missing, f"{len(missing)} figures missing, e.g. {missing[:5]}; tracker has {sorted(figures)[:10]}"
    for key, value in expected.items():
        assert math.isclose(figures[key], value, rel_tol=1e-6, abs_tol=1e-9), (key, figures[key], value)
    assert not [tag for tag, _ in figures if tag.endswith(("/kind", "/stopped", "/layers", "/event"))]


def read_metrics_file(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / METRICS_FILE).read_text().splitlines()]


# -- a trained stage, read back


def _tracked_stage(tmp_path: Path, start_pipeline, *overrides: str) -> tuple[DictConfig, Path, list[dict]]:
    """Train one stage of a tiny teacher with ``overrides``; log an end-of-run evaluation; close."""
    cfg = _cfg(tmp_path, "student.val_every_steps=3", "student.layers=[1]", *overrides)
    teacher = tiny_llama(VOCAB, 2)
    start_pipeline(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    ctx.tracker = open_tracker(cfg, ctx.out_dir)
    try:
        train_stage(StageTrainer(ctx, LayerTask(ctx, ctx.stages[0])))
        result = EvalResult(kind="lm", teacher=29.5, student=31.25, per_layer={1: 30.5}, num_tokens=64)
        ctx.log_metrics(eval_record(result, None, {"export_s": 0.5}))
    finally:
        close_context(ctx)
    records = read_metrics_file(ctx.out_dir)
    assert {r["event"] for r in records} == {"train", "val", "stage_end", "eval"}
    return cfg, ctx.out_dir, records


def test_tensorboard_holds_every_figure_of_metrics_jsonl_and_the_config(
        tmp_path: Path, pipeline_for) -> None:  # noqa: F811
    pytest.importorskip("tensorboard")
    _, out_dir, records = _tracked_stage(tmp_path, pipeline_for, "tracking=tensorboard")
    figures, hparams = tensorboard_figures(out_dir / "tensorboard")
    assert_holds(figures, records)
    assert hparams["student.steps_per_stage"] == 6 and hparams["tracking.backend"] == "tensorboard"
    assert hparams["student.layers"] == "[1]"  # a list, as JSON text
    assert "steps_per_stage: 6" in hparams["<text>"]


def test_wandb_offline_run_holds_every_figure_and_the_config(
        tmp_path: Path, pipeline_for, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    try:
        _, _, records = _tracked_stage(tmp_path, pipeline_for, "tracking=wandb",
                                       f"tracking.dir={tmp_path / 'wb'}", "tracking.run_name=tiny")
    finally:
        wandb.teardown()  # its service process, which a student's exit ends, outlives a finished run here
    figures, config, exit_code = wandb_figures(tmp_path / "wb")
    assert_holds(figures, records)
    assert config["student"]["steps_per_stage"] == 6 and config["tracking"]["run_name"] == "tiny"
    assert exit_code == 0


def test_mlflow_file_store_holds_every_figure_and_the_config(
        tmp_path: Path, pipeline_for, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = f"file:{tmp_path / 'mlruns'}"
    _, _, records = _tracked_stage(tmp_path, pipeline_for, "tracking=mlflow", f"tracking.uri={uri}")
    figures, params, status = mlflow_figures(uri)
    assert_holds(figures, records)
    assert params["student.steps_per_stage"] == "6" and params["tracking.backend"] == "mlflow"
    assert status == "FINISHED"


# -- the tags, a tracker that fails, a library that is missing


def test_a_record_s_numbers_are_tagged_with_its_stage_and_event() -> None:
    record = {"event": "val", "stage": 2, "kind": "layers", "step": 7, "layer_losses": {"3": 0.25},
              "stopped": "steps", "layers": [3], "flag": True}
    figures = scalars(record)
    assert (figures.stage, figures.step, figures.values) == (2, 7, {"stage_2/val/layer_losses/3": 0.25})
    end = scalars({"event": "stage_end", "stage": 0, "steps": 40, "tokens": 1280})
    assert (end.step, end.values) == (40, {"stage_0/stage_end/steps": 40.0, "stage_0/stage_end/tokens": 1280.0})
    run = scalars({"event": "eval", "student": 31.0, "decode": {"speedup": 2.5}})
    assert (run.stage, run.values) == (None, {"eval/student": 31.0, "eval/decode/speedup": 2.5})


def test_a_tracker_failing_mid_run_is_switched_off_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    cfg = _cfg(tmp_path, "tracking=mlflow", f"tracking.uri=file:{store}")
    tracker = open_tracker(cfg, tmp_path)
    tracker.log({"event": "train", "stage": 0, "step": 1, "loss": 1.0})
    shutil.rmtree(store)  # the store is gone: the library raises
    with caplog.at_level(logging.WARNING, logger="distill.train.tracking"):
        tracker.log({"event": "train", "stage": 0, "step": 2, "loss": 0.5})
        tracker.log({"event": "train", "stage": 0, "step": 3, "loss": 0.25})
        tracker.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("tracking=mlflow failed"), warnings


def test_a_run_that_failed_is_marked_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = f"file:{tmp_path / 'mlruns'}"
    tracker = open_tracker(_cfg(tmp_path, "tracking=mlflow", f"tracking.uri={uri}"), tmp_path)
    tracker.log({"event": "train", "stage": 0, "step": 1, "loss": 1.0})
    tracker.close(failed=True)
    figures, _, status = mlflow_figures(uri)
    assert (figures, status) == ({("stage_0/train/loss", 1): 1.0}, "FAILED")


@pytest.mark.parametrize(("backend", "module", "install"), [
    ("tensorboard", "tensorboard", "pip install 'distill[tensorboard]'"),
    ("wandb", "wandb", "pip install 'distill[wandb]'"),
    ("mlflow", "mlflow", "pip install 'distill[mlflow]'"),
])
def test_a_missing_library_is_refused_naming_its_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       backend: str, module: str, install: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: find_spec answers None
    with pytest.raises(ConfigError) as refused:
        check_tracking(_cfg(tmp_path, f"tracking={backend}"))
    assert str(refused.value).startswith(f"tracking={backend} needs ") and install in str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_mlflow_store_that_mlflow_refuses_is_refused_before_the_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    environment_variables = pytest.importorskip("mlflow.environment_variables")
    if not hasattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow accepts file stores without opting in")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError) as refused:
        check_tracking(_cfg(tmp_path, "tracking=mlflow", f"tracking.uri=file:{tmp_path / 'mlruns'}"))
    assert "MLFLOW_ALLOW_FILE_STORE=true" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "mlruns").exists()
