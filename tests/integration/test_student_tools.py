"""The exported student in the tools its users point at it, in a process that cannot import distill.

A mixed decoder student (linear attention, sliding window + linear attention, gated linear
attention, a token-wise layer, a kept teacher layer), with a word-level tokenizer saved beside
it, is copied elsewhere; a fresh ``python -I`` with ``distill`` blocked runs, through
``trust_remote_code=True``:

- ``pipeline("text-generation")``: its greedy text equals ``generate``'s;
- beam search and sampling with several returned sequences;
- peft LoRA on ``q_proj``/``v_proj`` (the teacher's projections inside replaced layers too):
  one optimiser step moves only adapters, and ``merge_and_unload`` computes what the adapted
  model does;
- accelerate's ``device_map="auto"``: the logits of the plain load;
- ``dtype=bfloat16`` and ``float16``: finite logits whose greedy token mostly agrees with float32.

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distill.model.assemble import export_student
from distill.model.teacher import Teacher
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from tests.students import nudged

pytest.importorskip("peft")

VOCAB = 64
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
         "num_attention_heads": 4, "initializer_range": 0.2}
CFG = {"_target_": "recorded.only", "_partial_": True}

USER_SCRIPT = r'''
import json, sys
sys.modules["distill"] = None
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
path, out_path = sys.argv[1:]
report = {}
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
prompt = "w5 w9 w12 w3 w40 w7"
ids = tok(prompt, return_tensors="pt").input_ids
greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
generator = pipeline("text-generation", model=path, tokenizer=path, trust_remote_code=True)
text = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
report["pipeline_equals_generate"] = text.split() == tok.decode(greedy[0, ids.shape[1]:]).split()
batch = tok(["w5 w9 w12", "w3 w40 w7 w8 w11"], return_tensors="pt", padding=True)
beams = model.generate(**batch, max_new_tokens=4, num_beams=3, num_return_sequences=2, pad_token_id=tok.pad_token_id)
samples = model.generate(**batch, max_new_tokens=4, do_sample=True, top_k=8, num_return_sequences=2,
                         pad_token_id=tok.pad_token_id)
report["beam_and_sample_shapes"] = [list(beams.shape), list(samples.shape), batch.input_ids.shape[1] + 4]
with torch.no_grad():
    plain = model(ids).logits
lora = get_peft_model(AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True),
                      LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
adapted = [n for n, p in lora.named_parameters() if p.requires_grad]
report["lora_in_replaced_layer"] = any(".block." in n for n in adapted)
report["only_adapters_train"] = all("lora_" in n for n in adapted) and len(adapted) == 16  # 4 attentions x q, v x A, B
lora.train()
optimiser = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.5)
loss = lora(input_ids=ids, labels=ids).loss
loss.backward()
optimiser.step()
lora.eval()
with torch.no_grad():
    adapted_logits = lora(input_ids=ids).logits
    merged_logits = lora.merge_and_unload()(ids).logits
report["lora_moved"] = float((adapted_logits - plain).abs().max())
report["merged_diff"] = float((merged_logits - adapted_logits).abs().max())
mapped = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, device_map="auto").eval()
with torch.no_grad():
    report["device_map_diff"] = float((mapped(ids).logits - plain).abs().max())
report["device_map"] = sorted({str(p.device) for p in mapped.parameters()})
for dtype in ("bfloat16", "float16"):
    half = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = half(ids).logits
    half.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    report[dtype] = {"finite": bool(torch.isfinite(logits).all()), "dtype": str(logits.dtype),
                     "argmax_agree": float((logits.float().argmax(-1) == plain.argmax(-1)).float().mean())}
json.dump(report, open(out_path, "w"))
'''


def _student_with_tokenizer(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                                   bos_token_id=2)))
    replacements = {0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                    1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                    3: GatedLinearAttentionLayer(teacher, 3, gate_init=0.9, chunk_size=4),
                    4: ResidualMLP(teacher, 4, hidden_mult=1.0)}
    nudged(replacements)
    out = tmp_path / "export"
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1", bos_token="w2",
                            unk_token="w3", padding_side="left").save_pretrained(out)
    return out


def test_pipeline_generate_peft_device_map_and_half_precision_work_without_distill(tmp_path: Path) -> None:
    user_dir = tmp_path / "user" / "student"
    shutil.copytree(_student_with_tokenizer(tmp_path), user_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-I", "-c", USER_SCRIPT, str(user_dir), str(tmp_path / "out.json")],
                            cwd=user_dir.parent, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["pipeline_equals_generate"]
    width = report["beam_and_sample_shapes"][2]  # the padded prompts and 4 new tokens
    assert report["beam_and_sample_shapes"][:2] == [[4, width], [4, width]]
    assert report["lora_in_replaced_layer"] and report["only_adapters_train"], report
    assert report["lora_moved"] > 1e-4 and report["merged_diff"] < 1e-5
    assert report["device_map"] == ["cpu"] and report["device_map_diff"] == 0.0
    for dtype in ("bfloat16", "float16"):
        assert report[dtype]["finite"] and report[dtype]["dtype"] == f"torch.{dtype}"
        assert report[dtype]["argmax_agree"] >= 0.8, report
