"""Automatic hybrids: which layers keep the teacher's own attention, chosen by measurement.

Converting every layer is rarely the best trade: some layers cost the output far more than
others when their attention is replaced. With ``student.hybrid.keep_softmax=K`` (or a target
quality, ``student.hybrid.max_gap``) a run first makes a short *scoring pass*: every candidate
layer (``student.layers``, null = all) gets a replacement trained teacher-forced for
``student.hybrid.steps`` steps, through the same pipeline and trainer as any layer stage
(stages of kind ``score``). The leader then scores each layer's conversion alone on the
held-out chunks (:func:`score_layers`):

- ``kl`` (default): KL(teacher || teacher with only that layer converted) of the final
  next-token distribution, the direct measure of how far that conversion moves the model's
  output (for an encoder: 1 - cosine of the final hidden state);
- ``spliced``: the report's spliced-alone metric (held-out perplexity, or cosine).

and, converting the layers cheapest first, the quality of the scoring-pass student with
n = 0..C layers converted (the curve the report plots). With ``keep_softmax=K`` the K
costliest layers stay the teacher's and the rest are converted; with ``max_gap=g`` as many
layers are converted as the curve keeps within a relative gap g of the teacher (at least
one). The layer stages (then the end-to-end stage) train the converted layers only, as
configured (closed loop, budgets, ...). The choice is kept in ``<checkpoint_dir>/hybrid.json``,
so a resumed run makes the same one, and goes to ``result.json`` and the report.

The scoring pass trains briefly and teacher-forced, so its curve is pessimistic: the
trained student (closed loop, longer stages, end-to-end) does better than the curve's
point for the same layers.

Shape legend: N chunks, T tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from tqdm.auto import tqdm

from distill.config import HybridConfig, HybridScore, Inputs, StudentConfig
from distill.model.evaluate import evaluate, metric_kind, score_student, spliced_alone_kl
from distill.stages import Stage, layer_stages, scoring_stages
from distill.train import checkpoint as ckpt
from distill.train.context import StudentContext, barrier, broadcast_ints
from distill.train.layer_stage import LayerTask
from distill.train.modules import load_stage_replacements
from distill.train.timing import timed
from distill.train.trainer import StageTrainer, train_stage

log = logging.getLogger(__name__)

HYBRID_FILE = "hybrid.json"
"""The scoring pass's scores and choice, in the checkpoint directory."""

MAX_CURVE_POINTS = 8
"""Most points of the quality curve measured when the choice does not read it (``keep_softmax``)."""


def scoring_config(student_cfg: StudentConfig) -> StudentConfig:
    """The student config of the scoring pass: short, teacher-forced, no early stop."""
    return dataclasses.replace(student_cfg, steps_per_stage=student_cfg.hybrid.steps, inputs=Inputs.teacher,
                               max_tokens_per_stage=None, patience=0, val_every_steps=0)


def run_hybrid(ctx: StudentContext, finished: set[int]) -> list[Stage]:
    """Train the scoring pass (unless a previous run chose already), choose, and return the
    layer stages of the converted layers (numbered after the scoring pass)."""
    scoring = scoring_stages(ctx.cfg, ctx.teacher.num_layers)
    choice = read_choice(ctx.checkpoint_dir) if ctx.cfg.resume else None
    if choice is None:
        ctx.stages = scoring  # what the scoring stages' trainers see as the run's stages
        for stage in scoring:
            if stage.index in finished:
                log.info("scoring stage %d (layers %s) already trained: skipping", stage.index, list(stage.layers))
                continue
            train_stage(StageTrainer(ctx, LayerTask(ctx, stage, scoring_config(ctx.cfg.student))))
        if ctx.leader:
            with timed(ctx.timings, "hybrid_choice_s"):
                choice = choose(score_layers(ctx, scoring), ctx.cfg.student.hybrid)
            ckpt.write_json_atomic(ctx.checkpoint_dir / HYBRID_FILE, choice)
        barrier(ctx)
    converted = broadcast_ints(list(choice["converted"]) if ctx.leader else [], ctx)
    if ctx.leader:
        log.info("automatic hybrid: converting layers %s, keeping layers %s as the teacher's (by %s)",
                 converted, choice["kept"], choice["score"])
    return layer_stages(ctx.cfg, ctx.teacher.num_layers, converted, first_index=scoring[-1].index + 1)


def read_choice(directory: Any) -> dict[str, Any] | None:
    """The choice a previous run of this checkpoint directory made, or None."""
    path = directory / HYBRID_FILE
    return json.loads(path.read_text()) if path.exists() else None


