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

``--assist``: assisted (speculative) decoding, the student drafting for its teacher. In one
run, per prompt, the teacher generates ``--new-tokens`` greedily alone and then with the
student as ``assistant_model`` (``teacher.generate(ids, assistant_model=student,
do_sample=False)``, transformers' defaults: up to 20 drafted tokens a round, drafting stops
after the first token the student gives less than 0.4 probability, a threshold that adapts
only where scikit-learn is installed, not here), alternated ``--repeats``
times, the median of each kept. Two pairs, batch 1: (i) ``random``, the random Llama above and
its untrained all-linear-attention student, on random-id prompts; (ii) ``run``, with
``--assist-run DIR``, the teacher a ``python -m distill mode=local`` run distilled (the
``teacher_source`` of ``DIR/student/distill_student.json``, loaded with
``AutoModelForCausalLM``) and its exported ``DIR/student``, on the first ``--prompt-tokens``
tokens of the held-out pydoc topics (the run's tokenizer; random ids if it saved none); without
a run directory the pair is skipped and the output says so. Printed per pair: ms per generated
token of each mode (``generate``'s wall time, the prompt's prefill included, over the new
tokens), the speed-up, the acceptance rate (accepted / drafted tokens), tokens per teacher
forward, and whether the assisted tokens equal the teacher's own greedy ones (exit code 1 if
not). Counted with forward hooks (``tallying_forwards``), no transformers internals: every
student forward in an assisted ``generate`` drafts one token; every teacher forward verifies
one draft and adds one token of its own, so accepted = new tokens - teacher forwards.

Run it from the repository root (about a minute each)::

    flock /tmp/distill-cpu.lock python bench/inference.py
    python bench/inference.py --quick      # smoke run: contexts 64 and 256, batch 1
    flock /tmp/distill-cpu.lock python bench/inference.py --assist --assist-run outputs/<date>/<time>
    python bench/inference.py --assist --quick     # 1 prompt, 16 new tokens, 1 repeat
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from pydoc_data.topics import topics
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from distill.model.assemble import STUDENT_FILE, export_student, load_student
from distill.model.assist import AssistRun, Forwards, generate_greedy, measure_assist, summarise
from distill.model.data import DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED, split_documents
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
    parser.add_argument("--quick", action="store_true", help="contexts 64 and 256, batch 1, 4 steps, 1 repeat "
                        "(--assist: 1 prompt, 16 new tokens, 1 repeat)")
    parser.add_argument("--assist", action="store_true", help="the teacher alone against the teacher assisted by "
                        "its student (assisted decoding)")
    parser.add_argument("--assist-run", metavar="DIR", help="--assist: also a `python -m distill mode=local` run "
                        "directory's teacher and student")
    parser.add_argument("--prompts", type=int, default=ASSIST_PROMPTS, help="--assist: prompts per pair")
    parser.add_argument("--prompt-tokens", type=int, default=ASSIST_PROMPT_TOKENS, help="--assist: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=ASSIST_NEW_TOKENS, help="--assist: tokens generated per prompt")
    args = parser.parse_args(argv)
    if args.assist_run and not args.assist:
        parser.error("--assist-run DIR needs --assist")
    if args.quick:
        args.contexts, args.batches, args.steps, args.repeats = [64, 256], [1], 4, 1
        args.prompts, args.new_tokens = 1, 16
    if args.assist:
        return assist_main(args.assist_run, args.prompts, args.prompt_tokens, args.new_tokens, args.repeats)
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


# ---------------------------------------------------------------------- --assist

ASSIST_PROMPT_TOKENS, ASSIST_NEW_TOKENS, ASSIST_PROMPTS = 64, 64, 4


def random_prompts(vocab_size: int, num_prompts: int, prompt_tokens: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (1, prompt_tokens), generator=gen) for _ in range(num_prompts)]


def text_prompts(tokenizer: Any, num_prompts: int, prompt_tokens: int) -> list[torch.Tensor]:
    """The first ``prompt_tokens`` tokens of the held-out pydoc topics (the default run's split: text
    neither the teacher nor the student trained on), in order, skipping shorter ones."""
    _, heldout = split_documents([topics[key] for key in sorted(topics)], DEFAULT_HELDOUT_FRACTION,
                                 DEFAULT_SPLIT_SEED)
    prompts = []
    for doc in heldout:
        ids_1T = tokenizer(doc, truncation=True, max_length=prompt_tokens, return_tensors="pt").input_ids
        if ids_1T.shape[1] == prompt_tokens:
            prompts.append(ids_1T)
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} held-out pydoc topics have {prompt_tokens} tokens; lower --prompts.")
    return prompts[:num_prompts]


