"""distill.model.evaluate against plain references: the HF forward and `perplexity`.

The cached, shared computation in `evaluate` must give what running each stack from
scratch gives. Held-out text for the LM is *sampled from the teacher*, so the teacher
is the best possible model of it (Gibbs' inequality) and any perturbed student must
score a higher perplexity, even though the tiny teacher itself is untrained.

Shape legend: N chunks, B batch, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from distill.model.assemble import splice
from distill.model.evaluate import (
    EvalResult,
    evaluate,
    per_layer_batches,
    perplexity,
    spliced_alone_kl,
)
from distill.model.teacher import Teacher
from distill.replacements.mlp import ResidualMLP
from distill.replacements.teacher_copy import TeacherCopy
from tests.tiny_teachers import family_model, tiny_bert, tiny_llama

N, T, VOCAB, NUM_LAYERS = 6, 12, 64, 3


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads; on a shared CPU they get much slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def llama() -> Teacher:
    return tiny_llama(VOCAB, NUM_LAYERS)


@pytest.fixture(scope="module")
def bert() -> Teacher:
    return tiny_bert(VOCAB, NUM_LAYERS)


@pytest.fixture(scope="module")
def sampled_NT(llama: Teacher) -> torch.Tensor:
    """Chunks sampled from the teacher at temperature 1, starting from random tokens."""
    gen = torch.Generator().manual_seed(0)
    ids_NT = torch.randint(0, VOCAB, (N, 1), generator=gen)
    with torch.no_grad():
        for _ in range(T - 1):
            probs_NV = llama.model(ids_NT).logits[:, -1].softmax(-1)
            ids_NT = torch.cat([ids_NT, torch.multinomial(probs_NV, 1, generator=gen)], dim=1)
    return ids_NT


def _reference_ppl(model: torch.nn.Module, ids_NT: torch.Tensor) -> float:
    """exp(mean next-token NLL) of the HF model's own forward, one chunk at a time."""
    with torch.no_grad():
        logits_NTV = model(ids_NT).logits
    nll = F.cross_entropy(logits_NTV[:, :-1].flatten(0, 1), ids_NT[:, 1:].flatten())
    return math.exp(nll.item())


def _copies(teacher: Teacher, idxs: list[int]) -> dict[int, torch.nn.Module]:
    return {idx: TeacherCopy(teacher, idx) for idx in idxs}


def test_perplexity_matches_hf_forward(llama: Teacher, sampled_NT: torch.Tensor) -> None:
    got = perplexity(llama, list(llama.layers), sampled_NT, batch_size=4)
    assert got == pytest.approx(_reference_ppl(llama.model, sampled_NT), rel=1e-5)


def test_copy_student_scores_as_teacher(llama: Teacher, sampled_NT: torch.Tensor) -> None:
    result = evaluate(llama, _copies(llama, [0, 2]), sampled_NT, batch_size=4)
    assert result.kind == "lm"
    assert result.teacher == pytest.approx(_reference_ppl(llama.model, sampled_NT), rel=1e-5)
    assert result.student == pytest.approx(result.teacher, rel=1e-5)
    assert set(result.per_layer) == {0, 2}
    assert all(v == pytest.approx(result.teacher, rel=1e-5) for v in result.per_layer.values())
    assert result.num_tokens == N * (T - 1)


def test_untrained_mlp_student_is_worse(llama: Teacher, sampled_NT: torch.Tensor) -> None:
    """Shared-cache results equal `perplexity` run from scratch on the same stacks."""
    replacements = {idx: ResidualMLP(llama, idx, hidden_mult=1.0) for idx in (0, 1)}
    result = evaluate(llama, replacements, sampled_NT, batch_size=4)
    assert result.student > result.teacher
    assert all(value > result.teacher for value in result.per_layer.values())
    student_layers = [replacements.get(idx, layer) for idx, layer in enumerate(llama.layers)]
    assert result.student == pytest.approx(
        perplexity(llama, student_layers, sampled_NT, 4), rel=1e-5
    )
    alone_1 = [llama.layers[0], replacements[1], llama.layers[2]]
    assert result.per_layer[1] == pytest.approx(perplexity(llama, alone_1, sampled_NT, 4), rel=1e-5)


def test_max_chunks_and_no_replacements(llama: Teacher, sampled_NT: torch.Tensor) -> None:
    result = evaluate(llama, {}, sampled_NT, batch_size=4, max_chunks=2)
    assert result.num_tokens == 2 * (T - 1)
    assert result.student == result.teacher and result.per_layer == {}


def test_replacements_keep_their_training_mode(llama: Teacher, sampled_NT: torch.Tensor) -> None:
    mlp = ResidualMLP(llama, 1).train()
    evaluate(llama, {1: mlp}, sampled_NT, max_chunks=1)
    assert mlp.training and not llama.model.training


