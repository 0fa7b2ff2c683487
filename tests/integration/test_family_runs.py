"""A new user's first run on a family with features of its own, through the CLI.

Gemma-2 (embedding scale, soft-capped attention and logits, eager attention, a window
shorter than the chunks) and Granite (embedding, residual, attention and logit
multipliers) run ``mode=local`` with ``replacement=copy student.lr=0.0``: the run must
exit 0, its report must show the teacher's perplexity as HF's own forward scores the same
held-out chunks, and the exported student, loaded with the Auto classes in a process that
cannot import distill, must give the teacher's logits. A kind the family's layers cannot
take is refused before any process starts.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from distill.model.sources import load_chunks, load_tokenizer
from distill.model.tiny_cache import tiny_teacher_dir
from tests.integration.test_app import shared_tiny_cache
from tests.tiny_teachers import family_model

VOCAB = 300
RUN_TIMEOUT_S = 240
COMMON = ["teacher.dtype=float32", "data=text", "data.seq_len=32", "data.max_heldout_chunks=8",
          "student.steps_per_stage=4", "student.e2e.steps=0", "student.micro_batch_size=4",
          "local.num_workers=1", "pipeline.slot_count=8"]

LOAD_SCRIPT = r'''
import sys, torch
sys.modules["distill"] = None
from transformers import AutoModelForCausalLM
student = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(student(torch.load(sys.argv[2])).logits, sys.argv[3])
'''


def _teacher_dir(tmp_path: Path, name: str) -> Path:
    """A random ``name`` teacher saved with the tiny teacher's tokenizer (vocabulary of ``VOCAB``)."""
    tokenizer_dir = Path(tiny_teacher_dir(str(shared_tiny_cache(tmp_path)), hidden_size=32, num_layers=2,
                                          num_heads=2, seq_len=32, vocab_size=VOCAB, train_steps=5))
    out = tmp_path / name
    family_model(name, num_layers=3, vocab_size=VOCAB).save_pretrained(out)
    for path in tokenizer_dir.glob("tokenizer*"):
        shutil.copy(path, out)
    return out


def _corpus(tmp_path: Path) -> str:
    import pydoc_data.topics

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for idx, text in enumerate(list(pydoc_data.topics.topics.values())[:30]):
        (corpus / f"{idx}.txt").write_text(text)
    return f"data.path={corpus}/*.txt"


def _run(overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distill", "mode=local", *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


@pytest.mark.parametrize("name", ["gemma2", "granite"])
def test_a_copy_run_reports_and_exports_the_teacher_itself(tmp_path: Path, name: str) -> None:
    teacher_dir = _teacher_dir(tmp_path, name)
    run_dir = tmp_path / "run"
    result = _run(["teacher=hf", f"teacher.name_or_path={teacher_dir}", _corpus(tmp_path), "replacement=copy",
                   "student.lr=0.0", *COMMON], run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((run_dir / "result.json").read_text())
    teacher = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    run_cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    heldout_NT = load_chunks(run_cfg.data, load_tokenizer(str(teacher_dir))).heldout_NT  # the run's own split
    with torch.no_grad():
        logits_NTV = teacher(heldout_NT).logits
    nll = torch.nn.functional.cross_entropy(logits_NTV[:, :-1].flatten(0, 1), heldout_NT[:, 1:].flatten())
    assert math.isclose(report["eval"]["teacher"], math.exp(nll.item()), rel_tol=1e-4)
    assert math.isclose(report["eval"]["student"], report["eval"]["teacher"], rel_tol=1e-5)
    torch.save(heldout_NT[:2], tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1")
    loaded = subprocess.run([sys.executable, "-I", "-c", LOAD_SCRIPT, str(run_dir / "student"),
                             str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), logits_NTV[:2], rtol=0, atol=1e-5)


def test_a_kind_the_family_cannot_take_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    teacher_dir = _teacher_dir(tmp_path, "granite")
    result = _run(["teacher=hf", f"teacher.name_or_path={teacher_dir}", _corpus(tmp_path),
                   "replacement=linear_attention", *COMMON], tmp_path / "run")
    assert result.returncode != 0
    assert "replacement=linear_attention cannot reproduce the granite teacher's layers: residual_multiplier" in (
        result.stdout + result.stderr)
    assert not (tmp_path / "run" / "broker.out").exists()