def load_run_pair(run_dir: str) -> tuple[torch.nn.Module, torch.nn.Module, Any, str]:
    """The teacher a ``mode=local`` run distilled (``teacher_source`` of its student's manifest),
    the exported student, the run's tokenizer (None when it saved none) and a description."""
    student_dir = os.path.join(run_dir, "student")
    if not os.path.isfile(os.path.join(student_dir, STUDENT_FILE)):
        raise ValueError(f"--assist-run {run_dir} holds no exported student ({student_dir}/{STUDENT_FILE}); "
                         "pass the run directory of `python -m distill mode=local` (outputs/<date>/<time>).")
    with open(os.path.join(student_dir, STUDENT_FILE)) as f:
        source = json.load(f)["teacher_source"]
    teacher = AutoModelForCausalLM.from_pretrained(source).eval()
    student = load_student(student_dir)
    tokenizer = None
    if any(os.path.isfile(os.path.join(student_dir, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(student_dir, trust_remote_code=True)  # the student's own code
    return teacher, student, tokenizer, f"run {run_dir}: teacher {source} ({teacher.config.num_hidden_layers} layers)"


def assist_pair(name: str, teacher: torch.nn.Module, student: torch.nn.Module, prompts: list[torch.Tensor],
                new_tokens: int, repeats: int) -> tuple[str, list[AssistRun]]:
    """Every prompt of one pair, after an untimed warm-up of both modes."""
    generate_greedy(teacher, prompts[0], 4)
    generate_greedy(teacher, prompts[0], 4, assistant_model=student)
    runs = []
    for idx, prompt_1T in enumerate(prompts):
        run = measure_assist(teacher, student, prompt_1T, new_tokens, repeats)
        runs.append(run)
        print(f"  {name} prompt {idx}: alone {1e3 * run.alone_s / run.new_tokens:.2f} ms/token, assisted "
              f"{1e3 * run.assisted_s / run.new_tokens:.2f} ms/token, accepted {run.accepted}/{run.student.calls}, "
              f"same tokens: {run.same}", flush=True)
    return name, runs


def assist_table(pairs: list[tuple[str, list[AssistRun]]]) -> str:
    """Markdown table: one row per pair, its prompts' tokens and seconds summed (``distill.model.assist.summarise``)."""
    lines = ["| pair | prompts | new tokens | teacher alone ms/token | teacher + student ms/token | speed-up "
             "| accepted / drafted | acceptance | tokens per teacher forward | same tokens as alone |",
             "| --- " * 10 + "|"]
    for name, runs in pairs:
        row = summarise(runs)
        lines.append(f"| {name} | {row['prompts']} | {row['new_tokens']} | {row['alone_ms_per_token']:.2f} | "
                     f"{row['assisted_ms_per_token']:.2f} | {row['speedup']:.2f}x | {row['accepted']} / "
                     f"{row['drafted']} | {row['acceptance']:.1%} | {row['tokens_per_teacher_forward']:.2f} | "
                     f"{row['same']}/{row['prompts']} |")
    return "\n".join(lines)


def time_split_table(pairs: list[tuple[str, list[AssistRun]]]) -> str:
    """Markdown table: where each mode's time went, in ms per generated token, then ms per forward."""
    lines = ["| pair | alone: teacher forwards | alone: rest of generate | assisted: teacher forwards "
             "| assisted: student forwards | assisted: rest of generate | ms per teacher forward alone "
             "| ms per teacher forward verifying | ms per student forward drafting |", "| --- " * 9 + "|"]
    for name, runs in pairs:
        tokens = sum(r.new_tokens for r in runs)
        alone, teacher, student = (Forwards(sum(getattr(r, key).calls for r in runs),
                                            sum(getattr(r, key).seconds for r in runs))
                                   for key in ("alone", "teacher", "student"))
        alone_s, assisted_s = sum(r.alone_s for r in runs), sum(r.assisted_s for r in runs)
        per_token = [alone.seconds, alone_s - alone.seconds, teacher.seconds, student.seconds,
                     assisted_s - teacher.seconds - student.seconds]
        per_call = [f.seconds / max(f.calls, 1) for f in (alone, teacher, student)]
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * s / tokens:.2f}" for s in per_token) + " | "
                     + " | ".join(f"{1e3 * s:.2f}" for s in per_call) + " |")
    return "\n".join(lines)


def assist_main(run_dir: str | None, num_prompts: int, prompt_tokens: int, new_tokens: int, repeats: int) -> int:
    """Pair (i), the random Llama and its untrained student; pair (ii), a run's teacher and student."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {num_prompts} prompts of {prompt_tokens} "
          f"tokens, {new_tokens} new tokens each, batch 1, median of {repeats}")
    run_pair = load_run_pair(run_dir) if run_dir is not None else None  # a wrong DIR fails before the timing
    pairs = []
    with tempfile.TemporaryDirectory(prefix="distill-bench-assist-") as out_dir:
        teacher, student = build_models(out_dir)
        prompts = random_prompts(teacher.config.vocab_size, num_prompts, prompt_tokens)
        pairs.append(assist_pair("random", teacher, student, prompts, new_tokens, repeats))
    if run_pair is None:
        print("  run: skipped (no --assist-run DIR; pass a `python -m distill mode=local` run directory)")
    else:
        teacher, student, tokenizer, described = run_pair
        print(f"  {described}; prompts: {'held-out pydoc text' if tokenizer else 'random ids (no tokenizer)'}")
        prompts = (text_prompts(tokenizer, num_prompts, prompt_tokens) if tokenizer is not None
                   else random_prompts(teacher.config.vocab_size, num_prompts, prompt_tokens))
        pairs.append(assist_pair("run", teacher, student, prompts, new_tokens, repeats))
    print()
    print(assist_table(pairs))
    print()
    print(time_split_table(pairs))
    same = all(r.same for _, runs in pairs for r in runs)
    print(f"\nassisted tokens equal the teacher's own greedy tokens: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
