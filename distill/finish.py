"""After the last stage (leader only): assemble, export, evaluate and report.

Also names a run's checkpoint directory by what shapes its result, so that
rerunning the same command finds and resumes the same checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from distill import checkpoint as ckpt
from distill.timing import timed

if TYPE_CHECKING:
    from distill.student import StudentContext

log = logging.getLogger(__name__)

FINGERPRINT_KEYS = ("teacher", "replacement", "data", "student")
UNFINGERPRINTED_STUDENT_KEYS = ("loader_workers", "prefetch_batches", "log_every_steps", "checkpoint_every_steps")
"""How batches are fetched and how often progress is logged or saved: changing them
must resume a run, not start a new one (they do not decide the trained weights)."""


def config_fingerprint(cfg: DictConfig, teacher_source: str) -> str:
    """``<replacement>-<hash>`` of the settings that decide the trained weights."""
    keep = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in FINGERPRINT_KEYS}
    for key in UNFINGERPRINTED_STUDENT_KEYS:
        keep["student"].pop(key, None)
    keep["teacher_source"] = teacher_source
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:10]
    target = str(cfg.replacement.get("_target_", "replacement")).rsplit(".", 1)[-1]
    return f"{target}-{digest}"


def finish_run(ctx: StudentContext) -> None:
    """Rebuild every trained replacement from its stage file, export, evaluate, report."""
    from distill.assemble import export_student
    from distill.e2e_stage import e2e_finished, load_e2e_student, student_score
    from distill.evaluate import evaluate
    from distill.replacements import describe
    from distill.report import write_report
    from distill.sources import load_tokenizer, teacher_source
    from distill.student import build_replacement

    cfg, teacher = ctx.cfg, ctx.teacher
    with timed(ctx.timings, "export_s"):
        replacements, cfgs = {}, {}
        for stage in ctx.stages:
            from distill.student import StageModule

            module = StageModule({layer: build_replacement(cfg, teacher, layer) for layer in stage.layers})
            ckpt.load_stage_weights(ctx.checkpoint_dir, stage.index, module)
            for layer in stage.layers:
                replacements[layer] = module.blocks[str(layer)].eval()
                cfgs[layer] = OmegaConf.to_container(cfg.replacement, resolve=True)
        base, final = teacher, replacements
        if e2e_finished(ctx):
            base, final = load_e2e_student(ctx)
        out = export_student(base, teacher_source(cfg), final, cfgs, str(ctx.out_dir / "student"),
                             tokenizer=load_tokenizer(cfg))
        log.info("student exported to %s  (load it: from distill import load_student; "
                 "model = load_student(%r))", out, out)
    rows = {layer: describe(module, teacher, cfg.data.seq_len) for layer, module in replacements.items()}
    summary = {"teacher": teacher_source(cfg), "replacement": cfgs[min(cfgs)].get("_target_"),
               "layers": sorted(replacements), "steps_per_stage": cfg.student.steps_per_stage,
               "layers_per_stage": cfg.student.layers_per_stage, "world_size": ctx.world_size,
               "inputs": cfg.student.inputs, "e2e_steps": cfg.student.e2e.steps}
    result = None
    if cfg.evaluate and len(ctx.heldout_NT):
        with timed(ctx.timings, "evaluate_s"):
            result = evaluate(teacher, replacements, ctx.heldout_NT, batch_size=cfg.student.micro_batch_size)
            if final is not replacements:  # the exported student had an end-to-end stage
                summary["student_after_layer_stages"] = result.student
                result.student = student_score(base, final, ctx.heldout_NT, cfg.student.micro_batch_size)
        log.info("held-out %s: teacher %.4f, student %.4f", result.kind, result.teacher, result.student)
    metrics = _run_metrics(str(ctx.out_dir / "metrics.jsonl"))
    report = write_report(str(ctx.out_dir), metrics, result.to_dict() if result else {}, rows, summary,
                          ctx.timings)
    (ctx.out_dir / "result.json").write_text(json.dumps({
        "summary": summary, "eval": result.to_dict() if result else None,
        "layers": {str(k): v for k, v in rows.items()}, "timings": ctx.timings,
        "final_val": _final_val(metrics)}, indent=2, default=str))
    log.info("report written to %s", report)


def _run_metrics(path: str) -> list[dict]:
    """This run's metrics; none when every stage came finished from its checkpoint (a
    rerun of a completed command trains nothing, so it logs no step)."""
    from distill.report import read_metrics

    if not os.path.exists(path):
        log.info("no stage was trained in this run (all restored from checkpoints): the report has "
                 "no training curves; they are in the run that trained them")
        return []
    return read_metrics(path)


def _final_val(metrics: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for record in metrics:
        if record.get("event") == "stage_end":
            out.update(record.get("val", {}))
    return out
