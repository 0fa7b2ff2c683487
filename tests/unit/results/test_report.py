"""distill.results.report on a synthetic run: metrics.jsonl in, report.md and losses.png out."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

from distill.model.evaluate import EvalResult
from distill.results.report import TABLE_HEADER, plot_losses, read_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_metrics() -> list[dict]:
    """Two stages (layers 0+1, then 2), a few train/val points each, as the trainer logs."""
    metrics: list[dict] = []
    for stage, layers in enumerate([[0, 1], [2]]):
        for step in range(10, 60, 10):
            losses = {str(idx): 1.0 / (step * (idx + 1)) for idx in layers}
            metrics.append(
                {
                    "event": "train",
                    "stage": stage,
                    "layers": layers,
                    "step": step,
                    "loss": sum(losses.values()),
                    "layer_losses": losses,
                    "lr": 1e-3,
                    "samples_per_s": 100.0,
                    "wait_fraction": 0.02,
                    "time_s": step / 10,
                }
            )
            if step % 20 == 0:
                val = {k: 1.1 * v for k, v in losses.items()}
                own = {k: 2 * v for k, v in val.items()}
                metrics.append({"event": "val", "stage": stage, "step": step, "layer_losses": val,
                                "student_losses": own})
        metrics.append(
            {
                "event": "stage_end",
                "stage": stage,
                "layers": layers,
                "steps": 50,
                "tokens": 25600,
                "wall_s": 5.0,
            }
        )
    return metrics


def _describe_row(ratio: float) -> dict:
    return {
        "params": int(1000 * ratio),
        "teacher_params": 1000,
        "params_ratio": ratio,
        "flops_per_token": int(2000 * ratio),
        "teacher_flops_per_token": 2000,
        "flops_ratio": ratio,
    }


def test_read_metrics_round_trip_and_truncated_tail(tmp_path: Path) -> None:
    metrics = _synthetic_metrics()
    path = tmp_path / "metrics.jsonl"
    text = "\n".join(json.dumps(m) for m in metrics) + "\n\n"
    path.write_text(text + '{"event": "train", "st')  # killed mid-write
    assert read_metrics(str(path)) == metrics
    path.write_text('{"event": \n' + text)
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(str(path))


def test_plot_losses_writes_png_without_pyplot_state(tmp_path: Path) -> None:
    backend = matplotlib.get_backend()
    out = plot_losses(_synthetic_metrics(), str(tmp_path / "plots" / "losses.png"))
    assert Path(out).read_bytes()[:8] == PNG_MAGIC
    assert matplotlib.get_backend() == backend
    empty = plot_losses([], str(tmp_path / "empty.png"))  # a run that logged nothing yet
    assert Path(empty).read_bytes()[:8] == PNG_MAGIC


def test_write_report(tmp_path: Path) -> None:
    result = EvalResult(
        kind="lm",
        teacher=20.0,
        student=25.0,
        per_layer={0: 21.0, 1: 22.5, 2: 20.5},
        num_tokens=4096,
    )
    path = write_report(
        str(tmp_path),
        _synthetic_metrics(),
        result.to_dict(),  # as read back from eval.json
        {0: _describe_row(0.5), 1: _describe_row(0.25), 2: _describe_row(0.25)},
        {"teacher": {"name_or_path": "tiny"}, "replacement": "mlp", "data": {"seq_len": 128}},
        timings={"teacher": 30.0, "train": 60.0, "eval": 10.0},
    )
    text = Path(path).read_text()
    assert Path(path) == tmp_path / "report.md"
    assert (tmp_path / "losses.png").read_bytes()[:8] == PNG_MAGIC
    assert TABLE_HEADER in text
    assert "| layer | replacement params ratio | FLOPs/token ratio |" in text
    assert "![training and validation losses](losses.png)" in text
    assert "`teacher.name_or_path` | tiny" in text
    assert "+25.00%" in text  # relative gap 25 / 20 - 1
    # layer 1: ratio 0.25, last val loss 1.1 / (40 * 2) (twice that on student inputs), alone ppl
    # 22.5, tokens of stage 0
    assert "| 1 | 0.25 | 0.25 | 0.01375 | 0.0275 | 22.5 | 25,600 |" in text
    assert "| **all** | 0.3333 | 0.3333 | – | – | – | 51,200 |" in text
    assert "after the layer stages" not in text and "identity baseline" not in text
    assert "| train | 60.0 | 60.0% |" in text


def test_write_report_without_eval(tmp_path: Path) -> None:
    """evaluate=false: the trainer passes {}; val losses may only be in stage_end events."""
    metrics = [
        {
            "event": "stage_end",
            "stage": 0,
            "layers": [3],
            "steps": 5,
            "tokens": 640,
            "val": {"3": 0.5},
        }
    ]
    text = Path(write_report(str(tmp_path), metrics, {}, {}, {}, {"train_s": 2.0})).read_text()
    assert "Not evaluated" in text
    assert "| 3 | – | – | 0.5 | – | – | 640 |" in text
    assert "| train | 2.0 | 100.0% |" in text


def test_write_report_after_an_e2e_stage_shows_both_per_layer_scores(tmp_path: Path) -> None:
    result = EvalResult(kind="encoder", teacher=1.0, student=0.97, per_layer={0: 0.99, 1: 0.98},
                        num_tokens=64, identity=0.4, per_layer_layer_stages={0: 0.95, 1: 0.9})
    metrics = [{"event": "stage_end", "stage": 0, "layers": [0, 1], "steps": 5, "tokens": 640,
                "val": {"0": 0.1, "1": 0.2}, "val_student": {"0": 0.1, "1": 0.3}},
               {"event": "e2e_val", "stage": 1, "step": 10, "cosine": 0.97},
               {"event": "stage_end", "stage": 1, "layers": [], "steps": 10, "tokens": 640, "best_step": 10}]
    text = Path(write_report(str(tmp_path), metrics, result.to_dict(), {}, {})).read_text()
    assert TABLE_HEADER + " spliced-alone, after the layer stages |" in text
    assert "| 1 | – | – | 0.2 | 0.3 | 0.98 | 640 | 0.9 |" in text
    assert "| replaced layers skipped (identity baseline) | 0.4 |" in text
    assert "| end-to-end step | held-out cosine similarity of final hidden states |" in text
    assert "| 10 | 0.97 |" in text and "kept the weights of step 10" in text


def test_write_report_encoder_without_timings(tmp_path: Path) -> None:
    result = EvalResult(
        kind="encoder", teacher=1.0, student=0.9, per_layer={0: 0.95}, num_tokens=64
    )
    text = Path(write_report(str(tmp_path), [], result, {}, {"replacement": "copy"})).read_text()
    assert "cosine similarity" in text and "-10.00%" in text
    assert "## Time" not in text
    assert "| 0 | – | – | – | – | 0.95 | – |" in text


def test_report_names_early_stops_and_the_e2e_stage(tmp_path: Path) -> None:
    metrics = [
        {"event": "stage_end", "stage": 0, "layers": [0], "steps": 4, "tokens": 1024, "stopped": "patience"},
        {"event": "stage_end", "stage": 1, "layers": [1], "steps": 8, "tokens": 2048, "stopped": "steps"},
        {"event": "e2e_val", "stage": 2, "step": 10, "ppl": 31.5},
        {"event": "stage_end", "stage": 2, "layers": [], "steps": 10, "tokens": 4096, "stopped": "steps"},
    ]
    result = EvalResult(kind="lm", teacher=30.0, student=31.5, per_layer={0: 30.5, 1: 30.7}, num_tokens=100)
    text = Path(write_report(str(tmp_path), metrics, result, {}, {"student_after_layer_stages": 33.0})).read_text()
    assert "stage 0 (patience after 4 steps, 1,024 tokens)" in text and "stage 1 (" not in text
    assert "Student after the layer stages: 33" in text
    assert "| 10 | 31.5 |" in text
    assert "| 0 | – | – | – | – | 30.5 | 1,024 |" in text  # the e2e stage names no layer: no layer budget


def test_no_section_for_a_plain_run(tmp_path: Path) -> None:
    metrics = [{"event": "stage_end", "stage": 0, "layers": [0], "steps": 8, "tokens": 2048}]
    text = Path(write_report(str(tmp_path), metrics, None, {}, {})).read_text()
    assert "end-to-end" not in text


def test_report_shows_the_hybrid_choice_and_its_curve(tmp_path: Path) -> None:
    hybrid = {"kind": "lm", "score": "kl", "teacher": 30.0, "steps": 50, "keep_softmax": 1, "max_gap": None,
              "kl": {"0": 0.2, "1": 0.01, "2": 0.05}, "spliced_alone": {"0": 33.0, "1": 30.2, "2": 31.0},
              "order": [1, 2, 0], "curve": [30.0, 30.2, 31.1, 34.5], "converted": [1, 2], "kept": [0]}
    result = EvalResult(kind="lm", teacher=30.0, student=30.6, per_layer={1: 30.1, 2: 30.5}, num_tokens=100)
    text = Path(write_report(str(tmp_path), [], result, {}, {}, hybrid=hybrid)).read_text()
    assert "`student.hybrid.keep_softmax=1`" in text and "converted layers [1, 2], kept layers [0]" in text
    assert "| 1 | 0.01 | 30.2 | converted |" in text and "| 0 | 0.2 | 33 | **kept (teacher)** |" in text
    assert "| 2 | 1, 2 | 31.1 |" in text and "trained student, 2 layers converted: 30.6" in text
    assert (tmp_path / "hybrid.png").read_bytes()[:4] == b"\x89PNG"
