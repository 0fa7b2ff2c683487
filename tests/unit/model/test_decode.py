"""distill.model.decode: decode timing at a context, on a tiny teacher and its linear-attention student.

The grown cache must hold the context (positions counted, KV of that length, a sliding
window kept to its window) and the student's state must not grow with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from distill.model.assemble import export_student, load_student
from distill.model.decode import PROMPT_TOKENS, cache_bytes, grow_cache, measure_decode
from distill.model.teacher import Teacher
from distill.replacements.linear_attention import LinearAttentionLayer

CFG = {"_target_": "recorded.only", "_partial_": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    teacher = Teacher(MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=None)))
    replacements = {idx: LinearAttentionLayer(teacher, idx, chunk_size=4) for idx in range(2)}
    out: Path = tmp_path_factory.mktemp("decode") / "student"
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
    return teacher.model, load_student(str(out))


def test_student_state_is_flat_in_context_and_teacher_cache_grows(models) -> None:
    teacher, student = models
    teacher_32, student_32 = (measure_decode(m, 32, batch=2, steps=2, warmup=1) for m in (teacher, student))
    teacher_128, student_128 = (measure_decode(m, 128, batch=2, steps=2, warmup=1) for m in (teacher, student))
    assert student_32.cache_bytes == student_128.cache_bytes > 0
    kv_per_position = 2 * 2 * 2 * 2 * 8 * 4  # K and V, layers, batch, KV heads, head size, float32
    assert teacher_128.cache_bytes - teacher_32.cache_bytes == 96 * kv_per_position
    assert teacher_32.ms_per_token > 0 and student_32.ms_per_token > 0


def test_grown_cache_holds_the_context(models) -> None:
    _, student = models
    cache = DynamicCache(config=student.config)
    with torch.no_grad():
        student(torch.randint(0, 64, (1, PROMPT_TOKENS)), cache=cache, use_cache=True)
    before = cache_bytes(cache)
    grow_cache(cache, 500, torch.Generator().manual_seed(0))
    assert [int(layer.cumulative_length_linear) for layer in cache.layers] == [500, 500] and cache_bytes(cache) == before
    with pytest.raises(ValueError, match="context"):
        measure_decode(student, 2)
