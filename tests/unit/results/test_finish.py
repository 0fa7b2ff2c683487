"""finish_run scores the exported student once (an end-to-end stage that kept its step-0 weights
is the layer stages' student, not a second one to evaluate) and renders the run's three files
from one record."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from distill.model.evaluate import EvalResult
from distill.model.teacher import Teacher
from distill.replacements.mlp import ResidualMLP
from distill.results.finish import render_run, same_student
from distill.results.record import RunRecord, read_result
from tests.tiny_teachers import family_model


def test_a_student_rolled_back_to_its_step_0_weights_is_the_same_student() -> None:
    teacher = Teacher(family_model("llama"))
    replacements = {1: ResidualMLP(teacher, 1, hidden_mult=1.0)}
    rolled_back = copy.deepcopy(replacements)
    assert same_student(teacher, replacements, teacher, rolled_back)
    with torch.no_grad():
        next(rolled_back[1].parameters()).add_(1e-3)
    assert not same_student(teacher, replacements, teacher, rolled_back)
    assert not same_student(teacher, replacements, Teacher(family_model("llama")), copy.deepcopy(replacements))


def test_report_result_and_model_card_are_rendered_from_one_record(tmp_path: Path) -> None:
    """The three files a run leaves are views of one RunRecord: the same figures in each."""
    result = EvalResult(kind="lm", teacher=20.0, student=25.0, per_layer={0: 21.0, 1: 22.5}, num_tokens=4096)
    rows = {layer: {"params": 500, "teacher_params": 1000, "params_ratio": 0.5, "flops_per_token": 900,
                    "teacher_flops_per_token": 2000, "flops_ratio": 0.45} for layer in (0, 1)}
    cfgs = {layer: {"_target_": "distill.replacements.linear_attention.LinearAttention", "feature_dim": 16}
            for layer in (0, 1)}
    record = RunRecord(summary={"command": "python -m distill", "teacher_source": "/models/tiny",
                                "replacement": "linear_attention", "layers": [0, 1], "train_tokens": 51_200},
                       layers=rows, layer_cfgs=cfgs, num_layers=4, causal=True,
                       data={"source": "pydoc", "seq_len": 128}, eval=result.to_dict(),
                       timings={"export_s": 1.5}, final_val={"0": 0.1, "1": 0.2})
    student_dir = tmp_path / "student"
    student_dir.mkdir()
    report = Path(render_run(record, str(tmp_path), str(student_dir), []))
    text, card = report.read_text(), (student_dir / "README.md").read_text()
    stored = read_result(tmp_path)
    assert stored == json.loads(json.dumps(record.result_json()))
    assert stored["eval"]["student"] == 25.0 and stored["summary"]["train_tokens"] == 51_200
    for rendered in (text, card):
        assert "+25.00%" in rendered and "/models/tiny" in rendered
    assert "| this student | 25.00 |" in card and "51,200 training tokens" in card
    assert "| 0 | LinearAttention | feature_dim=16 | 0.5 | 0.45 |" in card
