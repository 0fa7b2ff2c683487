"""Stage ends: token budgets shorten a stage; patience stops it when validation stalls."""

from __future__ import annotations

import pytest

from distill.config import StudentConfig
from distill.train.stopping import Patience, budget_steps, stop_reason, with_budget
from tests.unit.test_config import schema


def _student(**kw):
    base = {"steps_per_stage": 100, "micro_batch_size": 4, "grad_accum_steps": 2, "max_tokens_per_stage": None,
            "inputs": "teacher", "e2e": {"steps": 0, "top_k": 8}}
    return schema(StudentConfig, **{**base, **kw})


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