def score_layers(ctx: StudentContext, scoring: list[Stage]) -> dict[str, Any]:
    """Per-layer conversion scores of the scoring pass's replacements, and the quality curve
    over the number of layers converted, cheapest first (leader)."""
    teacher, heldout_NT = ctx.teacher, ctx.heldout_NT
    batch_size = ctx.cfg.student.micro_batch_size
    replacements = load_stage_replacements(ctx, scoring)
    alone = evaluate(teacher, replacements, heldout_NT, batch_size=batch_size)
    if alone.kind == "lm":
        kl = spliced_alone_kl(teacher, replacements, heldout_NT, batch_size)
    else:  # an encoder's output is its final hidden state
        kl = {layer: 1.0 - value for layer, value in alone.per_layer.items()}
    kind = ctx.cfg.student.hybrid.score
    reference = alone.per_layer_teacher if alone.per_layer_teacher is not None else alone.teacher  # same tokens
    cost = kl if kind == HybridScore.kl else {layer: _gap(value, reference, alone.kind)
                                              for layer, value in alone.per_layer.items()}
    order = sorted(replacements, key=lambda layer: (cost[layer], layer))
    points = curve_points(len(order), ctx.cfg.student.hybrid)
    # One student pass over the held-out chunks per point: on a deep teacher the longest part of
    # the choice, so it shows a bar.
    scored = {n: score_student(teacher, {layer: replacements[layer] for layer in order[:n]}, heldout_NT, batch_size)
              for n in tqdm(points, desc="hybrid curve (layers converted)", unit="point", leave=False,
                            dynamic_ncols=True)}
    curve = [alone.teacher] + [scored.get(n) for n in range(1, len(order) + 1)]
    return {"kind": metric_kind(teacher), "score": kind, "teacher": alone.teacher,
            "spliced_alone": {str(k): v for k, v in alone.per_layer.items()}, "spliced_teacher": reference,
            "kl": {str(k): v for k, v in kl.items()}, "cost": {str(k): v for k, v in cost.items()},
            "order": order, "curve": curve, "steps": ctx.cfg.student.hybrid.steps}


def curve_points(num_candidates: int, hybrid_cfg: HybridConfig) -> list[int]:
    """The numbers of converted layers (1..C) at which the curve is measured. ``max_gap``
    chooses from the curve: every point. ``keep_softmax`` only shows it (the report's table and
    plot): at most ``MAX_CURVE_POINTS``, spread over 1..C, the chosen count among them. On
    SmolLM2 (30 candidates) the full curve was most of the choice's 15 minutes."""
    if hybrid_cfg.max_gap is not None or num_candidates <= MAX_CURVE_POINTS:
        return list(range(1, num_candidates + 1))
    chosen = num_candidates - int(hybrid_cfg.keep_softmax or 0)
    step = (num_candidates - 1) / (MAX_CURVE_POINTS - 2)
    spread = {1 + round(i * step) for i in range(MAX_CURVE_POINTS - 1)}
    return sorted(spread | {chosen})


def choose(scores: dict[str, Any], hybrid_cfg: Any) -> dict[str, Any]:
    """Which layers to convert: all but the ``keep_softmax`` costliest, or the most (cheapest
    first, at least one) whose scoring-pass student stays within ``max_gap`` of the teacher."""
    order, curve = scores["order"], scores["curve"]
    if hybrid_cfg.keep_softmax is not None:
        count = len(order) - int(hybrid_cfg.keep_softmax)
    else:
        within = [n for n in range(1, len(order) + 1)
                  if abs(_gap(curve[n], scores["teacher"], scores["kind"])) <= hybrid_cfg.max_gap]
        count = max(within, default=1)
        if not within:
            log.warning("automatic hybrid: no layer converts within student.hybrid.max_gap=%s in the scoring "
                        "pass (the cheapest alone: %+.2f%%); converting only that one", hybrid_cfg.max_gap,
                        100 * _gap(curve[1], scores["teacher"], scores["kind"]))
    converted = sorted(order[:count])
    kept = sorted(order[count:])
    return {**scores, "converted": converted, "kept": kept, "keep_softmax": hybrid_cfg.keep_softmax,
            "max_gap": hybrid_cfg.max_gap}


def _gap(value: float, teacher: float, kind: str) -> float:
    """Relative cost of a score against the teacher's: perplexity up, or cosine down (both >= 0 when worse)."""
    return value / teacher - 1.0 if kind == "lm" else 1.0 - value / teacher
