"""distill.model.assist: the teacher generating alone and with its student drafting, counted by hooks.

On a tiny Llama and its student (linear attention at two layers): the assisted tokens are the
teacher's own; the counts hold together (a teacher forward per verification, so accepted =
new tokens - teacher forwards, at most the drafted ones); the summary adds prompts up. The
student drafting for itself accepts every draft, which pins the counting down exactly.

Shape legend: T tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.model.assemble import export_student, load_student
from distill.model.assist import assist_figures, measure_assist
from distill.model.teacher import Teacher
from distill.replacements.linear_attention import LinearAttentionLayer

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2, "pad_token_id": 0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**SIZES)))
    replacements = {idx: LinearAttentionLayer(teacher, idx, chunk_size=4) for idx in (1, 2)}
    out = tmp_path_factory.mktemp("assist") / "student"
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, {"_target_": "x", "_partial_": True}),
                   str(out))
    return teacher.model, load_student(str(out))


def _prompts(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 64, (1, 12), generator=gen) for _ in range(count)]


def test_assisted_tokens_are_the_teachers_and_the_counts_hold_together(pair) -> None:
    teacher, student = pair
    figures = assist_figures(teacher, student, _prompts(2), new_tokens=10)
    assert figures["prompts"] == figures["same"] == 2 and figures["new_tokens"] == 20
    assert 0 <= figures["accepted"] <= figures["drafted"]
    assert figures["tokens_per_teacher_forward"] == pytest.approx(20 / (20 - figures["accepted"]))
    assert figures["speedup"] == pytest.approx(figures["alone_ms_per_token"] / figures["assisted_ms_per_token"])


def test_a_draft_identical_to_its_target_has_every_draft_accepted(pair) -> None:
    """The counting pinned down: a copy of the target drafts exactly its tokens, so accepted
    (new tokens - target forwards) must equal drafted (draft forwards)."""
    _, student = pair
    run = measure_assist(copy.deepcopy(student), student, _prompts(1)[0], new_tokens=8, repeats=1)
    assert run.same and run.new_tokens == 8 and run.alone.calls == 8  # alone: a forward per token
    assert run.student.calls > 0 and run.accepted == run.student.calls
