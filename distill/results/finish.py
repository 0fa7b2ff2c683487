"""After the last stage (leader only): assemble, export, evaluate and write the results.

The trained replacements come back from their stage files (or, after an end-to-end
stage, the whole trained student); the student is exported as a model directory,
scored against the teacher on the held-out chunks, and (causal LMs) loaded back from that
directory and timed against the teacher at decoding with a long context; the run's answer
is written: ``report.md`` (with ``losses.png``), ``result.json`` and the student's model card.
"""

from __future__ import annotations

import logging
import os

import torch
from hydra.core.hydra_config import HydraConfig
from torch import nn

from distill.config import Config, plain
from distill.model.assemble import export_student, load_student
from distill.model.assist import assist_figures
from distill.model.continuations import continuations
from distill.model.decode import measure_decode
from distill.model.evaluate import EvalResult, evaluate, metric_kind, score_student
from distill.model.sources import load_tokenizer
from distill.model.teacher import Teacher
from distill.replacements import describe
from distill.results.card import write_model_card
from distill.results.record import RunRecord, write_result
from distill.results.report import read_metrics, write_report
from distill.stages import hybrid_on
from distill.train.checkpoint import replacement_option
from distill.train.context import METRICS_FILE, StudentContext
from distill.train.e2e import e2e_finished, load_e2e_student
from distill.train.hybrid import read_choice
from distill.train.modules import load_stage_replacements
from distill.train.timing import timed

log = logging.getLogger(__name__)

DECODE_CONTEXT = 8192
"""Context at which the report compares decoding: long enough that a KV cache dominates."""
DECODE_STEPS = 16
ASSIST_PROMPTS, ASSIST_PROMPT_TOKENS, ASSIST_NEW_TOKENS = 2, 64, 32
"""Assisted decoding in the report: the first tokens of this many held-out chunks, this many new
tokens each (seconds on a CPU for a 30-layer teacher)."""


def finish_run(ctx: StudentContext) -> None:
    """Rebuild every trained replacement from its stage file, export, evaluate, report."""
    cfg, teacher = ctx.cfg, ctx.teacher
    with timed(ctx.timings, "export_s"):
        replacements = load_stage_replacements(ctx, ctx.stages)
        cfgs = {layer: plain(cfg.replacement) for layer in replacements}
        base, final = teacher, replacements
        if e2e_finished(ctx):
            base, final = load_e2e_student(ctx)
        tokenizer = load_tokenizer(ctx.teacher_source)
        out = export_student(base, ctx.teacher_source, final, cfgs, str(ctx.out_dir / "student"),
                             tokenizer=tokenizer, dtype=teacher.dtype)
        log.info("student exported to %s  (load it: from distill import load_student; "
                 "model = load_student(%r))", out, out)
    rows = {layer: describe(module, teacher, cfg.data.seq_len) for layer, module in replacements.items()}
    summary = {**chosen_options(cfg, ctx.teacher_source), "layers": sorted(replacements), "steps_per_stage": cfg.student.steps_per_stage,
               "schedule": cfg.student.schedule, "layers_per_stage": cfg.student.layers_per_stage,
               "world_size": ctx.world_size,
               "inputs": cfg.student.inputs, "e2e_steps": cfg.student.e2e.steps}
    hybrid = read_choice(ctx.checkpoint_dir) if hybrid_on(cfg.student) else None
    if hybrid is not None:
        summary["kept_layers"] = hybrid["kept"]
    result = None
    if cfg.evaluate and len(ctx.heldout_NT):
        with timed(ctx.timings, "evaluate_s"):
            result = evaluate(teacher, replacements, ctx.heldout_NT, batch_size=cfg.student.micro_batch_size)
            if final is not replacements:  # the exported student had an end-to-end stage
                summary["student_after_layer_stages"] = result.student
                if same_student(teacher, replacements, base, final):  # it kept its step-0 weights
                    result.per_layer_layer_stages = dict(result.per_layer)
                else:
                    result = _rescored_after_e2e(ctx, result, base, final)
        log.info("held-out %s: teacher %.4f, student %.4f", result.kind, result.teacher, result.student)
    decode = None
    if cfg.evaluate and metric_kind(teacher) == "lm":
        student_model = load_student(out, device=str(teacher.device))
        with timed(ctx.timings, "decode_s"):
            decode = decode_figures(teacher.model, student_model)
        if len(ctx.heldout_NT):
            with timed(ctx.timings, "assist_s"):
                decode["assisted"] = assisted_figures(teacher.model, student_model, ctx.heldout_NT)
        with timed(ctx.timings, "decode_s"):
            decode["continuations"] = continuations(teacher.model, student_model, tokenizer)
    metrics = _run_metrics(str(ctx.out_dir / METRICS_FILE))
    summary["train_tokens"] = sum(int(r.get("tokens", 0)) for r in metrics if r.get("event") == "stage_end")
    summary.update(restored_stages(metrics, [list(s.layers) for s in ctx.stages if s.kind == "layers"],
                                   ctx.checkpoint_dir))
    record = RunRecord(summary=summary, layers=rows, layer_cfgs=cfgs, num_layers=teacher.num_layers,
                       causal=teacher.causal and metric_kind(teacher) == "lm",
                       data=plain(cfg.data, enums_as_str=True),
                       eval=result.to_dict() if result else None, decode=decode, timings=ctx.timings,
                       final_val=_final_val(metrics), hybrid=hybrid)
    report = render_run(record, str(ctx.out_dir), out, metrics)
    ctx.log_metrics(eval_record(result, decode, ctx.timings))  # after the report read metrics.jsonl
    log.info("report written to %s", report)


