"""The report's section on early stage ends and the end-to-end stage; the config checks
of the quality settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill.model.evaluate import EvalResult
from distill.modes.checks import check_config
from distill.results.report import write_report
from tests.unit.test_config import _compose


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


@pytest.mark.parametrize(("overrides", "message"), [
    (["student.patience=2"], "student.val_every_steps"),
    (["student.max_tokens_per_stage=0"], "student.max_tokens_per_stage"),
    (["student.e2e.steps=5", "student.e2e.temperature=0"], "student.e2e.temperature"),
])
def test_bad_quality_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_compose(overrides))


def test_quality_settings_pass_the_checks() -> None:
    check_config(_compose(["student=e2e", "student.inputs=mix", "student.patience=2", "student.val_every_steps=10",
                           "student.max_tokens_per_stage=100000"]))
    check_config(_compose(["student=e2e", "teacher=tiny_bert"]))  # an encoder's end-to-end stage


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


@pytest.mark.parametrize(("overrides", "message"), [
    (["student.hybrid.keep_softmax=1", "student.hybrid.max_gap=0.02"], "student.hybrid.keep_softmax"),
    (["student.hybrid.keep_softmax=4"], "student.hybrid.keep_softmax"),
    (["student.hybrid.keep_softmax=2", "student.layers=[0,1]"], "student.hybrid.keep_softmax"),
    (["student.hybrid.max_gap=0"], "student.hybrid.max_gap"),
    (["student.hybrid.keep_softmax=1", "student.hybrid.steps=0"], "student.hybrid.steps"),
])
def test_bad_hybrid_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_compose(overrides))
