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
    assert "| 1 | 0.2500 | 0.2500 | 0.01375 | 0.02750 | 22.50 | 25,600 |" in text
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
    assert "| 3 | – | – | 0.5000 | – | – | 640 |" in text
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
    assert "| 1 | – | – | 0.2000 | 0.3000 | 0.9800 | 640 | 0.9000 |" in text
    assert "| replaced layers skipped (identity baseline) | 0.4000 |" in text
    assert "| end-to-end step | held-out cosine similarity of final hidden states |" in text
    assert "| 10 | 0.9700 |" in text and "kept the weights of step 10" in text
    assert "has also had the end-to-end stage" not in text  # no layer-stage score in this summary


def test_an_end_to_end_stage_that_only_made_it_worse_is_named_so(tmp_path: Path) -> None:
    """The stage keeps its step-0 weights: the report must not say the exported student had it,
    and says what to change (SmolLM2 at the default learning rate went from 32.2 to 47.0)."""
    metrics = [{"event": "e2e_val", "stage": 1, "step": 0, "ppl": 32.2},
               {"event": "e2e_val", "stage": 1, "step": 120, "ppl": 47.0},
               {"event": "stage_end", "stage": 1, "layers": [], "steps": 120, "tokens": 640, "best_step": 0}]
    text = Path(write_report(str(tmp_path), metrics, {}, {}, {"student_after_layer_stages": 32.2})).read_text()
    assert "improved on it at no validation, so the exported student above is this one" in text
    assert "has also had the end-to-end stage" not in text
    assert "kept the weights of step 0" in text and "`student.e2e.lr`" in text


def test_write_report_encoder_without_timings(tmp_path: Path) -> None:
    result = EvalResult(
        kind="encoder", teacher=1.0, student=0.9, per_layer={0: 0.95}, num_tokens=64
    )
    text = Path(write_report(str(tmp_path), [], result, {}, {"replacement": "copy"})).read_text()
    assert "cosine similarity" in text and "-10.00%" in text
    assert "## Time" not in text
    assert "| 0 | – | – | – | – | 0.9500 | – |" in text


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
    assert "Student after the layer stages: 33.00" in text
    assert "| 10 | 31.50 |" in text
    assert "| 0 | – | – | – | – | 30.50 | 1,024 |" in text  # the e2e stage names no layer: no layer budget


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
    assert "| 1 | 0.01000 | 30.20 | converted |" in text and "| 0 | 0.2000 | 33.00 | **kept (teacher)** |" in text
    assert "| 2 | 1, 2 | 31.10 |" in text and "trained student, 2 layers converted: 30.60" in text
    assert (tmp_path / "hybrid.png").read_bytes()[:4] == b"\x89PNG"
    # keep_softmax on a deep teacher measures a few points of the curve: the others are not shown
    sparse = {**hybrid, "curve": [30.0, 30.2, None, 34.5]}
    text = Path(write_report(str(tmp_path), [], result, {}, {}, hybrid=sparse)).read_text()
    assert "| 1 | 1 | 30.20 |" in text and "| 3 | 0, 1, 2 | 34.50 |" in text and "| 2 | 1, 2 |" not in text
    assert (tmp_path / "hybrid.png").read_bytes()[:4] == b"\x89PNG"


def test_spliced_alone_scores_on_a_subset_name_the_teacher_on_that_subset(tmp_path: Path) -> None:
    """A deep student's spliced-alone perplexities are measured on the first few chunks: set
    beside the teacher's on all of them, every layer alone would look 20% worse than it is."""
    result = EvalResult(kind="lm", teacher=29.36, student=30.22, per_layer={0: 35.77, 1: 35.52}, num_tokens=4064,
                        per_layer_tokens=1016, per_layer_teacher=35.40)
    text = Path(write_report(str(tmp_path), [], result, {}, {})).read_text()
    assert "on the first 1,016 of the 4,064 held-out tokens" in text
    assert "the teacher on those tokens: 35.40, on all of them 29.36" in text


# ---------------------------------------------------------------------- issue 39 item 6


def test_one_precision_per_column_keeps_every_measured_difference(tmp_path: Path) -> None:
    """381.0 is not printed as "381" next to "381.3", and 381.25 / 381.31 do not both print as 381.3."""
    result = EvalResult(kind="lm", teacher=381.0, student=381.3, per_layer={0: 381.25, 1: 381.31}, num_tokens=64)
    text = Path(write_report(str(tmp_path), [], result, {}, {})).read_text()
    assert "| teacher | 381.00 |" in text and "| student (all replacements) | 381.30 |" in text
    assert "| 0 | – | – | – | – | 381.25 | – |" in text and "| 1 | – | – | – | – | 381.31 | – |" in text
    assert "(teacher: 381.00)" in text
    close = EvalResult(kind="lm", teacher=1000.0, student=1000.01, per_layer={}, num_tokens=64)
    text = Path(write_report(str(tmp_path), [], close, {}, {})).read_text()
    assert "| teacher | 1000.00 |" in text and "| 1000.01 |" in text and "+0.0010%" in text  # not +0.00%