def render_run(record: RunRecord, run_dir: str, student_dir: str, metrics: list[dict]) -> str:
    """``report.md`` (with ``losses.png``, from ``metrics`` too), ``result.json`` and the
    student's model card, all from ``record``; returns the report's path."""
    report = write_report(run_dir, metrics, record.eval or {}, record.layers, record.summary, record.timings,
                          hybrid=record.hybrid, decode=record.decode)
    write_result(run_dir, record.result_json())
    write_model_card(student_dir, record.card_facts())
    return report


SUPERVISOR_KEYS = ("hydra.", "mode=", "run_id=", "pipeline.socket_dir=", "pipeline.broker_pid=",
                   "device.student_gpus=")
"""Overrides ``mode=local`` adds to its children's command lines: not what the user typed."""


def chosen_options(cfg: Config, source: str) -> dict[str, str]:
    """What the user typed: the command's overrides and the option picked in each group
    (``teacher=tiny_llama``, ``replacement=linear_attention``), not the class paths and cache
    directories they became; the teacher's source (a directory or hub name) as its own key."""
    options = {"teacher": source, "replacement": replacement_option(cfg)}
    command = "python -m distill"
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        choices = hydra_cfg.runtime.choices
        options.update({group: str(choices[group]) for group in ("teacher", "replacement", "data")
                        if choices.get(group)})
        typed = [o for o in hydra_cfg.overrides.task if not o.startswith(SUPERVISOR_KEYS)]
        command = " ".join([command, *typed])
    return {"command": command, **options, "teacher_source": source}


def restored_stages(metrics: list[dict], stages: list[list[int]], checkpoint_dir: object) -> dict:
    """The layers whose stage this run did not train (no ``stage_end`` in its metrics: it came finished
    from the checkpoint directory, maybe another run's), with that directory; {} when it trained all."""
    trained = {tuple(m.get("layers") or []) for m in metrics
               if m.get("event") == "stage_end" and m.get("kind") != "score"}
    restored = sorted(layer for layers in stages if layers and tuple(layers) not in trained for layer in layers)
    return {"restored_layers": restored, "checkpoint_dir": str(checkpoint_dir)} if restored else {}


