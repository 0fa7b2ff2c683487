"""The exported student's model card: ``README.md`` in its directory, with HF model-card front matter.

What a user who downloads the student needs before running it: what it was distilled from,
which layers were replaced by what, on which data and how many tokens, how far it is from
its teacher on held-out data, what it gains at decoding, and how to load it (its own
modeling code, so ``trust_remote_code=True``). Written by ``finish_run`` from the same
figures as ``report.md`` and ``result.json``.
"""

from __future__ import annotations

import os
from typing import Any

from distill.results.numbers import assisted_sentence, format_column, signed_percent

CARD_FILE = "README.md"

_KIND_TAGS = {"LinearAttentionLayer": "linear-attention", "ResidualMLP": "residual-mlp", "PrunedLayer": "pruning",
              "LowRankLayer": "low-rank", "TeacherCopy": "teacher-copy",
              "SlidingWindowLinearLayer": "sliding-window-attention", "GatedLinearAttentionLayer": "gated-linear-attention"}


def write_model_card(out_dir: str, facts: dict[str, Any]) -> str:
    """Write ``out_dir/README.md`` from ``facts`` (keys below, any may be missing); returns its path.

    ``teacher`` (source), ``causal`` (bool), ``layers`` ({l: Hydra cfg}), ``num_layers``,
    ``describe`` ({l: replacements.describe row}), ``data`` (cfg.data as a dict),
    ``train_tokens``, ``eval`` (EvalResult.to_dict()), ``decode`` ({"teacher": DecodeSpeed
    dict, "student": ...}).
    """
    path = os.path.join(out_dir, CARD_FILE)
    sections = [_front_matter(facts), _intro(facts), _usage(facts), _layers(facts), _data(facts),
                _quality(facts), _speed(facts)]
    with open(path, "w") as f:
        f.write("\n\n".join(s for s in sections if s) + "\n")
    return path


def _kind(cfg: dict) -> str:
    return str(cfg.get("_target_", "?")).rsplit(".", 1)[-1]


def _front_matter(facts: dict) -> str:
    kinds = sorted({_KIND_TAGS.get(_kind(cfg), _kind(cfg)) for cfg in facts.get("layers", {}).values()})
    lines = ["---", "library_name: transformers", "tags:", "- distill", "- distillation",
             *(f"- {kind}" for kind in kinds),
             f"pipeline_tag: {'text-generation' if facts.get('causal') else 'feature-extraction'}"]
    teacher = str(facts.get("teacher", ""))
    if teacher and not os.path.isabs(teacher) and not os.path.exists(teacher) and teacher.count("/") == 1:
        lines.append(f"base_model: {teacher}")  # a hub name, not a local path
    data = facts.get("data") or {}
    if data.get("source") == "hf_dataset" and data.get("dataset_name"):
        lines += ["datasets:", f"- {data['dataset_name']}"]
    return "\n".join([*lines, "---"])


def _intro(facts: dict) -> str:
    replaced = sorted(int(k) for k in facts.get("layers", {}))
    return (f"# Distilled student of `{facts.get('teacher', '?')}`\n\n"
            f"Made with distill by layer-by-layer distillation: {len(replaced)} of "
            f"{facts.get('num_layers', '?')} teacher layers ({', '.join(map(str, replaced))}) replaced by "
            "cheaper modules, each trained to reproduce its teacher layer's output; the other layers, "
            "the embeddings and the head are the teacher's.")


