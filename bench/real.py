"""The quality a real model keeps: a teacher (SmolLM2-135M) against its distilled students, on two corpora.

A run's own report measures its student on the held-out documents of the corpus it trained
on. This measures what a user would ask next, for the teacher and every student given, in
one table:

- held-out perplexity on the training corpus's held-out chunks (the same split the runs
  used: their ``data`` settings, read from the run directory), and the ratio to the teacher;
- perplexity on a second real English corpus none of them trained on (``--corpus``: text
  files, ``.txt`` or ``.txt.gz``; by default the Debian Reference, which ships as text in
  a Debian documentation package), and the ratio;
- greedy continuations of three fixed prompts, side by side.

Every model is loaded as a user loads it: the teacher with ``AutoModelForCausalLM`` from the
directory the runs loaded it from (for ``teacher=smollm2``, the one distill converted its GGUF
file into; every run given must share it and its data settings), each student with ``distill.load_student``
from ``<run dir>/student``. Nothing is trained here.

    apt-get download debian-reference-en && dpkg-deb -x debian-reference-en_*.deb /tmp/debref
    python bench/real.py outputs/<run> [outputs/<another run> ...]      # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from distill import load_student  # noqa: E402
from distill.model.data import build_chunks, load_documents, tokenize_chunks  # noqa: E402

DEFAULT_CORPUS = "/tmp/debref/usr/share/debian-reference/debian-reference.en.txt.gz"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "The most important thing about learning is")
NEW_TOKENS = 24


@dataclass
class Row:
    name: str
    heldout_ppl: float
    corpus_ppl: float
    continuations: list[str]


def read_text(pattern: str) -> list[str]:
    """One document per file matching ``pattern`` (``.gz`` files are read decompressed)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise SystemExit(f"--corpus {pattern!r} matches no file; for the default: apt-get download "
                         "debian-reference-en && dpkg-deb -x debian-reference-en_*.deb /tmp/debref")
    docs = []
    for file in files:
        opener = gzip.open if file.endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    return docs


def run_data(run_dir: Path) -> dict:
    """The ``data`` settings the run was started with (Hydra's record of its config)."""
    with open(run_dir / ".hydra" / "config.yaml") as f:
        return yaml.safe_load(f)["data"]


def run_teacher(run_dir: Path) -> str:
    """The HF directory the run's teacher was loaded from (a GGUF teacher's converted copy)."""
    return json.loads((run_dir / "result.json").read_text())["summary"]["teacher_source"]


def heldout_chunks(tokenizer, data: dict) -> torch.Tensor:
    """The run's held-out chunks, split and tokenized exactly as the run did (``distill.model.data``)."""
    docs = load_documents(data["source"], path=data.get("path"), max_documents=data.get("max_documents"))
    return build_chunks(tokenizer, docs, data["seq_len"], data["heldout_fraction"], data["seed"],
                        max_heldout_chunks=data["max_heldout_chunks"]).heldout_NT


def perplexity(model: torch.nn.Module, chunks_NT: torch.Tensor, batch_size: int) -> float:
    """exp(mean next-token NLL) over every chunk (whole chunks, no padding), from the logits
    of the model's own forward: not ``distill.model.evaluate.perplexity_of``, which reads a
    ``Teacher``'s parts, because here each model is scored as loaded (a family's final
    logit soft-capping included). On the runs' held-out chunks the teacher's figure equals
    the app's (``test_app``'s multirun test holds it)."""
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for batch_BT in chunks_NT.split(batch_size):
            logits_BTV = model(input_ids=batch_BT).logits.float()
            nll += torch.nn.functional.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), batch_BT[:, 1:].flatten(),
                                                     reduction="sum").item()
            tokens += batch_BT[:, 1:].numel()
    return math.exp(nll / tokens)


def continuations(model: torch.nn.Module, tokenizer) -> list[str]:
    """Greedy continuations of ``PROMPTS`` (what the report's side-by-side shows)."""
    texts = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        texts.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return texts


def measure(name: str, model: torch.nn.Module, tokenizer, heldout_NT: torch.Tensor, corpus_NT: torch.Tensor,
            batch_size: int) -> Row:
    model.eval()
    print(f"measuring {name} ...", file=sys.stderr, flush=True)
    return Row(name, perplexity(model, heldout_NT, batch_size), perplexity(model, corpus_NT, batch_size),
               continuations(model, tokenizer))


def student_name(run_dir: Path) -> str:
    """The run's replacement and its hybrid choice, from its result.json when it has one."""
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return run_dir.name
    kind = result.get("summary", {}).get("replacement", "?")
    kept = (result.get("hybrid") or {}).get("kept")
    return f"{run_dir.name} ({kind}{f', keeps {kept}' if kept else ''})"


def render(rows: list[Row], heldout_tokens: int, corpus_tokens: int) -> str:
    teacher = rows[0]
    lines = [f"| model | held-out ppl ({heldout_tokens:,} tokens) | / teacher | second corpus ppl "
             f"({corpus_tokens:,} tokens) | / teacher |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row.name} | {row.heldout_ppl:.2f} | {row.heldout_ppl / teacher.heldout_ppl:.3f}x | "
                     f"{row.corpus_ppl:.2f} | {row.corpus_ppl / teacher.corpus_ppl:.3f}x |")
    lines += ["", "Greedy continuations:", ""]
    for i, prompt in enumerate(PROMPTS):
        lines.append(f"- `{prompt}`")
        for row in rows:
            text = row.continuations[i].replace("\n", " ").replace("|", "/").strip()
            lines.append(f"  - {row.name}: {text}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of SmolLM2 students")
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="glob of the second corpus's text files")
    parser.add_argument("--corpus-chunks", type=int, default=32, help="chunks of the second corpus scored")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    teacher_dir, data = run_teacher(args.runs[0]), run_data(args.runs[0])
    for run in args.runs[1:]:
        if run_data(run) != data or run_teacher(run) != teacher_dir:
            raise SystemExit(f"{run} had another teacher or other data settings than {args.runs[0]}: "
                             "compare like with like")
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    heldout_NT = heldout_chunks(tokenizer, data)
    corpus_NT = tokenize_chunks(tokenizer, read_text(args.corpus), data["seq_len"], args.corpus_chunks)
    rows = [measure("teacher", AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32), tokenizer,
                    heldout_NT, corpus_NT, args.batch)]
    for run in args.runs:
        rows.append(measure(student_name(run), load_student(str(run / "student")), tokenizer, heldout_NT, corpus_NT,
                            args.batch))
    print(render(rows, heldout_NT[:, 1:].numel(), corpus_NT[:, 1:].numel()))


if __name__ == "__main__":
    main()
