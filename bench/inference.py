"""Decode speed and cache memory: a softmax teacher against its linear-attention student.

A random-weights Llama (hidden 512, 8 layers, 8 heads, 8 KV heads, MLP 1376, vocab 8192, a
fixed seed) is the teacher; the student replaces all 8 layers with
``distill.replacements.linear_attention.LinearAttentionLayer`` (hedgehog features, the head
size wide), is exported with ``export_student`` and loaded back with ``load_student``,
exactly as a user gets it. Both decode greedily with the cache through their HF forward
(``distill.model.decode.measure_decode``: the cache grown to the context, then timed single
token steps; the median step of ``--steps`` after 3 warm-up steps), in this process, at
contexts 512, 2048 and 8192 and batch sizes 1 and 8. Each cell alternates teacher and
student ``--repeats`` times (freeing the other's cache in between) and keeps the median of
each, so a burst of foreign load or the teacher's gigabytes of KV cache just freed spoils one
repeat, not the cell. Printed per cell: ms per decode step (one token per sequence), bytes
the cache holds, and the ratios.

Targets on the 2-core machine: the student's ms/token grows less than 1.2x from 512 to 8192,
is at least 2x faster than the teacher at 8192, and its state does not grow with context.

Run it from the repository root (about a minute)::

    flock /tmp/distill-cpu.lock python bench/inference.py
    python bench/inference.py --quick      # smoke run: contexts 64 and 256, batch 1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.model.assemble import export_student, load_student
from distill.model.decode import DecodeSpeed, measure_decode
from distill.model.teacher import Teacher
from distill.replacements.linear_attention import LinearAttentionLayer

CONFIG = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 16384}
CFG = {"_target_": "distill.replacements.linear_attention.LinearAttentionLayer", "_partial_": True}


def build_models(out_dir: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The random teacher and its all-linear-attention student, loaded as a user loads it."""
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**CONFIG)))
    replacements = {idx: LinearAttentionLayer(teacher, idx) for idx in range(teacher.num_layers)}
    export_student(teacher, "random-llama", replacements, dict.fromkeys(replacements, CFG), out_dir)
    return teacher.model, load_student(out_dir)


def measure_cell(teacher: torch.nn.Module, student: torch.nn.Module, context: int, batch: int, steps: int,
                 repeats: int) -> tuple[DecodeSpeed, DecodeSpeed]:
    """Teacher and student at one cell, alternated ``repeats`` times; the median of each."""
    runs: dict[str, list[DecodeSpeed]] = {"teacher": [], "student": []}
    for _ in range(repeats):
        for name, model in (("teacher", teacher), ("student", student)):
            runs[name].append(measure_decode(model, context, batch, steps))
            gc.collect()
    return tuple(_median(runs[name]) for name in ("teacher", "student"))


def _median(runs: list[DecodeSpeed]) -> DecodeSpeed:
    ms = statistics.median(r.ms_per_token for r in runs)
    return DecodeSpeed(runs[0].context, runs[0].batch, ms, max(r.cache_bytes for r in runs))


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f}"


def table(rows: list[tuple[DecodeSpeed, DecodeSpeed]]) -> str:
    """Markdown table: one row per (context, batch), teacher and student side by side."""
    lines = ["| context | batch | teacher ms/token | student ms/token | speed-up | teacher cache MiB "
             "| student state MiB |", "| --- " * 7 + "|"]
    for teacher, student in rows:
        lines.append(f"| {teacher.context} | {teacher.batch} | {teacher.ms_per_token:.2f} | "
                     f"{student.ms_per_token:.2f} | {teacher.ms_per_token / student.ms_per_token:.2f}x | "
                     f"{_mib(teacher.cache_bytes)} | {_mib(student.cache_bytes)} |")
    return "\n".join(lines)


def verdict(rows: list[tuple[DecodeSpeed, DecodeSpeed]]) -> list[str]:
    """The three targets, per batch size, with the measured figures."""
    out = []
    for batch in sorted({t.batch for t, _ in rows}):
        cells = sorted((t for t in rows if t[0].batch == batch), key=lambda t: t[0].context)
        (_, s_lo), (t_hi, s_hi) = cells[0], cells[-1]
        growth = s_hi.ms_per_token / s_lo.ms_per_token
        speedup = t_hi.ms_per_token / s_hi.ms_per_token
        out.append(f"batch {batch}: student ms/token x{growth:.2f} from {s_lo.context} to {s_hi.context} "
                   f"(target < 1.2: {'ok' if growth < 1.2 else 'MISSED'}); {speedup:.2f}x faster than the "
                   f"teacher at {s_hi.context} (target >= 2: {'ok' if speedup >= 2 else 'MISSED'}); state "
                   f"{_mib(s_lo.cache_bytes)} -> {_mib(s_hi.cache_bytes)} MiB "
                   f"({'flat' if s_hi.cache_bytes == s_lo.cache_bytes else 'GROWS'})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per cell")
    parser.add_argument("--repeats", type=int, default=3, help="teacher/student alternations per cell")
    parser.add_argument("--quick", action="store_true", help="contexts 64 and 256, batch 1, 4 steps, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.steps, args.repeats = [64, 256], [1], 4, 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; teacher: random Llama {CONFIG}")
    with tempfile.TemporaryDirectory(prefix="distill-bench-inference-") as out_dir:
        teacher, student = build_models(out_dir)
        rows = []
        for batch in args.batches:
            for context in args.contexts:
                pair = measure_cell(teacher, student, context, batch, args.steps, args.repeats)
                rows.append(pair)
                print(f"  context {context:>5} batch {batch}: teacher {pair[0].ms_per_token:.2f} ms, "
                      f"student {pair[1].ms_per_token:.2f} ms", flush=True)
    print()
    print(table(rows))
    print()
    print("\n".join(verdict(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
