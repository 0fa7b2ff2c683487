"""The quality tools through the CLI: mode=local with an automatic hybrid (a scoring pass over
both layers, one kept), closed-loop (mix) inputs, patience, then an end-to-end LoRA stage on 2
gloo DDP ranks, killed with SIGKILL mid-stage and resumed; the resumed run keeps the hybrid's
choice, and the exported student is the end-to-end one, with only the converted layer
replaced, and loads back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.integration.test_app import (
    RUN_TIMEOUT_S,
    _cmd,
    _env,
    _is_rank,
    _procs_with,
    _run,
    _run_id,
    _tiny,
    _wait_for,
    _wait_gone,
)

E2E_STAGE = 3
"""Index of the end-to-end stage after the 2 scoring stages and the 1 layer stage."""


RUN_ID = _run_id("qualitye2e")


def _overrides(tmp_path: Path) -> list[str]:
    return [*_tiny(tmp_path, layers=2), "local.num_workers=1", f"run_id={RUN_ID}", f"checkpoint_dir={tmp_path / 'ckpt'}",
            "replacement=mlp", "student.inputs=mix", "student.steps_per_stage=8", "student.val_every_steps=2",
            "student.patience=1", "student.min_delta=10", "student.e2e.steps=30", "student.e2e.trainable=lora",
            "student.e2e.lr=1e-2", "student.e2e.top_k=8", "student.e2e.hidden_weight=0.1",
            "student.checkpoint_every_steps=4", "student.hybrid.keep_softmax=1", "student.hybrid.steps=4"]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
def test_closed_loop_patience_and_e2e_stage_resume_after_kill(tmp_path: Path) -> None:
    overrides = _overrides(tmp_path)
    state = tmp_path / "ckpt" / "current" / "state.json"
    first = subprocess.Popen(_cmd(overrides, tmp_path / "run1"), cwd=tmp_path, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def in_e2e_stage() -> bool:
            return state.exists() and json.loads(state.read_text()).get("stage") == E2E_STAGE

        _wait_for(in_e2e_stage, RUN_TIMEOUT_S, "a checkpoint inside the end-to-end stage", first)
        os.kill([pid for pid in _procs_with(RUN_ID) if _is_rank(pid)][-1], signal.SIGKILL)
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0
    _wait_gone(RUN_ID)
    killed_at = json.loads(state.read_text())["step"]

    log = (result := _run(overrides, tmp_path / "run2", tmp_path)).stdout + result.stderr
    _wait_gone(RUN_ID)
    choice = json.loads((tmp_path / "run2" / "result.json").read_text())["hybrid"]
    (converted,), (kept,) = choice["converted"], choice["kept"]
    assert f"automatic hybrid: converting layers [{converted}], keeping layers [{kept}]" in log
    assert f"stage 2 (layers [{converted}]) already trained: skipping" in log
    assert f"stage {E2E_STAGE}: resumed at step {killed_at}" in log

    run1 = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    layer_ends = [m for m in run1 if m["event"] == "stage_end"]
    assert [(m["kind"], m["steps"], m["stopped"]) for m in layer_ends] == [
        ("score", 4, "steps"), ("score", 4, "steps"), ("layers", 4, "patience")]
    run2 = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in run2 if m["event"] == "stage_end"] == [E2E_STAGE]
    ends = [m for m in run2 if m["event"] == "stage_end"]
    assert ends[-1]["steps"] == 30 and run2[-1]["event"] == "eval"  # the run's figures close the stream
    assert any(m["event"] == "e2e_val" for m in run2) and any(m["event"] == "e2e_train" for m in run2)

    result_json = json.loads((tmp_path / "run2" / "result.json").read_text())
    assert result_json["summary"]["student_after_layer_stages"] > 0 and result_json["eval"]["student"] > 0
    assert result_json["summary"]["student_after_layer_stages"] != result_json["eval"]["student"]

    from distill import load_student

    manifest = json.loads((tmp_path / "run2" / "student" / "distill_student.json").read_text())
    assert list(manifest["layers"]) == [str(converted)]
    report = (tmp_path / "run2" / "report.md").read_text()
    assert "## Automatic hybrid" in report and (tmp_path / "run2" / "hybrid.png").exists()
    model = load_student(str(tmp_path / "run2" / "student"))  # strict load: LoRA was merged away
    ids = torch.randint(0, 300, (1, 8))
    assert model(ids).logits.shape == (1, 8, model.config.vocab_size)
