"""The exported student under torch.compile, as a user compiles it.

A mixed student (linear attention, sliding window + linear attention, a kept teacher layer,
gated linear attention, a token-wise layer) must trace with no graph break
(``torch._dynamo.explain``) for a prefill and a decode step, padded and unpadded; compiled with
``fullgraph=True`` it must give eager's logits over a prefill and several decode steps without
recompiling at every position (its position counters are tensors, not Python ints). A static
cache is refused with a message that says what to use.

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from distill.model.assemble import export_student, load_student
from distill.model.teacher import Teacher
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from tests.students import nudged, single_thread  # noqa: F401  (single_thread: an autouse fixture)

VOCAB = 64
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
         "num_attention_heads": 4, "initializer_range": 0.2}
CFG = {"_target_": "recorded.only", "_partial_": True}


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, pad_token_id=0)))
    replacements = {0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                    1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                    3: GatedLinearAttentionLayer(teacher, 3, gate_init=0.9, chunk_size=4),
                    4: ResidualMLP(teacher, 4)}
    nudged(replacements)
    out = tmp_path_factory.mktemp("compile") / "student"
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
    return load_student(str(out))


def _batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids_BT = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask_BT = torch.ones_like(ids_BT)
    if padded:
        mask_BT[0, :3] = 0  # left padding, as generate batches prompts
    return ids_BT, mask_BT


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_prefill_and_decode_step_trace_without_graph_breaks(student: torch.nn.Module, padded: bool) -> None:
    ids_BT, mask_BT = _batch(padded)
    torch._dynamo.reset()
    prefill = torch._dynamo.explain(student)(ids_BT, attention_mask=mask_BT, cache=DynamicCache(config=student.config))
    assert prefill.graph_break_count == 0, [b.reason for b in prefill.break_reasons]
    cache = DynamicCache(config=student.config)
    with torch.no_grad():
        student(ids_BT, attention_mask=mask_BT, cache=cache)
    step_mask_BT = torch.cat([mask_BT, torch.ones_like(mask_BT[:, :1])], dim=1)
    position_ids_B1 = step_mask_BT.sum(-1, keepdim=True) - 1
    torch._dynamo.reset()
    step = torch._dynamo.explain(student)(ids_BT[:, :1], attention_mask=step_mask_BT, position_ids=position_ids_B1,
                                          cache=cache)
    assert step.graph_break_count == 0, [b.reason for b in step.break_reasons]


def test_compiled_decoding_equals_eager_and_does_not_recompile_per_position(student: torch.nn.Module) -> None:
    ids_BT, mask_BT = _batch(padded=True)
    steps = 6

    def decode(model: torch.nn.Module) -> torch.Tensor:
        cache, mask, logits = DynamicCache(config=student.config), mask_BT, []
        with torch.no_grad():
            out = model(ids_BT, attention_mask=mask, cache=cache)
            for _ in range(steps):
                logits.append(out.logits[:, -1])
                nxt_B1 = out.logits[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(nxt_B1, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1, cache=cache)
        return torch.stack(logits, dim=1)

    eager_BSV = decode(student)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(student, fullgraph=True, backend="eager", dynamic=None)
    torch.testing.assert_close(decode(compiled), eager_BSV, rtol=0, atol=1e-5)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # the prefill, the first step (a state appears), then one graph for every later step, whose KV
    # lengths are dynamic from then on: a graph per position would be 7
    assert frames <= 3, frames


def test_a_static_cache_is_refused_with_what_to_use(student: torch.nn.Module) -> None:
    ids_BT, _ = _batch(padded=False)
    with pytest.raises(ValueError, match="does not take a static cache.*default dynamic cache"):
        student.generate(ids_BT, max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static")
    with pytest.raises(ValueError, match="does not take a static cache"):
        student(ids_BT, cache=StaticCache(config=student.config, max_cache_len=32))
