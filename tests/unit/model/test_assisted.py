"""The exported student in assisted (speculative) decoding, either side of it.

Assisted decoding drafts several tokens, verifies them in one forward and crops the cache back
past the rejected ones: a recurrent layer must then hold the state of the last accepted token.
For every replacement kind and a mixed student, of a Llama and of a Mistral teacher (sliding
window shorter than the texts): the student drafting for its teacher, the teacher drafting for
the student, and prompt lookup on the student must give exactly the tokens of plain greedy
decoding of the target model. A draft of random weights is rejected often, which is what
exercises the rollback; a cache cropped further back than it recorded is refused, not guessed.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from distill.model.assemble import export_student, load_student
from distill.model.teacher import Teacher
from distill.replacements.gated_delta_rule import GatedDeltaRuleLayer
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from tests.students import nudged, single_thread  # noqa: F401  (single_thread: an autouse fixture)

VOCAB, NEW = 64, 16
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "initializer_range": 0.2}
KINDS = {
    "linear_attention": (LinearAttentionLayer, {"chunk_size": 4}),
    "sliding_window_linear": (SlidingWindowLinearLayer, {"chunk_size": 4, "window": 3}),
    "gated_linear_attention": (GatedLinearAttentionLayer, {"chunk_size": 4, "gate_init": 0.9}),
    "gated_delta_rule": (GatedDeltaRuleLayer, {"chunk_size": 4, "gate_init": 0.9, "beta_init": 0.5}),
    "mlp": (ResidualMLP, {"hidden_mult": 1.0}),
    "pruned": (PrunedLayer, {"mlp_keep_fraction": 0.5}),
}
CFG = {"_target_": "recorded.only", "_partial_": True}


def _teacher(family: str) -> Teacher:
    torch.manual_seed(0)
    if family == "llama":
        return Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, pad_token_id=0)))
    return Teacher(MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=4, sliding_window=4, pad_token_id=0)))


def _student(teacher: Teacher, kind: str, tmp_path: Path) -> torch.nn.Module:
    """``kind`` at layers 1 and 2 (mixed: linear attention, a kept teacher layer, sliding window)."""
    if kind == "mixed":
        built = {0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                 2: SlidingWindowLinearLayer(teacher, 2, window=3, chunk_size=4)}
    else:
        cls, options = KINDS[kind]
        built = {idx: cls(teacher, idx, **options) for idx in (1, 2)}
    nudged(built, 0.3)  # far enough from the teacher to reject drafts
    out = tmp_path / f"{teacher.family}-{kind}"
    export_student(teacher, "tiny", built, dict.fromkeys(built, CFG), str(out))
    return load_student(str(out))


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed))


def _greedy(model: torch.nn.Module, ids_BT: torch.Tensor, **options: object) -> torch.Tensor:
    return model.generate(ids_BT, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **options)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def teacher(request: pytest.FixtureRequest) -> Teacher:
    return _teacher(request.param)


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_assisted_decoding_gives_the_targets_greedy_tokens(teacher: Teacher, kind: str, tmp_path: Path) -> None:
    student = _student(teacher, kind, tmp_path)
    for seed in (1, 2):
        ids_BT = _prompt(seed)
        student_alone, teacher_alone = _greedy(student, ids_BT), _greedy(teacher.model, ids_BT)
        assert torch.equal(_greedy(teacher.model, ids_BT, assistant_model=student), teacher_alone)
        assert torch.equal(_greedy(student, ids_BT, assistant_model=teacher.model), student_alone)
        assert torch.equal(_greedy(student, ids_BT, prompt_lookup_num_tokens=3), student_alone)
        assert not torch.equal(student_alone, teacher_alone)  # the drafts were rejected somewhere


def test_crop_restores_the_state_of_an_earlier_position(tmp_path: Path) -> None:
    """Forward 5 tokens while recording, crop 3: the next token's logits equal those of a cache
    that only ever saw the first 2 (the verification forward of assisted decoding)."""
    student = _student(_teacher("llama"), "mixed", tmp_path)
    ids_BT = _prompt(3)
    prompt_BT, draft_BT, nxt_BT = ids_BT[:, :4], ids_BT[:, 4:9], ids_BT[:, 6:7]
    recorded = DynamicCache(config=student.config)
    with torch.no_grad():
        student(prompt_BT, cache=recorded)
        recorded.activate_past_recording(recurrent_states_to_keep=5)
        student(draft_BT, cache=recorded)
        recorded.crop(-3)
        assert recorded.get_seq_length() == 6
        got_BV = student(nxt_BT, cache=recorded).logits[:, -1]
        plain = DynamicCache(config=student.config)
        student(ids_BT[:, :6], cache=plain)
        want_BV = student(nxt_BT, cache=plain).logits[:, -1]
    torch.testing.assert_close(got_BV, want_BV, rtol=0, atol=1e-5)


def test_a_crop_past_what_was_recorded_is_refused(tmp_path: Path) -> None:
    student = _student(_teacher("llama"), "linear_attention", tmp_path)
    cache = DynamicCache(config=student.config)
    with torch.no_grad():
        student(_prompt(4)[:, :3], cache=cache)
        cache.activate_past_recording(recurrent_states_to_keep=2)
        student(_prompt(4)[:, 3:8], cache=cache)
    with pytest.raises(RuntimeError, match="cannot roll this recurrent layer back 4 positions"):
        cache.crop(-4)
