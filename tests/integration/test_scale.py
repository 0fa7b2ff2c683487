"""A bfloat16 teacher through the whole CLI run: targets streamed in bfloat16, float32
replacements (linear attention: rotary and masks of their own), an end-to-end stage sharded
with FSDP2 over 2 gloo ranks (checkpointed mid-stage), export, reload and evaluation.

Before the dtype boundary (``call_in_own_dtype``) such a run trained, exported, then died in
finish_run -> evaluate with "mat1 and mat2 must have the same dtype"."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.integration.test_app import _run, _run_id, _tiny, _wait_gone


def test_bf16_teacher_fsdp_e2e_stage_exports_and_evaluates(tmp_path: Path) -> None:
    run_id = _run_id("scalebf16")
    overrides = [*_tiny(tmp_path, layers=2), f"run_id={run_id}", "teacher.dtype=bfloat16",
                 "replacement=linear_attention", "replacement.chunk_size=8", "local.num_workers=1",
                 "student.steps_per_stage=4", "student.layers_per_stage=2", "student.checkpoint_every_steps=2",
                 "student.e2e.steps=4", "student.e2e.trainable=all", "student.e2e.parallel=fsdp",
                 "student.e2e.top_k=8", "student.e2e.loss_chunk_tokens=16", "student.e2e.hidden_weight=0.1",
                 f"checkpoint_dir={tmp_path / 'ckpt'}"]
    result = _run(overrides, tmp_path / "run", tmp_path)
    log = result.stdout + result.stderr
    _wait_gone(run_id)
    assert "fsdp over 2 rank(s)" in log
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in metrics if m["event"] == "stage_end"] == [0, 1]
    assert any(m["event"] == "e2e_val" for m in metrics)
    outcome = json.loads((run / "result.json").read_text())
    assert outcome["eval"]["kind"] == "lm" and 1 < outcome["eval"]["student"] < 1e4
    assert json.loads((run / "student" / "config.json").read_text())["dtype"] == "bfloat16"

    from distill import load_student

    model = load_student(str(run / "student"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(model(torch.randint(0, 300, (1, 8))).logits.float()).all()