def decode_figures(teacher_model, student_model, context: int = DECODE_CONTEXT) -> dict:
    """Teacher and student decoding at ``context`` tokens (batch 1), side by side: ms/token and
    cache bytes, with the ratios (teacher / student)."""
    teacher_speed = measure_decode(teacher_model, context, batch=1, steps=DECODE_STEPS)
    student_speed = measure_decode(student_model, context, batch=1, steps=DECODE_STEPS)
    log.info("decoding at %d tokens: teacher %.2f ms/token (%d cache bytes), student %.2f ms/token (%d)",
             context, teacher_speed.ms_per_token, teacher_speed.cache_bytes, student_speed.ms_per_token,
             student_speed.cache_bytes)
    return {"teacher": teacher_speed.to_dict(), "student": student_speed.to_dict(), "steps": DECODE_STEPS,
            "speedup": teacher_speed.ms_per_token / student_speed.ms_per_token,
            "cache_ratio": teacher_speed.cache_bytes / max(student_speed.cache_bytes, 1)}


def assisted_figures(teacher_model, student_model, heldout_NT: torch.Tensor) -> dict:
    """The teacher generating greedily alone and with the exported student drafting
    (``distill.model.assist``), on the first tokens of a few held-out chunks."""
    length = min(ASSIST_PROMPT_TOKENS, heldout_NT.shape[1])
    device = next(teacher_model.parameters()).device
    prompts = [heldout_NT[idx : idx + 1, :length].to(device) for idx in range(min(ASSIST_PROMPTS, len(heldout_NT)))]
    figures = assist_figures(teacher_model, student_model, prompts, ASSIST_NEW_TOKENS)
    log.info("assisted decoding (%d prompts of %d tokens, %d new each): teacher alone %.2f ms/token, with the "
             "student drafting %.2f (%.2fx), %d of %d drafted tokens accepted, same tokens on %d of %d prompts",
             len(prompts), length, ASSIST_NEW_TOKENS, figures["alone_ms_per_token"], figures["assisted_ms_per_token"],
             figures["speedup"], figures["accepted"], figures["drafted"], figures["same"], len(prompts))
    return {**figures, "prompt_tokens": length}


def same_student(teacher: Teacher, replacements: dict[int, nn.Module], base: Teacher,
                 final: dict[int, nn.Module]) -> bool:
    """Whether the end-to-end stage's student is the layer stages' one, weight for weight (it
    rolled back to its step-0 weights): then scoring it again would spend minutes on a real
    teacher to print the same figures."""
    if base is not teacher or set(final) != set(replacements):
        return False
    for idx, module in replacements.items():
        mine, theirs = module.state_dict(), final[idx].state_dict()
        if mine.keys() != theirs.keys() or not all(torch.equal(mine[k], theirs[k]) for k in mine):
            return False
    return True


def _rescored_after_e2e(ctx: StudentContext, layer_stages: EvalResult, base: Teacher,
                        final: dict[int, nn.Module]) -> EvalResult:
    """The exported (end-to-end-trained) student's scores: each of its replacements spliced
    alone into the teacher, and the whole student on ``base`` (the teacher, or with
    ``student.e2e.trainable=all`` the copy carrying its trained teacher-side weights); the
    layer stages' per-layer scores are kept beside them."""
    batch_size = ctx.cfg.student.micro_batch_size
    result = evaluate(ctx.teacher, final, ctx.heldout_NT, batch_size=batch_size)
    if base is not ctx.teacher:
        result.student = score_student(base, final, ctx.heldout_NT, batch_size)
    result.per_layer_layer_stages = layer_stages.per_layer
    return result


def eval_record(result: EvalResult | None, decode: dict | None, timings: dict[str, float]) -> dict:
    """The run's final figures as a metrics.jsonl event (``eval``, of no stage), so the experiment
    tracker gets them too: the held-out scores, decoding, and the time per phase."""
    return {"event": "eval", **(result.to_dict() if result else {}), "decode": decode or {},
            "timings": dict(timings)}


def _run_metrics(path: str) -> list[dict]:
    """This run's metrics; none when every stage came finished from its checkpoint (a
    rerun of a completed command trains nothing, so it logs no step)."""
    if not os.path.exists(path):
        log.info("no stage was trained in this run (all restored from checkpoints): the report has "
                 "no training curves; they are in the run that trained them")
        return []
    return read_metrics(path)


def _final_val(metrics: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for record in metrics:
        if record.get("event") == "stage_end" and record.get("kind") != "score":
            out.update(record.get("val", {}))
    return out
