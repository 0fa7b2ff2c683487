"""Assisted (speculative) decoding of a teacher with its student drafting: what it buys.

The student shares its teacher's tokenizer and is cheaper per token at long contexts, so it is
the natural draft model: ``teacher.generate(ids, assistant_model=student)`` gives exactly the
teacher's greedy tokens (the student's cache rolls back past rejected drafts), faster when
drafts are accepted and cheap. This times the teacher generating greedily alone and assisted,
on the same prompts, and counts drafted and accepted tokens with forward hooks (public API,
no transformers internals): every student forward in an assisted ``generate`` drafts one
token; every teacher forward verifies one draft and adds one token of its own, so accepted =
new tokens - teacher forwards.

Used by the run's report (``distill.results.finish``: a few held-out prompts) and by
``bench/inference.py --assist``.

Shape legend: T tokens, N new tokens.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Forwards:
    """Calls of one model while a block ran, and the seconds spent inside them."""

    calls: int = 0
    seconds: float = 0.0


@dataclass
class AssistRun:
    """One prompt generated greedily by the teacher alone and with its student as ``assistant_model``;
    seconds are the median of the repeats, prefill included."""

    new_tokens: int
    alone_s: float
    assisted_s: float
    alone: Forwards
    """Teacher forwards in the run alone: one per token."""
    teacher: Forwards
    """Teacher forwards in the assisted run: each verifies one draft and adds one token of its own."""
    student: Forwards
    """Student forwards in the assisted run: one per drafted token."""
    same: bool
    """The assisted tokens equal the teacher's own greedy tokens."""

    @property
    def accepted(self) -> int:
        return self.new_tokens - self.teacher.calls


@contextlib.contextmanager
def tallying_forwards(model: torch.nn.Module) -> Iterator[Forwards]:
    """Count and time the calls of ``model`` (forward hooks) while the block runs."""
    tally, started = Forwards(), [0.0]

    def before(*_: object) -> None:
        started[0] = time.perf_counter()

    def after(*_: object) -> None:
        tally.calls += 1
        tally.seconds += time.perf_counter() - started[0]
    handles = (model.register_forward_pre_hook(before), model.register_forward_hook(after))
    try:
        yield tally
    finally:
        for handle in handles:
            handle.remove()


def generate_greedy(model: torch.nn.Module, prompt_1T: torch.Tensor, new_tokens: int,
                    **options: object) -> tuple[torch.Tensor, float]:
    """Greedy tokens after the prompt, and the seconds ``generate`` took."""
    pad = model.generation_config.pad_token_id
    started = time.perf_counter()
    with torch.no_grad():
        out_1T = model.generate(prompt_1T, attention_mask=torch.ones_like(prompt_1T), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0 if pad is None else pad,
                                **options)
    return out_1T[:, prompt_1T.shape[1]:], time.perf_counter() - started


def measure_assist(teacher: torch.nn.Module, student: torch.nn.Module, prompt_1T: torch.Tensor, new_tokens: int,
                   repeats: int) -> AssistRun:
    """The teacher alone and assisted, alternated ``repeats`` times; the median of each."""
    alone_s, assisted_s, tallies, same = [], [], [], True
    for _ in range(repeats):
        with tallying_forwards(teacher) as alone:
            alone_1N, seconds = generate_greedy(teacher, prompt_1T, new_tokens)
        alone_s.append(seconds)
        with tallying_forwards(teacher) as verified, tallying_forwards(student) as drafted:
            assisted_1N, seconds = generate_greedy(teacher, prompt_1T, new_tokens, assistant_model=student)
        assisted_s.append(seconds)
        tallies.append((alone, verified, drafted))
        same = same and torch.equal(assisted_1N, alone_1N)
    median = [Forwards(tally.calls, statistics.median(t[idx].seconds for t in tallies))
              for idx, tally in enumerate(tallies[-1])]
    return AssistRun(assisted_1N.shape[1], statistics.median(alone_s), statistics.median(assisted_s), *median, same)


def summarise(runs: list[AssistRun]) -> dict:
    """Prompts' tokens and seconds summed: ms/token alone and assisted, the speed-up, drafted and
    accepted tokens, tokens per teacher forward, and on how many prompts the tokens were the same."""
    tokens = sum(r.new_tokens for r in runs)
    alone_ms, assisted_ms = (1e3 * sum(getattr(r, key) for r in runs) / tokens for key in ("alone_s", "assisted_s"))
    accepted, drafted = sum(r.accepted for r in runs), sum(r.student.calls for r in runs)
    return {"prompts": len(runs), "new_tokens": tokens, "alone_ms_per_token": alone_ms,
            "assisted_ms_per_token": assisted_ms, "speedup": alone_ms / assisted_ms, "accepted": accepted,
            "drafted": drafted, "acceptance": accepted / max(drafted, 1),
            "tokens_per_teacher_forward": tokens / max(sum(r.teacher.calls for r in runs), 1),
            "same": sum(r.same for r in runs)}


def assist_figures(teacher: torch.nn.Module, student: torch.nn.Module, prompts: list[torch.Tensor],
                   new_tokens: int, repeats: int = 1) -> dict:
    """:func:`summarise` of every prompt, after an untimed warm-up of both modes."""
    generate_greedy(teacher, prompts[0], 2)
    generate_greedy(teacher, prompts[0], 2, assistant_model=student)
    return summarise([measure_assist(teacher, student, prompt_1T, new_tokens, repeats) for prompt_1T in prompts])