def test_the_configuration_table_shows_the_options_typed(tmp_path: Path) -> None:
    """``replacement=linear_attention``, ``teacher=tiny_llama`` and the command line as typed; not the class
    path of the replacement nor the teacher's cache directory."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from distill.config import CONF_DIR, register_configs
    from distill.results.finish import chosen_options

    register_configs()
    typed = ["replacement=linear_attention", "student.layers=[1]", "data.seq_len=32"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=typed, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    summary = chosen_options(cfg, str(tmp_path / "teacher"))
    text = Path(write_report(str(tmp_path), [], None, {}, summary)).read_text()
    table = text.split("## Configuration")[1].split("##")[0]
    assert "| `replacement` | linear_attention |" in table and "| `teacher` | tiny_llama |" in table
    assert f"| `command` | `python -m distill {' '.join(typed)}` |" in table
    assert "distill.replacements" not in table
    assert table.index("`teacher`") < table.index("`teacher_source`")  # the cache path last, named as such


def test_losses_png_draws_the_validation_curves(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    from distill.results.report import _draw_curves, _train_curves, _val_curves

    ax = Figure().subplots()
    _draw_curves(ax, _train_curves(_synthetic_metrics()), _val_curves(_synthetic_metrics()))
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels.count("layer 0 (val)") == 1 and len(labels) == 6  # 3 layers: train and val each
    val = next(line for line in ax.get_lines() if line.get_label() == "layer 2 (val)")
    assert list(val.get_xdata()) == [20, 40]


def test_a_run_restored_from_checkpoints_says_why_it_has_no_curves(tmp_path: Path) -> None:
    summary = {"restored_layers": [0, 1], "checkpoint_dir": "outputs/checkpoints/mlp-0123456789"}
    text = Path(write_report(str(tmp_path), [], None, {}, summary)).read_text()
    losses = text.split("## Losses")[1]
    assert "layers [0, 1] were not trained by this run" in losses and "mlp-0123456789" in losses
    assert "losses.png" not in text and not (tmp_path / "losses.png").exists()  # no empty panels


def test_local_s_time_split_replaces_the_student_s_time_table(tmp_path: Path) -> None:
    """One time table: the run's wall-time split, not also the student's phases with another total."""
    from distill.results.report_file import TIME_HEADING, replace_section
    from distill.train.timing import format_time_split

    write_report(str(tmp_path), _synthetic_metrics(), None, {}, {}, timings={"student_compute_s": 84.6})
    split = format_time_split([("student compute", 84.6), ("student other", 28.1)], 112.7, 1)
    replace_section(str(tmp_path), TIME_HEADING, split)
    text = (tmp_path / "report.md").read_text()
    assert text.count(" | seconds | ") == 1  # the time table, once
    assert TIME_HEADING + "\n" not in text and "Run wall time 112.7 s" in text
    assert text.index("## Where the time went") < text.index("## Losses")  # in place, the plot still last


def test_greedy_continuations_are_a_table_of_the_prompts(tmp_path: Path) -> None:
    """Generated text may hold pipes and line breaks: each row stays one row of three cells."""
    result = EvalResult(kind="lm", teacher=20.0, student=25.0, per_layer={0: 21.0}, num_tokens=4096)
    rows = [{"prompt": "The capital of France is", "teacher": " Paris.", "student": " Paris, the"},
            {"prompt": "def fibonacci(n):", "teacher": "\n    if n | 1:", "student": "\n    return"}]
    path = write_report(str(tmp_path), _synthetic_metrics(), result.to_dict(), {0: _describe_row(0.5)},
                        {"replacement": "mlp"}, decode={"continuations": rows})
    text = Path(path).read_text()
    assert "## Greedy continuations" in text
    assert "| `The capital of France is` | ` Paris.` | ` Paris, the` |" in text
    assert "| `def fibonacci(n):` | `⏎    if n \\| 1:` | `⏎    return` |" in text
    assert "## Greedy continuations" not in Path(write_report(str(tmp_path / "b"), [], result.to_dict(), {}, {})).read_text()
