"""A run's metrics turned into a plot and a markdown report.

The trainer appends one JSON object per line to metrics.jsonl; three events matter here:

    {"event": "train", "stage": 0, "layers": [0], "step": 10, "loss": 0.1,
     "layer_losses": {"0": 0.1}, "lr": 1e-3, "samples_per_s": 100.0, ...}
    {"event": "val", "stage": 0, "step": 10, "layer_losses": {"0": 0.12}}
    {"event": "stage_end", "stage": 0, "layers": [0], "steps": 100, "tokens": 51200, ...}

Other events are kept by `read_metrics` and ignored by the rest. `write_report` puts
the run's answer in one page: what was distilled, what each replaced layer costs and
loses, and how far the student is from the teacher.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from distill.model.evaluate import EvalResult
from distill.results.numbers import (
    MISSING,
    assisted_sentence,
    column_format,
    ratio_to_one,
    signed_percent,
)
from distill.results.report_file import REPORT_FILE, TIME_HEADING

log = logging.getLogger(__name__)

PLOT_FILE = "losses.png"
HYBRID_PLOT_FILE = "hybrid.png"

TABLE_HEADER = (
    "| layer | replacement params ratio | FLOPs/token ratio | val loss, teacher inputs "
    "| val loss, student inputs | spliced-alone metric | tokens used |"
)
BEFORE_E2E_HEADER = " spliced-alone, after the layer stages |"
"""The extra column of a run with an end-to-end stage (the metric column is then the final student's)."""
_METRIC_NAMES = {"lm": "perplexity", "encoder": "cosine similarity of final hidden states"}
_MISSING = MISSING


# ---------------------------------------------------------------------- metrics


def read_metrics(path: str) -> list[dict]:
    """The JSON objects of metrics.jsonl, in file order.

    A run killed mid-write leaves a truncated last line; it is skipped with a warning.
    A bad line anywhere else means the file is not a metrics log, which is an error.
    """
    with open(path) as f:
        lines = [(num, line) for num, line in enumerate(f, start=1) if line.strip()]
    metrics = []
    for position, (num, line) in enumerate(lines):
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError as err:
            if position == len(lines) - 1:
                log.warning("%s: skipping truncated last line %d (%s)", path, num, err)
                break
            raise ValueError(f"{path}:{num} is not JSON ({err}); is it a metrics.jsonl?") from err
    return metrics


def _events(metrics: list[dict], event: str) -> list[dict]:
    return [record for record in metrics if record.get("event") == event]


def _of_layer_stages(metrics: list[dict]) -> list[dict]:
    """The records of the stages that trained the student's layers: not those of an automatic
    hybrid's scoring pass (kind ``score``), whose replacements are discarded."""
    return [record for record in metrics if record.get("kind") != "score"]


def _train_curves(metrics: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """{layer: (steps, losses)} from the train events' per-layer losses."""
    return _layer_curves(metrics, "train")


def _val_curves(metrics: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """{layer: (steps, validation losses on teacher inputs)} from the val events."""
    return _layer_curves(metrics, "val")


def _layer_curves(metrics: list[dict], event: str) -> dict[int, tuple[list[int], list[float]]]:
    """{layer: (steps, losses)} from the layer stages' ``event`` records."""
    curves: dict[int, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for record in _events(_of_layer_stages(metrics), event):
        for idx, loss in (record.get("layer_losses") or {}).items():
            steps, losses = curves[int(idx)]
            steps.append(int(record["step"]))
            losses.append(float(loss))
    return dict(sorted(curves.items()))


def _final_val_losses(metrics: list[dict], student_inputs: bool = False) -> dict[int, float]:
    """{layer: its final validation loss} on teacher inputs (or the student's own), from val
    events or the stage_end's record (which holds the weights the stage kept)."""
    final: dict[int, float] = {}
    val_key, end_key = ("student_losses", "val_student") if student_inputs else ("layer_losses", "val")
    for record in _of_layer_stages(metrics):
        event = record.get("event")
        losses = record.get(val_key) if event == "val" else None
        losses = record.get(end_key) if event == "stage_end" else losses
        for idx, loss in (losses or {}).items():
            final[int(idx)] = float(loss)
    return dict(sorted(final.items()))


def _tokens_used(metrics: list[dict]) -> dict[int, int]:
    """{layer: training tokens of the stages that trained it} from stage_end events."""
    tokens: dict[int, int] = defaultdict(int)
    for record in _events(_of_layer_stages(metrics), "stage_end"):
        for idx in record.get("layers") or []:
            tokens[int(idx)] += int(record.get("tokens", 0))
    return dict(tokens)


# ---------------------------------------------------------------------- plot


def plot_losses(metrics: list[dict], out_png: str) -> str:
    """Per-layer training (lines) and validation (dashed, dots) loss curves, log y, and final
    validation losses; returns `out_png`.

    Drawn on a bare `Figure` with the Agg canvas, never through pyplot, so it changes
    no global matplotlib state and needs no display.
    """
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    curves_ax, bars_ax = fig.subplots(1, 2, width_ratios=(2, 1))
    _draw_curves(curves_ax, _train_curves(metrics), _val_curves(metrics))
    _draw_val_bars(bars_ax, _final_val_losses(metrics))
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return out_png


def _draw_curves(ax: Any, curves: dict[int, tuple[list[int], list[float]]],
                 val_curves: dict[int, tuple[list[int], list[float]]] | None = None) -> None:
    """One line per layer, x = step within its stage, and its validation losses dashed in the
    same colour; log y when every loss is positive."""
    val_curves = val_curves or {}
    for idx in sorted(set(curves) | set(val_curves)):
        color = f"C{idx % 10}"
        if idx in curves:
            ax.plot(*curves[idx], label=f"layer {idx}", linewidth=1.2, color=color)
        if idx in val_curves:
            ax.plot(*val_curves[idx], label=f"layer {idx} (val)", linewidth=1.2, linestyle="--", marker=".",
                    color=color)
    values = [loss for series in (curves, val_curves) for _, losses in series.values() for loss in losses]
    if values and min(values) > 0:
        ax.set_yscale("log")
    if not curves and not val_curves:
        ax.text(0.5, 0.5, "no training events", ha="center", va="center", transform=ax.transAxes)
    elif len(curves) <= 16:
        ax.legend(fontsize="small", ncols=2)
    ax.set(title="training (solid) and validation (dashed) loss per layer", xlabel="step within stage",
           ylabel="loss")
    ax.grid(True, which="both", alpha=0.3)


def _draw_val_bars(ax: Any, final: dict[int, float]) -> None:
    """One bar per layer: its last validation loss."""
    if final:
        ax.bar([str(idx) for idx in final], list(final.values()), color="tab:orange")
    else:
        ax.text(0.5, 0.5, "no validation events", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="final validation loss", xlabel="layer", ylabel="loss")
    ax.grid(True, axis="y", alpha=0.3)


# ---------------------------------------------------------------------- report


def write_report(
    run_dir: str,
    metrics: list[dict],
    eval_result: EvalResult | dict | None,
    describe_rows: dict[int, dict],
    config_summary: dict,
    timings: dict[str, float] | None = None,
    *,
    hybrid: dict | None = None,
    decode: dict | None = None,
) -> str:
    """Write run_dir/report.md (and the losses.png it embeds); returns the report's path.

    `decode` is `finish.decode_figures(...)` (teacher and student decoding at a long context),
    shown next to the quality gap; None for encoders or unevaluated runs.

    `describe_rows[l]` is `distill.replacements.describe(replacement, teacher, seq_len)`;
    `eval_result` may also be `EvalResult.to_dict()` read back from JSON, or None / {}
    when the run was not evaluated (its sections then say so). `hybrid` is an automatic
    hybrid's choice (`distill.train.hybrid.choose`): its section and hybrid.png.
    """
    if isinstance(eval_result, dict):
        eval_result = EvalResult.from_dict(eval_result) if eval_result else None
    os.makedirs(run_dir, exist_ok=True)
    fmt = _metric_format(eval_result, metrics, config_summary)
    sections = [
        "# Distillation report",
        _config_section(config_summary),
        _overall_section(eval_result, decode, fmt),
        *_continuations_section(decode),
        _layer_section(metrics, eval_result, describe_rows,
                       eval_result.per_layer_layer_stages if eval_result is not None else None, fmt),
    ]
    if hybrid:
        sections.append(_hybrid_section(hybrid, eval_result))
        plot_hybrid(hybrid, eval_result, os.path.join(run_dir, HYBRID_PLOT_FILE))
    quality = _quality_section(metrics, config_summary, fmt)
    if quality:
        sections.append(quality)
    if timings:
        sections.append(_timing_section(timings))
    sections.append(_losses_section(run_dir, metrics, config_summary))
    path = os.path.join(run_dir, REPORT_FILE)
    with open(path, "w") as f:
        f.write("\n\n".join(sections) + "\n")
    log.info("report written to %s", path)
    return path


def _losses_section(run_dir: str, metrics: list[dict], config_summary: dict) -> str:
    """losses.png when this run trained or validated a stage; else why there are no curves (every
    stage came finished from its checkpoints: they are in the run that trained them)."""
    if _events(metrics, "train") or _events(metrics, "val"):
        plot_losses(metrics, os.path.join(run_dir, PLOT_FILE))
        restored = restored_note(config_summary)
        note = f"\n\nNot drawn: {restored}" if restored else ""
        return f"## Losses\n\n![training and validation losses]({PLOT_FILE}){note}"
    return f"## Losses\n\nNo curves: {restored_note(config_summary) or 'this run logged no training step.'}"


def restored_note(config_summary: dict) -> str:
    """One sentence on the stages this run reused from checkpoints instead of training them, if any."""
    restored = config_summary.get("restored_layers")
    if not restored:
        return ""
    where = config_summary.get("checkpoint_dir")
    return (f"layers {restored} were not trained by this run: their finished stages were reused from "
            f"`{where}`, so their training curves and validation losses are in the report of the run that "
            "trained them.")


CONFIG_KEYS = ("command", "teacher", "replacement", "data", "layers", "steps_per_stage", "schedule",
               "layers_per_stage", "inputs", "e2e_steps", "world_size", "kept_layers", "train_tokens",
               "restored_layers", "checkpoint_dir", "teacher_source")
"""The configuration table's rows, in order: what the user chose first (the command and the options it
picked), then what the run made of it. Other summary keys are figures reported elsewhere."""


def _config_section(config_summary: dict) -> str:
    """Key/value table of the run's configuration: the options as typed, then the facts of the run."""
    keys = [key for key in CONFIG_KEYS if key in config_summary]
    keys += [key for key in config_summary if key not in CONFIG_KEYS and key != "student_after_layer_stages"]
    flat = _flatten({key: config_summary[key] for key in keys})
    rows = [f"| `{key}` | {_code(value) if key == 'command' else _cell(value)} |" for key, value in flat.items()]
    return "\n".join(["## Configuration", "", "| key | value |", "| --- | --- |", *rows])


def _code(text: Any) -> str:
    return "`" + str(text).replace("|", "\\|").replace("`", "'") + "`"


def _metric_format(result: EvalResult | None, metrics: list[dict], config_summary: dict) -> Any:
    """One precision for every held-out metric of the report (teacher, student, spliced-alone
    layers, end-to-end steps): the fewest digits at which each figure that differs prints differently."""
    values: list[Any] = [config_summary.get("student_after_layer_stages")]
    if result is not None:
        values += [result.teacher, result.student, result.identity, *result.per_layer.values(),
                   *(result.per_layer_layer_stages or {}).values()]
    values += [m.get("ppl", m.get("cosine")) for m in _events(metrics, "e2e_val")]
    return column_format(values)


def _overall_section(result: EvalResult | None, decode: dict | None = None, fmt: Any = None) -> str:
    """Teacher vs student on held-out data, with the relative gap, and (decoders) what each
    costs at decoding with a long context: where the student wins."""
    if result is None:
        return "## Teacher vs student\n\nNot evaluated (`evaluate=false` or no held-out data)."
    fmt = fmt or _metric_format(result, [], {})
    metric = _METRIC_NAMES.get(result.kind, result.kind)
    identity = ([f"| replaced layers skipped (identity baseline) | {fmt(result.identity)} |"]
                if result.identity is not None else [])
    if not decode or "teacher" not in decode:  # decoding not timed (an encoder, or continuations only)
        return "\n".join([
            "## Teacher vs student", "", f"Held-out {metric} over {result.num_tokens:,} tokens.", "",
            "| model | metric |", "| --- | --- |", f"| teacher | {fmt(result.teacher)} |",
            f"| student (all replacements) | {fmt(result.student)} |",
            f"| relative gap (student / teacher - 1) | {signed_percent(result.relative_gap)} |", *identity])
    teacher, student = decode["teacher"], decode["student"]
    context = f"{teacher['context']:,}"
    return "\n".join([
        "## Teacher vs student", "",
        f"Held-out {metric} over {result.num_tokens:,} tokens; greedy decoding with the cache at {context} "
        f"tokens of context, batch {teacher['batch']}, median of {decode.get('steps', '?')} steps (the exported student "
        "loaded back from its directory).", "",
        f"| model | {metric} | decode ms/token @ {context} | cache / state MiB @ {context} |",
        "| --- | --- | --- | --- |",
        f"| teacher | {fmt(result.teacher)} | {teacher['ms_per_token']:.2f} | {_mib(teacher['cache_bytes'])} |",
        f"| student (all replacements) | {fmt(result.student)} | {student['ms_per_token']:.2f} | "
        f"{_mib(student['cache_bytes'])} |",
        f"| student / teacher | {ratio_to_one(result.relative_gap + 1)}x ({signed_percent(result.relative_gap)}) | "
        f"{1 / decode['speedup']:.3f}x ({decode['speedup']:.2f}x faster) | "
        f"{1 / decode['cache_ratio']:.4f}x ({decode['cache_ratio']:.0f}x smaller) |",
        *(f"{row} {_MISSING} | {_MISSING} |" for row in identity), *_assisted_lines(decode.get("assisted"))])


def _assisted_lines(assisted: dict | None) -> list[str]:
    """The teacher generating with the student as its draft model, when the run measured it."""
    if not assisted:
        return []
    return ["", assisted_sentence(assisted)]



def _continuations_section(decode: dict | None) -> list[str]:
    """The teacher's and the exported student's greedy continuations of the fixed prompts
    (``distill.model.continuations``), when the run made them: what a perplexity gap reads like."""
    rows = (decode or {}).get("continuations")
    if not rows:
        return []
    lines = ["## Greedy continuations", "",
             "The same prompts, continued greedily by the teacher and by the exported student (new tokens only).", "",
             "| prompt | teacher | student |", "| --- | --- | --- |"]
    lines += [f"| {_text_cell(r['prompt'])} | {_text_cell(r['teacher'])} | {_text_cell(r['student'])} |" for r in rows]
    return ["\n".join(lines)]


def _text_cell(text: str) -> str:
    """Generated text as one Markdown table cell: its pipes escaped, its line breaks shown as ⏎."""
    return "`" + str(text).replace("`", "'").replace("|", "\\|").replace("\n", "⏎") + "`"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f}"


def _layer_section(
    metrics: list[dict], result: EvalResult | None, describe_rows: dict[int, dict],
    before_e2e: dict[int, float] | None = None, fmt: Any = None,
) -> str:
    """One row per replaced layer, then a total row of the cost ratios and tokens; after an
    end-to-end stage, the layer-stage students' spliced-alone metric in a last column."""
    columns = [
        {idx: row.get("params_ratio") for idx, row in describe_rows.items()},
        {idx: row.get("flops_ratio") for idx, row in describe_rows.items()},
        _final_val_losses(metrics),
        _final_val_losses(metrics, student_inputs=True),
        result.per_layer if result is not None else {},
    ]
    fmt = fmt or _metric_format(result, metrics, {})
    tokens = _tokens_used(metrics)
    params, flops = _total_ratios(describe_rows)
    formats = [column_format([*columns[0].values(), params]), column_format([*columns[1].values(), flops]),
               column_format(columns[2].values()), column_format(columns[3].values()), fmt]
    header, total = TABLE_HEADER, _total_row(formats[0](params), formats[1](flops), metrics)
    if before_e2e:
        header, total = header + BEFORE_E2E_HEADER, total + f" {_MISSING} |"
    layer_idxs = sorted({idx for column in columns for idx in column} | set(tokens))
    rows = []
    for idx in layer_idxs:
        cells = [str(idx), *(form(column.get(idx)) for form, column in zip(formats, columns, strict=True)),
                 _fmt_int(tokens.get(idx))]
        if before_e2e:
            cells.append(fmt(before_e2e.get(idx)))
        rows.append("| " + " | ".join(cells) + " |")
    rows.append(total)
    return "\n".join(
        ["## Per layer", "", _layer_intro(result, fmt), "", header, "| --- " * header.count(" |") + "|", *rows]
    )


def _layer_intro(result: EvalResult | None, fmt: Any) -> str:
    """What the spliced-alone column holds, next to the teacher's own score."""
    ratios = "Ratios are replacement / teacher layer."
    if result is None:
        return f"Spliced-alone metric: not evaluated. {ratios}"
    metric = _METRIC_NAMES.get(result.kind, result.kind)
    after_e2e = (" by its end-to-end-trained replacement (by the layer stage's in the last column)"
                 if result.per_layer_layer_stages else "")
    tokens = (f" on the first {result.per_layer_tokens:,} of the {result.num_tokens:,} held-out tokens (splicing "
              "each layer alone re-runs the layers after it; the figures are bounded to cost no more than "
              "the whole student's)" if result.per_layer_tokens else "")
    teacher = (f"the teacher on those tokens: {fmt(result.per_layer_teacher)}, on all of them "
               f"{fmt(result.teacher)}" if result.per_layer_teacher is not None
               else f"teacher: {fmt(result.teacher)}")
    return (
        f"Spliced-alone metric: held-out {metric} of the teacher with only that layer "
        f"replaced{after_e2e}{tokens} ({teacher}). Validation losses: against the "
        f"teacher's output of the layer, fed the teacher's input or the student's own. {ratios}"
    )


def _total_ratios(describe_rows: dict[int, dict]) -> tuple[float | None, float | None]:
    """All replacements' parameters and FLOPs over those of the layers they replace."""
    rows = list(describe_rows.values())
    return (_sum_ratio(rows, "params", "teacher_params"),
            _sum_ratio(rows, "flops_per_token", "teacher_flops_per_token"))


def _total_row(params: str, flops: str, metrics: list[dict]) -> str:
    """The total ratios (formatted with their columns), and the tokens of all stages (a stage
    training several layers counts its tokens once)."""
    stage_ends = _events(metrics, "stage_end")
    tokens = sum(int(r.get("tokens", 0)) for r in stage_ends) if stage_ends else None
    cells = ["**all**", params, flops, _MISSING, _MISSING, _MISSING, _fmt_int(tokens)]
    return "| " + " | ".join(cells) + " |"


def _sum_ratio(rows: list[dict], key: str, teacher_key: str) -> float | None:
    if not rows or any(key not in row or teacher_key not in row for row in rows):
        return None
    teacher_total = sum(row[teacher_key] for row in rows)
    return sum(row[key] for row in rows) / teacher_total if teacher_total else None


def _quality_section(metrics: list[dict], config_summary: dict, fmt: Any) -> str:
    """Stages that ended before their step count, and the end-to-end stage's effect."""
    lines = []
    early = [m for m in _events(metrics, "stage_end") if m.get("stopped") not in (None, "steps")]
    if early:
        lines += ["Stages that ended early: " + ", ".join(
            f"stage {m['stage']} ({m['stopped']} after {m['steps']} steps, {_fmt_int(m.get('tokens'))} tokens)"
            for m in early) + "."]
    before = config_summary.get("student_after_layer_stages")
    e2e_val = _events(metrics, "e2e_val")
    ends = [m.get("best_step") for m in _events(metrics, "stage_end") if m.get("layers") == []]
    best = ends[-1] if ends else None
    if before is not None:
        lines += [f"Student after the layer stages: {fmt(before)}; " + (
            "the end-to-end stage improved on it at no validation, so the exported student above is this one."
            if best == 0 else "the exported student above has also had the end-to-end stage.")]
    if e2e_val:
        key = "ppl" if "ppl" in e2e_val[0] else "cosine"
        name = _METRIC_NAMES["lm" if key == "ppl" else "encoder"]
        lines += ["", f"| end-to-end step | held-out {name} |", "| --- | --- |",
                  *(f"| {m['step']} | {fmt(m.get(key))} |" for m in e2e_val)]
        if best is not None:
            lines += ["", f"The end-to-end stage kept the weights of step {best} (its best validation)."]
        if best == 0 and len(e2e_val) > 1:
            lines[-1] += (" Every step after it made the student worse: a lower `student.e2e.lr`, or "
                          "`student.e2e.trainable=lora`, may let it help; or set `student.e2e.steps=0`.")
    return "\n".join(["## Stage ends and end-to-end stage", "", *lines]) if lines else ""


def _hybrid_section(hybrid: dict, result: EvalResult | None) -> str:
    """Which layers the automatic hybrid converted and kept, each layer's score, and the
    quality of the scoring-pass student by number of converted layers."""
    metric = _METRIC_NAMES.get(hybrid["kind"], hybrid["kind"])
    budget = (f"`student.hybrid.keep_softmax={hybrid['keep_softmax']}`" if hybrid.get("keep_softmax") is not None
              else f"`student.hybrid.max_gap={hybrid['max_gap']}`")
    kl_name = "KL of the output" if hybrid["kind"] == "lm" else "1 - cosine of the output"
    converted = set(hybrid["converted"])
    order = [int(layer) for layer in hybrid["order"]]
    kl_fmt = column_format(hybrid["kl"].values())
    measured = [(n, value) for n, value in enumerate(hybrid["curve"]) if value is not None]  # keep_softmax: a few
    fmt = column_format([*hybrid["spliced_alone"].values(), *(value for _, value in measured), hybrid["teacher"],
                         hybrid.get("spliced_teacher"),
                         result.student if result is not None else None])
    rows = [f"| {layer} | {kl_fmt(hybrid['kl'][str(layer)])} | {fmt(hybrid['spliced_alone'][str(layer)])} | "
            f"{'converted' if layer in converted else '**kept (teacher)**'} |" for layer in order]
    curve = [f"| {n} | {', '.join(map(str, sorted(order[:n]))) or '–'} | {fmt(value)} |"
             for n, value in measured]
    final = ("" if result is None else
             f" The trained student, {len(converted)} layers converted: {fmt(result.student)}.")
    return "\n".join([
        "## Automatic hybrid", "",
        f"Budget {budget}. A scoring pass trained a replacement for each candidate layer "
        f"({hybrid['steps']} steps, teacher inputs) and scored its conversion alone on the held-out "
        f"chunks by `{hybrid['score']}`; converted layers {hybrid['converted']}, kept layers "
        f"{hybrid['kept'] or 'none'} as the teacher's own.", "",
        f"| layer (cheapest first) | {kl_name} | spliced-alone {metric} (teacher on the same tokens: "
        f"{fmt(hybrid.get('spliced_teacher', hybrid['teacher']))}) | choice |", "| --- | --- | --- | --- |",
        *rows, "",
        f"Held-out {metric} of the scoring-pass student by layers converted (teacher: {fmt(hybrid['teacher'])})."
        f"{final}", "",
        "| layers converted | which | held-out metric |", "| --- | --- | --- |", *curve, "",
        f"![quality against the number of converted layers]({HYBRID_PLOT_FILE})"])


def plot_hybrid(hybrid: dict, result: EvalResult | None, out_png: str) -> str:
    """Held-out metric of the scoring-pass student against the number of converted layers
    (cheapest first), the teacher's level and the trained student; returns `out_png`."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    counts, values = zip(*((n, value) for n, value in enumerate(hybrid["curve"]) if value is not None), strict=True)
    ax.plot(counts, values, marker="o", label=f"scoring pass ({hybrid['steps']} steps/layer)")
    ax.axhline(hybrid["teacher"], color="gray", linestyle="--", linewidth=1, label="teacher")
    if result is not None:
        ax.plot([len(hybrid["converted"])], [result.student], marker="*", markersize=12, linestyle="none",
                color="tab:red", label="trained student")
    metric = _METRIC_NAMES.get(hybrid["kind"], hybrid["kind"])
    ax.set(title="quality against layers converted", xlabel="layers converted (cheapest first)",
           ylabel=f"held-out {metric}", xticks=counts)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out_png, dpi=110)
    return out_png


def _timing_section(timings: dict[str, float]) -> str:
    """Seconds per phase and their share of the total."""
    total_s = sum(timings.values())
    share = (lambda seconds: f"{seconds / total_s:.1%}") if total_s > 0 else (lambda _: _MISSING)
    rows = [
        f"| {name.removesuffix('_s')} | {seconds:.1f} | {share(seconds)} |"
        for name, seconds in timings.items()
    ]
    return "\n".join(
        [
            TIME_HEADING,
            "",
            "| phase | seconds | share |",
            "| --- | --- | --- |",
            *rows,
            f"| **total** | {total_s:.1f} | |",
        ]
    )


# ---------------------------------------------------------------------- formatting


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def _cell(value: Any) -> str:
    """A value fit for a markdown table cell (no pipes, no newlines)."""
    text = column_format([value])(value) if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt_int(value: int | None) -> str:
    return _MISSING if value is None else f"{value:,}"
