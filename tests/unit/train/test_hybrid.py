"""Automatic hybrids: the choice from the scores, and a run that scores every layer, then
trains only the ones it converts (a real broker and teacher worker, threads of this process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distill.train import checkpoint as ckpt
from distill.train import hybrid
from distill.train.hybrid import HYBRID_FILE, choose
from distill.train.run import train_all
from tests.tiny_teachers import tiny_llama
from tests.unit.train.test_trainer import _cfg, _context, _events, pipeline_for  # noqa: F401 (fixture)

VOCAB = 96


def _scores(kind: str = "lm") -> dict:
    return {"kind": kind, "teacher": 10.0, "order": [2, 0, 3, 1], "curve": [10.0, 10.1, 10.15, 10.4, 11.0]}


@pytest.mark.parametrize(("budget", "converted", "kept"), [
    ({"keep_softmax": 1, "max_gap": None}, [0, 2, 3], [1]),
    ({"keep_softmax": 0, "max_gap": None}, [0, 1, 2, 3], []),
    ({"keep_softmax": None, "max_gap": 0.02}, [0, 2], [1, 3]),  # 10.15 is within 2%, 10.4 is not
    ({"keep_softmax": None, "max_gap": 0.001}, [2], [0, 1, 3]),  # none within: the cheapest alone
])
def test_choice_keeps_the_costliest_layers_or_meets_the_target(budget: dict, converted: list[int],
                                                               kept: list[int]) -> None:
    choice = choose(_scores(), OmegaConf.create(budget))
    assert (choice["converted"], choice["kept"]) == (converted, kept)


def test_an_encoder_target_is_a_cosine_drop() -> None:
    scores = {**_scores("encoder"), "teacher": 1.0, "curve": [1.0, 0.995, 0.992, 0.97, 0.9]}
    assert choose(scores, OmegaConf.create({"keep_softmax": None, "max_gap": 0.01}))["converted"] == [0, 2]


def test_a_hybrid_run_scores_every_layer_then_trains_only_those_it_converts(
        tmp_path: Path, pipeline_for, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    cfg = _cfg(tmp_path, "student.hybrid.keep_softmax=1", "student.hybrid.steps=3", "student.steps_per_stage=4",
               "student.inputs=student")
    teacher = tiny_llama(VOCAB, 3)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    try:
        assert [(s.index, s.kind) for s in ctx.stages] == [(0, "score"), (1, "score"), (2, "score")]
        train_all(ctx)
        choice = json.loads((ctx.checkpoint_dir / HYBRID_FILE).read_text())
        layer_stages = [(s.index, s.layers, s.closed_loop) for s in ctx.stages]
        monkeypatch.setattr(hybrid, "score_layers", lambda *_: pytest.fail("a rerun scored the layers again"))
        train_all(ctx)  # a rerun: nothing left to train, the choice read back
        assert [(s.index, s.layers, s.closed_loop) for s in ctx.stages] == layer_stages
    finally:
        ctx.client.close()
    costs = {int(k): v for k, v in choice["kl"].items()}
    assert sorted(costs) == [0, 1, 2] and all(v > 0 for v in costs.values())
    assert choice["order"] == sorted(costs, key=costs.get)
    assert choice["kept"] == [choice["order"][-1]] and choice["converted"] == sorted(choice["order"][:2])
    assert len(choice["curve"]) == 4 and choice["curve"][0] == choice["teacher"]
    assert layer_stages == [(3, (choice["converted"][0],), True), (4, (choice["converted"][1],), True)]
    ends = _events(ctx.out_dir, "stage_end")
    assert [(e["stage"], e["kind"], e["steps"]) for e in ends] == [
        (0, "score", 3), (1, "score", 3), (2, "score", 3), (3, "layers", 4), (4, "layers", 4)]
    assert ckpt.read_progress(ctx.checkpoint_dir)["finished"] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("budget", "candidates", "points"), [
    ({"keep_softmax": 4, "max_gap": None}, 30, [1, 6, 11, 15, 20, 25, 26, 30]),  # the chosen 26 among them
    ({"keep_softmax": 2, "max_gap": None}, 5, [1, 2, 3, 4, 5]),  # a short curve is measured whole
    ({"keep_softmax": None, "max_gap": 0.02}, 30, list(range(1, 31))),  # the choice reads every point
])
def test_the_curve_is_measured_whole_only_where_the_choice_reads_it(budget: dict, candidates: int,
                                                                    points: list[int]) -> None:
    assert hybrid.curve_points(candidates, OmegaConf.create(budget)) == points
