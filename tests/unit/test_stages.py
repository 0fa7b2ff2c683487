"""Stages and the sample layout: which layers train together, what a slot holds, and the one
function (stage_layout) that checks, workers and students all derive them from."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from distill.config import Config, StudentConfig
from distill.stages import (
    Stage,
    closed_loop,
    e2e_stage,
    e2e_top_k,
    layer_stages,
    plan_stages,
    sample_batch_config,
    stage_layout,
)
from tests.unit.test_config import _config, schema


def _student_tree() -> dict:
    return {"steps_per_stage": 100, "micro_batch_size": 4, "grad_accum_steps": 2, "max_tokens_per_stage": None,
            "inputs": "teacher", "e2e": {"steps": 0, "top_k": 8}}


def _student(**kw):
    base = {"steps_per_stage": 100, "micro_batch_size": 4, "grad_accum_steps": 2, "max_tokens_per_stage": None,
            "inputs": "teacher", "e2e": {"steps": 0, "top_k": 8}}
    return schema(StudentConfig, **{**base, **kw})


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
    return schema(Config, mode="local", replacement={}, teacher=teacher,
                  student={**_student_tree(), **student})


def test_topk_room_only_when_the_e2e_stage_is_on_for_a_teacher_with_an_lm_head() -> None:
    on = {"e2e": {"steps": 5, "top_k": 8}}
    assert e2e_top_k(_cfg()) == 0 and e2e_top_k(_cfg(**on)) == 8
    assert e2e_top_k(_cfg("bert", **on)) == 0  # an encoder's end-to-end target is its final state
    names = [spec.name for spec in sample_batch_config(2, 16, 8, "float32", top_k=8).specs]
    assert names == ["input_ids", "hidden", "topk_logp", "topk_idx"]
    assert [spec.name for spec in sample_batch_config(2, 16, 8, "float32").specs] == ["input_ids", "hidden"]


def test_stages_group_the_chosen_layers_and_refuse_bad_ones() -> None:
    assert [s.layers for s in plan_stages(5, [4, 0, 2, 2], 2)] == [(0, 2), (4,)]
    assert [s.index for s in plan_stages(3, None, 1)] == [0, 1, 2]
    with pytest.raises(ValueError, match="student.layers"):
        plan_stages(4, [0, 7], 1)
    with pytest.raises(ValueError, match="student.layers_per_stage"):
        plan_stages(4, None, 0)
    with pytest.raises(ValueError, match="student.layers is empty"):
        plan_stages(4, [], 1)


def test_the_layout_of_a_run_is_the_widest_stage_and_follows_the_config() -> None:
    cfg = _config(["student.layers_per_stage=2", "student.inputs=mix", "student.e2e.steps=3", "student.e2e.top_k=4",
                    "data.seq_len=16", "teacher.dtype=bfloat16"])
    stages, batch_config = stage_layout(cfg, num_layers=5, hidden_size=8)
    assert [s.layers for s in stages] == [(0, 1), (2, 3), (4,)] and all(s.closed_loop for s in stages)
    shapes = {spec.name: (tuple(spec.shape), spec.dtype) for spec in batch_config.specs}
    assert shapes["hidden"] == ((4, 16, 8), "bfloat16")  # positions 0, 2, 3, 4 of the second stage
    assert shapes["topk_logp"] == ((16, 4), "float32") and shapes["topk_idx"] == ((16, 4), "int64")


def test_a_hybrid_run_starts_with_its_scoring_pass_in_a_layout_for_any_choice() -> None:
    cfg = _config(["student.hybrid.keep_softmax=1", "student.layers_per_stage=2", "student.inputs=student",
                    "data.seq_len=16"])
    stages, batch_config = stage_layout(cfg, num_layers=6, hidden_size=8)
    assert [(s.layers, s.kind, s.closed_loop) for s in stages] == [((0, 1), "score", False), ((2, 3), "score", False),
                                                                   ((4, 5), "score", False)]
    # any two converted layers, not adjacent, in closed loop: 2 inputs + 2 outputs + the embeddings
    (hidden,) = [spec.shape for spec in batch_config.specs if spec.name == "hidden"]
    assert tuple(hidden) == (5, 16, 8)
    assert max(len(s.positions) for s in layer_stages(cfg, 6, [1, 3, 5], first_index=3)) <= 5
    assert [s.index for s in layer_stages(cfg, 6, [1, 3, 5], first_index=3)] == [3, 4]
