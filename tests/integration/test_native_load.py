"""An exported student loads with the HF Auto classes in a process that cannot import distill.

A decoder student (linear attention, sliding-window + linear attention, a kept teacher layer,
gated linear attention, a token-wise layer) and an encoder student of the same kinds are exported, their directories copied elsewhere, and a fresh ``python -I`` (no
PYTHONPATH, no user site, no current directory on the path) with ``distill`` blocked in
``sys.modules`` loads them through ``trust_remote_code=True``: its logits must equal
``load_student``'s, its greedy generation with the cache must equal the one without, and
loading without ``trust_remote_code`` must fail.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from distill.model.assemble import export_student, load_student
from distill.model.teacher import Teacher
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
         "num_attention_heads": 4, "initializer_range": 0.2}
CFG = {"_target_": "recorded.only", "_partial_": True}

USER_SCRIPT = r'''
import json, sys
sys.modules["distill"] = None  # any `import distill` now raises ModuleNotFoundError
try:
    import distill  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("distill is importable")
import torch
from transformers import AutoModel, AutoModelForCausalLM
decoder_dir, encoder_dir, ids_path, out_path = sys.argv[1:]
ids = torch.load(ids_path)
try:
    AutoModelForCausalLM.from_pretrained(decoder_dir)
    refused = False
except ValueError as err:
    refused = "trust_remote_code" in str(err)
lm = AutoModelForCausalLM.from_pretrained(decoder_dir, trust_remote_code=True).eval()
encoder = AutoModel.from_pretrained(encoder_dir, trust_remote_code=True).eval()
with torch.no_grad():
    logits = lm(ids).logits
    hidden = encoder(ids).last_hidden_state
kw = dict(max_new_tokens=6, do_sample=False)
same = torch.equal(lm.generate(ids, use_cache=True, **kw), lm.generate(ids, use_cache=False, **kw))
torch.save({"logits": logits, "hidden": hidden, "refused": refused, "generate_same": same,
            "classes": [type(lm).__name__, type(encoder).__name__],
            "distill_loaded": any(m == "distill" or m.startswith("distill.") for m in sys.modules
                                  if sys.modules[m] is not None)}, out_path)
'''


def _students(tmp_path: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    decoder = Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2)))
    encoder = Teacher(BertModel(BertConfig(**SIZES, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0)))
    paths = []
    for teacher in (decoder, encoder):
        replacements = {0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                        1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                        3: GatedLinearAttentionLayer(teacher, 3, gate_init=0.9, chunk_size=4),
                        4: ResidualMLP(teacher, 4)}
        with torch.no_grad():
            for module in replacements.values():
                for param in module.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
        out = tmp_path / "export" / teacher.family
        export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
        paths.append(out)
    return paths[0], paths[1]


def test_auto_classes_load_the_student_where_distill_cannot_be_imported(tmp_path: Path) -> None:
    decoder_dir, encoder_dir = _students(tmp_path)
    elsewhere = tmp_path / "user"
    for src in (decoder_dir, encoder_dir):
        shutil.copytree(src, elsewhere / src.name)
    ids_BT = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.save(ids_BT, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-I", "-c", USER_SCRIPT, str(elsewhere / "llama"), str(elsewhere / "bert"),
         str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["classes"] == ["DistillLlamaForCausalLM", "DistillBertModel"] and not out["distill_loaded"]
    assert out["refused"] and out["generate_same"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the user's process (OMP_NUM_THREADS=1): the same reduction order
    try:
        with torch.no_grad():
            torch.testing.assert_close(out["logits"], load_student(str(decoder_dir))(ids_BT).logits, rtol=0, atol=0)
            expected_BTD = load_student(str(encoder_dir))(ids_BT).last_hidden_state
            torch.testing.assert_close(out["hidden"], expected_BTD, rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)
    assert json.loads((decoder_dir / "config.json").read_text())["model_type"] == "distill_llama"
