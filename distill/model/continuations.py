"""Greedy continuations of a few fixed prompts by the teacher and its student, side by side.

A perplexity ratio says how much a student lost; a continuation shows what that means: a
student at 1.2x its teacher's perplexity may still complete "The capital of France is" with
"Paris", one at 2x often repeats itself. The prompts are fixed, so two runs' reports compare
line by line. Both models decode greedily (no sampling), each with its own cache, from the
same token ids; only the new tokens are shown.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

PROMPTS = ("The capital of France is", "def fibonacci(n):", "The most important rule of writing is")
"""English prose, Python and an opinion: the kinds of text distill's corpora hold."""
NEW_TOKENS = 24


@torch.no_grad()
def greedy_text(model: PreTrainedModel, tokenizer, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
    """``model``'s greedy continuation of ``prompt`` (the new tokens only, decoded)."""
    device = next(model.parameters()).device
    ids_1T = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out_1T = model.generate(ids_1T, attention_mask=torch.ones_like(ids_1T), max_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out_1T[0, ids_1T.shape[1]:], skip_special_tokens=True)


def continuations(teacher: PreTrainedModel, student: PreTrainedModel, tokenizer,
                  prompts: tuple[str, ...] = PROMPTS, new_tokens: int = NEW_TOKENS) -> list[dict[str, str]]:
    """``{"prompt", "teacher", "student"}`` for each prompt (see the module docstring)."""
    return [{"prompt": prompt, "teacher": greedy_text(teacher, tokenizer, prompt, new_tokens),
             "student": greedy_text(student, tokenizer, prompt, new_tokens)} for prompt in prompts]
