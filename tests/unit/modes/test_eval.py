"""mode=eval: lm-evaluation-harness on a student and its teacher, one table.

The table and its files are checked on result dicts in the harness's format, the start-up
checks on composed configs (both without lm_eval, so CI covers them); the whole mode runs
the real harness on a tiny exported student and its teacher over a local multiple-choice
task written as JSONL by the test (no hub), and is skipped where lm_eval is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import LlamaConfig, LlamaForCausalLM

from distill.config import CONF_DIR, register_configs
from distill.model.assemble import export_student
from distill.model.teacher import Teacher
from distill.model.tiny import train_tokenizer
from distill.modes.checks import check_config
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.results.harness import harness_rows, harness_table, write_harness_results

CFG = {"_target_": "recorded.only", "_partial_": True}


def _compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["mode=eval", *overrides])


def _results(acc: float, norm: float) -> dict:
    """The ``results`` part of lm_eval.simple_evaluate's answer for one task."""
    return {"arc_easy": {"alias": "arc_easy", "acc,none": acc, "acc_stderr,none": 0.01,
                         "acc_norm,none": norm, "acc_norm_stderr,none": 0.02},
            "only_teacher": {"acc,none": 0.9}, "sizes": {"sample_len": 6}}


def test_table_puts_teacher_and_student_side_by_side(tmp_path: Path) -> None:
    rows = harness_rows(_results(0.70, 0.65), {"arc_easy": _results(0.62, 0.60)["arc_easy"]})
    assert [(r["task"], r["metric"]) for r in rows] == [("arc_easy", "acc"), ("arc_easy", "acc_norm")]
    assert rows[0]["teacher"] == 0.70 and rows[0]["student"] == 0.62 and rows[0]["student_stderr"] == 0.01
    table = harness_table(rows, "teacher-dir", "student-dir")
    assert "| arc_easy | acc | 0.7000 ± 0.0100 | 0.6200 ± 0.0100 | -0.0800 |" in table
    path = write_harness_results(tmp_path, rows, "teacher-dir", "student-dir")
    assert path.read_text().count("| arc_easy |") == 2
    assert json.loads((tmp_path / "eval.json").read_text())["rows"] == rows


def test_mode_eval_needs_a_student_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lm_eval.student"):
        check_config(_compose([]))
    with pytest.raises(ValueError, match="lm_eval.student"):
        check_config(_compose([f"lm_eval.student={tmp_path}"]))


TASK_YAML = """task: distill_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _local_task(tmp_path: Path) -> Path:
    """A 6-question multiple-choice task as JSONL plus its YAML, in a directory for include_path."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"question": f"def f{i}(x):\n    return", "choices": [" x + 1", " None", " [x]"], "answer": i % 3}
            for i in range(6)]
    (tasks / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "distill_tiny_mc.yaml").write_text(TASK_YAML.format(data=tasks / "data.jsonl"))
    return tasks


def test_mode_eval_scores_student_and_teacher_on_a_local_task(tmp_path: Path) -> None:
    """``python -m distill mode=eval`` as a user runs it (its own process: the harness and
    accelerate set process-wide state that must not leak into other tests)."""
    pytest.importorskip("lm_eval")
    torch.manual_seed(0)
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 8, vocab_size=300, seq_len=64)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4)))
    teacher_dir = tmp_path / "teacher"
    teacher.model.save_pretrained(teacher_dir)
    replacements = {0: LinearAttentionLayer(teacher, 0, chunk_size=4), 1: ResidualMLP(teacher, 1)}
    student_dir = tmp_path / "student"
    export_student(teacher, str(teacher_dir), replacements, dict.fromkeys(replacements, CFG), str(student_dir),
                   tokenizer)
    overrides = [f"lm_eval.student={student_dir}", "lm_eval.tasks=[distill_tiny_mc]",
                 f"lm_eval.include_path={_local_task(tmp_path)}", "lm_eval.batch_size=4", "log_level=WARNING"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "distill", "mode=eval", *overrides, f"hydra.run.dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "custom code" not in run.stdout + run.stderr  # no question on stdin about the student's own code
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["teacher"] == str(teacher_dir)  # from the student's distill_student.json
    (row,) = result["rows"]
    assert (row["task"], row["metric"]) == ("distill_tiny_mc", "acc")
    assert all(value in {i / 6 for i in range(7)} for value in (row["teacher"], row["student"]))
    assert row["teacher_stderr"] is not None and row["student_stderr"] is not None  # the table says ± for each
    assert "| distill_tiny_mc | acc |" in (tmp_path / "out" / "eval.md").read_text()
