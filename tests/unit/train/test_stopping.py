"""Stage ends: token budgets shorten a stage; patience stops it when validation stalls."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from distill.train.stages import (
    Stage,
    closed_loop,
    e2e_stage,
    e2e_top_k,
    plan_stages,
    sample_batch_config,
)
from distill.train.stopping import Patience, budget_steps, stop_reason, with_budget


def _student(**kw):
    base = {"steps_per_stage": 100, "micro_batch_size": 4, "grad_accum_steps": 2, "max_tokens_per_stage": None,
            "inputs": "teacher", "e2e": {"steps": 0, "top_k": 8}}
    return OmegaConf.create({**base, **kw})


def test_token_budget_sets_the_steps() -> None:
    assert budget_steps(_student(), world_size=2, seq_len=16) == 100
    # one step = 4 * 2 * 2 ranks * 16 tokens = 256 tokens
    assert budget_steps(_student(max_tokens_per_stage=2560), world_size=2, seq_len=16) == 10
    assert budget_steps(_student(max_tokens_per_stage=2561), world_size=2, seq_len=16) == 11
    assert budget_steps(_student(max_tokens_per_stage=10**9), world_size=2, seq_len=16) == 100
    short = with_budget(_student(max_tokens_per_stage=2560), 2, 16)
    assert short.steps_per_stage == 10 and stop_reason(_student(), short.steps_per_stage) == "budget"
    assert stop_reason(_student(), 100) == "steps"
    with pytest.raises(ValueError, match="max_tokens_per_stage"):
        budget_steps(_student(max_tokens_per_stage=0), 1, 16)


def test_patience_counts_validations_without_improvement() -> None:
    stopper = Patience(2, min_delta=0.01)
    assert [stopper.update(v) for v in (1.0, 0.5, 0.495, 0.4, 0.41, 0.399)] == [False] * 5 + [True]
    never = Patience(0)
    assert not any(never.update(1.0) for _ in range(10))
    with pytest.raises(ValueError, match="patience"):
        Patience(-1)


def test_closed_loop_stages_carry_the_embeddings_and_round_trip() -> None:
    stages = plan_stages(4, None, 2, closed_loop=True)
    assert [s.positions for s in stages] == [(0, 1, 2), (0, 2, 3, 4)]
    assert plan_stages(4, None, 2)[1].positions == (2, 3, 4)
    for stage in [*stages, e2e_stage(stages)]:
        assert Stage.from_model_cfg(stage.model_cfg) == stage
    assert e2e_stage(stages).kind == "e2e" and e2e_stage(stages).index == 2
    assert closed_loop(_student(inputs="mix")) and not closed_loop(_student())


def _cfg(family: str = "llama", **student) -> OmegaConf:
    teacher = {"name_or_path": None, "tiny": {"family": family}}
    return OmegaConf.create({"teacher": teacher, "student": _student(**student)})


def test_topk_room_only_when_the_e2e_stage_is_on_for_a_teacher_with_an_lm_head() -> None:
    on = {"e2e": {"steps": 5, "top_k": 8}}
    assert e2e_top_k(_cfg()) == 0 and e2e_top_k(_cfg(**on)) == 8
    assert e2e_top_k(_cfg("bert", **on)) == 0  # an encoder's end-to-end target is its final state
    names = [spec.name for spec in sample_batch_config(2, 16, 8, "float32", top_k=8).specs]
    assert names == ["input_ids", "hidden", "topk_logp", "topk_idx"]
    assert [spec.name for spec in sample_batch_config(2, 16, 8, "float32").specs] == ["input_ids", "hidden"]