def _usage(facts: dict) -> str:
    auto = "AutoModelForCausalLM" if facts.get("causal") else "AutoModel"
    call = ("out = model.generate(**tok(\"def f(x):\", return_tensors=\"pt\"), max_new_tokens=32)  # with the cache"
            if facts.get("causal") else "hidden = model(**tok([\"a\", \"b c\"], padding=True, return_tensors=\"pt\")).last_hidden_state")
    return "\n".join([
        "## Usage", "",
        "The directory carries its own modeling code (model type `distill_llama` / `distill_bert`), so "
        "transformers needs `trust_remote_code=True`; without it, loading fails rather than giving the teacher's "
        "architecture with missing weights. distill itself is not needed; transformers>=5.24 is.", "",
        "```python", f"from transformers import AutoTokenizer, {auto}",
        f"model = {auto}.from_pretrained(\"path/to/student\", trust_remote_code=True)",
        "tok = AutoTokenizer.from_pretrained(\"path/to/student\", trust_remote_code=True)  # it reads config.json too",
        call, "```", "",
        "Padding masks and position ids are honoured by every layer; replaced layers keep their decode "
        "state in the model's cache (`DynamicCache(config=model.config)`).",
    ])


def _layers(facts: dict) -> str:
    layers = facts.get("layers") or {}
    if not layers:
        return ""
    rows = facts.get("describe") or {}
    lines = ["## Layers", "", "| layer | replacement | options | params ratio | FLOPs/token ratio |",
             "| --- | --- | --- | --- | --- |"]
    for idx in sorted(layers, key=int):
        cfg = layers[idx]
        options = ", ".join(f"{k}={v}" for k, v in cfg.items() if not k.startswith("_")) or "-"
        row = rows.get(int(idx)) or rows.get(str(idx)) or {}
        lines.append(f"| {idx} | {_kind(cfg)} | {options} | {_fmt(row.get('params_ratio'))} | "
                     f"{_fmt(row.get('flops_ratio'))} |")
    lines += ["", "Ratios are replacement / teacher layer; layers not listed are the teacher's own."]
    return "\n".join(lines)


def _data(facts: dict) -> str:
    data = facts.get("data") or {}
    if not data:
        return ""
    source = data.get("source")
    what = {"pydoc": "the Python documentation topics that ship with Python (`pydoc_data.topics`)",
            "text": f"local text files `{data.get('path')}`",
            "hf_dataset": f"the dataset `{data.get('dataset_name')}` ({data.get('dataset_config') or 'default'}, "
                          f"split {data.get('split')})"}.get(source, str(source))
    tokens = facts.get("train_tokens")
    return (f"## Training data\n\nTeacher hidden states on {what}, in chunks of {data.get('seq_len')} tokens; "
            f"{tokens:,} training tokens over all layer stages." if tokens else
            f"## Training data\n\nTeacher hidden states on {what}, in chunks of {data.get('seq_len')} tokens.")


def _quality(facts: dict) -> str:
    result = facts.get("eval")
    if not result:
        return ""
    metric = "perplexity (lower is better)" if result["kind"] == "lm" else "cosine of final hidden states"
    gap = result["student"] / result["teacher"] - 1
    teacher, student = format_column([result["teacher"], result["student"]])  # a gap never prints as none
    return "\n".join([
        "## Quality", "", f"Held-out {metric} over {result['num_tokens']:,} tokens not trained on.", "",
        "| model | held-out |", "| --- | --- |", f"| teacher | {teacher} |",
        f"| this student | {student} |", f"| relative gap | {signed_percent(gap)} |"])


def _speed(facts: dict) -> str:
    decode = facts.get("decode")
    if not decode:
        return ""
    teacher, student = decode["teacher"], decode["student"]
    return "\n".join([
        "## Speed", "",
        f"Greedy decoding with the cache at {teacher['context']:,} tokens of context, batch {teacher['batch']}, "
        "measured at the end of the run on the machine that trained it (`distill.model.decode`).", "",
        "| model | ms/token | cache / state MiB |", "| --- | --- | --- |",
        f"| teacher | {teacher['ms_per_token']:.2f} | {teacher['cache_bytes'] / 2**20:.2f} |",
        f"| this student | {student['ms_per_token']:.2f} | {student['cache_bytes'] / 2**20:.2f} |",
        *(["", assisted_sentence(decode["assisted"])] if decode.get("assisted") else [])])


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