def test_encoder_cosine(bert: Teacher) -> None:
    ids_NT = torch.randint(0, VOCAB, (N, T), generator=torch.Generator().manual_seed(2))
    result = evaluate(bert, _copies(bert, [1]), ids_NT, batch_size=4)
    assert result.kind == "encoder" and result.num_tokens == N * T
    assert result.teacher == pytest.approx(1.0, abs=1e-6)
    assert result.student == pytest.approx(1.0, abs=1e-5)
    assert result.per_layer[1] == pytest.approx(1.0, abs=1e-5)
    mlp_result = evaluate(bert, {1: ResidualMLP(bert, 1)}, ids_NT, batch_size=4)
    assert mlp_result.student < 0.999


def test_eval_result_dict_round_trip() -> None:
    result = EvalResult(kind="lm", teacher=10.0, student=12.0, per_layer={0: 11.0}, num_tokens=5)
    import json

    assert EvalResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert result.relative_gap == pytest.approx(0.2)


def test_empty_heldout_is_a_clear_error(llama: Teacher) -> None:
    with pytest.raises(ValueError, match="heldout"):
        evaluate(llama, {}, torch.empty(0, T, dtype=torch.int64))


def test_spliced_alone_kl_is_the_kl_of_the_spliced_models_output(llama: Teacher, sampled_NT: torch.Tensor) -> None:
    torch.manual_seed(0)
    replacements = {idx: ResidualMLP(llama, idx, output_init_std=0.05).float() for idx in (0, 2)}
    got = spliced_alone_kl(llama, {**replacements, 1: TeacherCopy(llama, 1)}, sampled_NT, batch_size=4)
    with torch.no_grad():
        logp_NTV = llama.model(sampled_NT).logits.log_softmax(-1)
        for idx, replacement in replacements.items():
            model = splice(llama, {idx: replacement})
            logq_NTV = model(sampled_NT, use_cache=False).logits.log_softmax(-1)
            want = float((logp_NTV.exp() * (logp_NTV - logq_NTV)).sum(-1).mean())
            assert got[idx] == pytest.approx(want, rel=1e-4)
    assert got[0] > 1e-4 and abs(got[1]) < 1e-6  # a copy of the layer moves nothing
@pytest.mark.parametrize("kind", ["copy", "linear_attention"])
def test_bf16_teacher_scores_float32_replacements(kind: str, sampled_NT: torch.Tensor) -> None:
    """A bfloat16 teacher with float32 replacements (how every real run trains): the stream
    stays bfloat16, each replacement computes in float32 (rotary and mask from the teacher's
    run_layer for copies); a copy of each layer scores as the teacher up to bfloat16 rounding."""
    from distill.replacements.linear_attention import LinearAttentionLayer

    teacher = Teacher(tiny_llama(VOCAB, NUM_LAYERS).model.to(torch.bfloat16))
    build = TeacherCopy if kind == "copy" else LinearAttentionLayer
    replacements = {idx: build(teacher, idx).float() for idx in (0, 2)}
    result = evaluate(teacher, replacements, sampled_NT, batch_size=4)
    assert math.isfinite(result.student) and set(result.per_layer) == {0, 2}
    if kind == "copy":
        assert result.student == pytest.approx(result.teacher, rel=0.02)


def test_a_deep_students_spliced_alone_scores_are_bounded_to_the_cost_of_the_rest() -> None:
    """Splicing each of 30 layers alone costs ~15x the teacher and student passes: scored on as many
    batches as cost that much, never fewer than one; a shallow student scores them on every batch."""
    assert per_layer_batches(10, 4, [0, 1, 2, 3]) == 10
    assert per_layer_batches(100, 30, list(range(30))) == 20  # (30 + 60) / 465 of 100, rounded up
    assert per_layer_batches(3, 80, list(range(80))) == 1
    assert per_layer_batches(7, 30, []) == 7


def test_spliced_alone_scores_on_fewer_tokens_are_those_of_the_first_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    teacher = Teacher(family_model("llama", num_layers=8))
    replacements = {idx: ResidualMLP(teacher, idx, hidden_mult=1.0) for idx in range(8)}
    heldout_NT = torch.randint(3, 90, (8, 12), generator=torch.Generator().manual_seed(3))
    result = evaluate(teacher, replacements, heldout_NT, batch_size=2)
    alone_batches = per_layer_batches(4, 8, list(range(8)))
    assert alone_batches < 4 and result.per_layer_tokens == alone_batches * 2 * 11
    monkeypatch.setattr("distill.model.evaluate.per_layer_batches", lambda num_batches, *_: num_batches)
    first = evaluate(teacher, replacements, heldout_NT[: 2 * alone_batches], batch_size=2)  # all of them
    assert result.per_layer == pytest.approx(first.per_layer, rel=1e-6)
    # what they compare to: the teacher on the same tokens, not on the whole held-out set
    assert result.per_layer_teacher == pytest.approx(first.teacher, rel=1e-6) and first.per_layer_teacher is None
    assert result.per_layer_teacher != pytest.approx(result.teacher, rel=1e-3)
    assert EvalResult.from_dict(result.to_dict()) == result
