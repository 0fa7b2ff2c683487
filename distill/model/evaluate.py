"""How much a student loses against its teacher on held-out chunks.

Two kinds of metric, picked from the teacher:
    "lm":      perplexity, exp(mean next-token NLL), for teachers with an LM head.
    "encoder": mean cosine similarity between the teacher's and the student's final
               hidden states over all tokens (BERT, or any teacher without an LM head);
               the teacher scores 1.0 against itself.

Besides the student with every replacement spliced in, each replacement is also
scored spliced in *alone*, which tells which layer's error costs most. All of this is
computed from one pass per batch: the teacher's layer inputs are cached, so splicing
layer l alone only re-runs layers l..L-1 (replacement, then teacher layers, then head),
and the full student starts from the cached input of its first replaced layer.

Shape legend:
    N: number of chunks
    B: batch size
    T: tokens per chunk
    D: hidden size
    V: vocabulary size
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from distill.model.teacher import Teacher, call_in_own_dtype

log = logging.getLogger(__name__)

KINDS = ("lm", "encoder")
"""Values of `EvalResult.kind`."""

_LOGITS_CHUNK_TOKENS = 1024
"""Positions turned into logits at once: bounds memory at chunk * V floats (large vocabularies)."""

_MAX_LOG_FLOAT = math.log(sys.float_info.max)

Layer = nn.Module | Callable[[torch.Tensor], torch.Tensor]
"""A teacher layer (run through `teacher.run_layer`) or a replacement (hidden_BTD -> hidden_BTD)."""


@dataclass
class EvalResult:
    """Teacher vs student on held-out data; higher ppl / lower cosine is worse."""

    kind: str
    """"lm" (values are perplexities) or "encoder" (mean cosine similarities)."""
    teacher: float
    """Teacher perplexity, or 1.0 for the encoder cosine."""
    student: float
    """All replacements spliced in."""
    per_layer: dict[int, float]
    """Each replacement spliced alone into the teacher: the error it causes by itself."""
    num_tokens: int
    """Tokens scored: predicted next tokens for "lm", all tokens for "encoder"."""
    identity: float | None = None
    """The teacher with every replaced layer skipped (an identity in its place): the floor
    a replacement must beat; it shows how much work those layers do."""
    per_layer_layer_stages: dict[int, float] | None = None
    """After an end-to-end stage: the layer stages' replacements spliced alone (``per_layer``
    then scores the end-to-end-trained ones, those of the exported student)."""
    per_layer_tokens: int | None = None
    """Tokens the spliced-alone scores were measured on, where fewer than ``num_tokens`` (a deep
    student: see `per_layer_batches`); None when on all of them."""
    per_layer_teacher: float | None = None
    """The teacher's score on those ``per_layer_tokens`` alone, what the spliced-alone scores
    compare to (a few chunks' perplexity is not the whole held-out set's); None with them."""

    def to_dict(self) -> dict:
        """A JSON-ready dict (per_layer keys become strings there, as JSON requires)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> EvalResult:
        """Inverse of `to_dict`, also after a JSON round trip (string layer keys)."""
        before = data.get("per_layer_layer_stages")
        return cls(
            kind=data["kind"],
            teacher=float(data["teacher"]),
            student=float(data["student"]),
            per_layer=_by_int(data["per_layer"]),
            num_tokens=int(data["num_tokens"]),
            identity=None if data.get("identity") is None else float(data["identity"]),
            per_layer_layer_stages=None if before is None else _by_int(before),
            per_layer_tokens=None if data.get("per_layer_tokens") is None else int(data["per_layer_tokens"]),
            per_layer_teacher=None if data.get("per_layer_teacher") is None else float(data["per_layer_teacher"]),
        )

    @property
    def relative_gap(self) -> float:
        """student / teacher - 1: the student's ppl increase, or its cosine drop (negative)."""
        return self.student / self.teacher - 1.0


def _by_int(values: dict) -> dict[int, float]:
    """Per-layer values with int keys (JSON gives str ones)."""
    return {int(idx): float(value) for idx, value in values.items()}


# ---------------------------------------------------------------------- evaluate


def evaluate(
    teacher: Teacher,
    replacements: dict[int, nn.Module],
    heldout_NT: torch.Tensor,
    batch_size: int = 8,
    max_chunks: int | None = None,
) -> EvalResult:
    """Score the teacher, the full student and each replacement alone on `heldout_NT`.

    Replacements are put in eval mode for the duration and restored afterwards, so this
    can be called in the middle of training.
    """
    heldout_NT = _checked_chunks(heldout_NT, batch_size, max_chunks)
    kind = metric_kind(teacher)
    totals = _Totals(sorted(replacements))
    batches = heldout_NT.split(batch_size)
    alone_batches = per_layer_batches(len(batches), teacher.num_layers, list(replacements))
    with torch.no_grad(), _eval_mode(teacher.model, *replacements.values()):
        for batch_idx, batch_BT in enumerate(tqdm(batches, desc="evaluate", unit="batch", leave=False,
                                                  disable=len(batches) < 2)):
            _score_batch(teacher, replacements, batch_BT.to(teacher.device), kind, totals,
                         alone=batch_idx < alone_batches)
    result = totals.result(kind)
    log.info(
        "eval (%s, %d tokens): teacher %.4f, student %.4f, per layer %s",
        kind,
        result.num_tokens,
        result.teacher,
        result.student,
        {idx: round(value, 4) for idx, value in result.per_layer.items()},
    )
    return result


def per_layer_batches(num_batches: int, num_layers: int, replaced: list[int]) -> int:
    """On how many batches to score each replacement spliced alone: all of them while that costs
    no more than the teacher and student passes, else as many as fit that cost (at least one).

    Splicing layer l alone re-runs layers l..L-1, so scoring every replacement of a deep student
    costs about L/2 passes of the model per batch against about 3 for the teacher, the student
    and the identity baseline: 15x the whole evaluation for 30 replaced layers (24 minutes on a
    CPU for SmolLM2), for a column whose order between layers settles on far fewer tokens.
    """
    if not replaced:
        return num_batches
    first = min(replaced)
    main_cost = num_layers + 2 * (num_layers - first)
    alone_cost = sum(num_layers - idx for idx in replaced)
    if alone_cost <= main_cost:
        return num_batches
    return max(1, math.ceil(num_batches * main_cost / alone_cost))


def metric_kind(teacher: Teacher) -> str:
    """Which metric fits the teacher: "lm" if it predicts tokens (has an LM head), else "encoder"."""
    if teacher.family == "llama" and teacher.model.get_output_embeddings() is not None:
        return "lm"
    return "encoder"


def _score_batch(
    teacher: Teacher,
    replacements: dict[int, nn.Module],
    batch_BT: torch.Tensor,
    kind: str,
    totals: _Totals,
    alone: bool = True,
) -> None:
    """Add one batch's teacher, student and (with `alone`) spliced-alone scores to `totals`."""
    inputs = _teacher_layer_inputs(teacher, batch_BT)  # inputs[l] enters layer l; [-1] is output
    teacher_final_BTD = teacher.final_hidden(inputs[-1])
    score = _scorer(teacher, kind, batch_BT, teacher_final_BTD)
    teacher_score = score(inputs[-1])
    totals.add_teacher(teacher_score, _num_scored(kind, batch_BT))
    if not replacements:
        totals.add_student(teacher_score)
        return
    first_idx = min(replacements)
    layers = student_layers(teacher, replacements)
    totals.add_student(score(_run_layers(teacher, layers, inputs[first_idx], first_idx)))
    skipped = student_layers(teacher, dict.fromkeys(replacements, _identity))
    totals.add_identity(score(_run_layers(teacher, skipped, inputs[first_idx], first_idx)))
    if not alone:
        return
    totals.add_alone_tokens(_num_scored(kind, batch_BT), teacher_score)
    for idx, replacement in replacements.items():
        alone_BTD = _run_layers(
            teacher, _spliced_alone(teacher, idx, replacement), inputs[idx], idx
        )
        totals.add_layer(idx, score(alone_BTD))


def _teacher_layer_inputs(teacher: Teacher, batch_BT: torch.Tensor) -> list[torch.Tensor]:
    """[embeddings, output of layer 0, ..., output of layer L-1]: L+1 hidden_BTD tensors."""
    hidden_BTD = teacher.embed(batch_BT)
    inputs = [hidden_BTD]
    for layer in teacher.layers:
        hidden_BTD = teacher.run_layer(layer, hidden_BTD)
        inputs.append(hidden_BTD)
    return inputs


def _scorer(
    teacher: Teacher, kind: str, batch_BT: torch.Tensor, teacher_final_BTD: torch.Tensor
) -> Callable[[torch.Tensor], float]:
    """Maps the last layer's output to the batch's summed score (NLL or cosine)."""
    if kind == "lm":
        return lambda hidden_BTD: _nll_sum(teacher.final_logits, hidden_BTD, batch_BT)
    return lambda hidden_BTD: _cosine_sum(teacher.final_hidden(hidden_BTD), teacher_final_BTD)


def _num_scored(kind: str, batch_BT: torch.Tensor) -> int:
    """Positions a batch contributes: next-token targets for "lm", all tokens otherwise."""
    batch_size, seq_len = batch_BT.shape
    return batch_size * (seq_len - 1) if kind == "lm" else batch_size * seq_len


class _Totals:
    """Running sums of per-token scores; turns them into an EvalResult at the end."""

    def __init__(self, layer_idxs: list[int]) -> None:
        self.num_tokens = 0
        self.teacher = 0.0
        self.student = 0.0
        self.identity: float | None = None
        self.per_layer = dict.fromkeys(layer_idxs, 0.0)
        self.alone_tokens = 0
        self.alone_teacher = 0.0

    def add_teacher(self, score_sum: float, num_tokens: int) -> None:
        self.teacher += score_sum
        self.num_tokens += num_tokens

    def add_student(self, score_sum: float) -> None:
        self.student += score_sum

    def add_identity(self, score_sum: float) -> None:
        self.identity = (self.identity or 0.0) + score_sum

    def add_layer(self, idx: int, score_sum: float) -> None:
        self.per_layer[idx] += score_sum

    def add_alone_tokens(self, num_tokens: int, teacher_sum: float) -> None:
        self.alone_tokens += num_tokens
        self.alone_teacher += teacher_sum

    def result(self, kind: str) -> EvalResult:
        """Per-token means; perplexity (exp of the mean NLL) for "lm"."""
        subset = 0 < self.alone_tokens < self.num_tokens
        return EvalResult(
            kind=kind,
            teacher=self._finish(kind, self.teacher),
            student=self._finish(kind, self.student),
            per_layer={idx: self._finish(kind, total, self.alone_tokens) for idx, total in self.per_layer.items()},
            num_tokens=self.num_tokens,
            identity=None if self.identity is None else self._finish(kind, self.identity),
            per_layer_tokens=self.alone_tokens if subset else None,
            per_layer_teacher=self._finish(kind, self.alone_teacher, self.alone_tokens) if subset else None,
        )

    def _finish(self, kind: str, total: float, num_tokens: int | None = None) -> float:
        mean = total / (num_tokens or self.num_tokens)
        return _exp(mean) if kind == "lm" else mean


def spliced_alone_kl(
    teacher: Teacher, replacements: dict[int, nn.Module], heldout_NT: torch.Tensor, batch_size: int = 8
) -> dict[int, float]:
    """{l: mean per-token KL(teacher || teacher with only layer l replaced)} of the next-token
    distribution on `heldout_NT`: how far each replacement alone moves the model's output
    (0 for a perfect one), measured against the teacher rather than the data."""
    if metric_kind(teacher) != "lm":
        raise ValueError(f"spliced_alone_kl needs a teacher with an LM head; {teacher.name_or_path} has none")
    heldout_NT = _checked_chunks(heldout_NT, batch_size, None)
    sums, num_tokens = dict.fromkeys(replacements, 0.0), 0
    with torch.no_grad(), _eval_mode(teacher.model, *replacements.values()):
        for batch_BT in tqdm(heldout_NT.split(batch_size), desc="each layer alone (KL)", unit="batch", leave=False,
                             dynamic_ncols=True):
            inputs = _teacher_layer_inputs(teacher, batch_BT.to(teacher.device))
            teacher_ND = inputs[-1].flatten(0, 1)
            for idx, replacement in replacements.items():
                alone_BTD = _run_layers(teacher, _spliced_alone(teacher, idx, replacement), inputs[idx], idx)
                sums[idx] += _kl_sum(teacher.final_logits, teacher_ND, alone_BTD.flatten(0, 1))
            num_tokens += batch_BT.numel()
    return {idx: total / num_tokens for idx, total in sums.items()}


# ---------------------------------------------------------------------- reference path


def perplexity(
    teacher: Teacher, layers: Sequence[Layer], heldout_NT: torch.Tensor, batch_size: int = 8
) -> float:
    """exp(mean next-token NLL) of embeddings -> `layers` -> the teacher's LM head.

    The plain, unshared path (no caching), public so tests can check `evaluate` against
    it. `layers[i]` is a module of `teacher.layers` or any callable hidden_BTD -> hidden_BTD.
    """
    if metric_kind(teacher) != "lm":
        raise ValueError(
            f"perplexity needs a teacher with an LM head; `teacher.name_or_path="
            f"{teacher.name_or_path}` has none. Use evaluate(), which scores it by cosine."
        )
    modules = [m for m in layers if isinstance(m, nn.Module)]
    with _eval_mode(teacher.model, *modules):
        return perplexity_of(
            lambda batch_BT: _run_layers(teacher, layers, teacher.embed(batch_BT), 0),
            teacher.final_logits, heldout_NT, batch_size, teacher.device)


def perplexity_of(
    hidden_of: Callable[[torch.Tensor], torch.Tensor],
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    heldout_NT: torch.Tensor,
    batch_size: int,
    device: torch.device | str = "cpu",
) -> float:
    """exp(mean next-token NLL) on `heldout_NT` of any causal LM given as two parts.

    `hidden_of(batch_BT)` gives the states the head reads and `logits_of(hidden_ND)` the
    logits of some of them; logits are formed in chunks of positions, never [B, T, V] at
    once. The one definition of held-out perplexity in distill: `evaluate`, `perplexity`
    and the end-to-end stage's validation all go through it or `_nll_sum`.
    """
    heldout_NT = _checked_chunks(heldout_NT, batch_size, None)
    nll_sum, num_tokens = 0.0, 0
    with torch.no_grad():
        for batch_BT in heldout_NT.split(batch_size):
            batch_BT = batch_BT.to(device)
            nll_sum += _nll_sum(logits_of, hidden_of(batch_BT), batch_BT)
            num_tokens += _num_scored("lm", batch_BT)
    return _exp(nll_sum / num_tokens)


def _exp(mean_nll: float) -> float:
    """Perplexity from a mean NLL; inf rather than OverflowError for a broken student."""
    return math.exp(mean_nll) if mean_nll < _MAX_LOG_FLOAT else math.inf


# ---------------------------------------------------------------------- layer stacks


def score_student(
    base: Teacher, replacements: dict[int, nn.Module], heldout_NT: torch.Tensor, batch_size: int
) -> float:
    """Held-out perplexity (LM teachers) or final-hidden cosine of `base` with `replacements`
    spliced in, without the per-layer scores of `evaluate` (`base` may be a student whose
    teacher-side weights were trained, so the two are not the same model)."""
    if metric_kind(base) == "lm":
        return perplexity(base, student_layers(base, replacements), heldout_NT, batch_size)
    return evaluate(base, replacements, heldout_NT, batch_size).student


def _identity(hidden_BTD: torch.Tensor) -> torch.Tensor:
    """A skipped layer."""
    return hidden_BTD


def student_layers(teacher: Teacher, replacements: dict[int, Layer]) -> list[Layer]:
    """All L layers of the student: replacements where given, teacher layers elsewhere."""
    return [replacements.get(idx, layer) for idx, layer in enumerate(teacher.layers)]


def _spliced_alone(teacher: Teacher, idx: int, replacement: nn.Module) -> list[Layer]:
    """All L layers of the teacher with only layer `idx` replaced."""
    layers: list[Layer] = list(teacher.layers)
    layers[idx] = replacement
    return layers


def _run_layers(
    teacher: Teacher, layers: Sequence[Layer], hidden_BTD: torch.Tensor, start_idx: int
) -> torch.Tensor:
    """Run layers[start_idx:] on `hidden_BTD`, the input of layer `start_idx`; the stream
    stays in the teacher's dtype, replacements compute in their own (`call_in_own_dtype`)."""
    teacher_layer_ids = {id(layer) for layer in teacher.layers}
    for layer in layers[start_idx:]:
        if id(layer) in teacher_layer_ids:
            hidden_BTD = teacher.run_layer(layer, hidden_BTD)
        elif isinstance(layer, nn.Module):
            hidden_BTD = call_in_own_dtype(layer, hidden_BTD)
        else:
            hidden_BTD = layer(hidden_BTD)
    return hidden_BTD


# ---------------------------------------------------------------------- scores


def _nll_sum(
    logits_of: Callable[[torch.Tensor], torch.Tensor], hidden_BTD: torch.Tensor, batch_BT: torch.Tensor
) -> float:
    """Summed next-token NLL (float32) of `hidden_BTD` through `logits_of`, in position chunks."""
    hidden_ND = hidden_BTD[:, :-1].flatten(0, 1)
    targets_N = batch_BT[:, 1:].flatten()
    total = 0.0
    for start in range(0, len(targets_N), _LOGITS_CHUNK_TOKENS):
        end = start + _LOGITS_CHUNK_TOKENS
        logits_NV = logits_of(hidden_ND[start:end]).float()
        total += F.cross_entropy(logits_NV, targets_N[start:end], reduction="sum").item()
    return total


def _kl_sum(
    logits_of: Callable[[torch.Tensor], torch.Tensor], teacher_ND: torch.Tensor, student_ND: torch.Tensor
) -> float:
    """Summed per-position KL(teacher || student) (float32) of the logits of two hidden states."""
    total = 0.0
    for start in range(0, len(teacher_ND), _LOGITS_CHUNK_TOKENS):
        end = start + _LOGITS_CHUNK_TOKENS
        logp_t_NV = F.log_softmax(logits_of(teacher_ND[start:end]).float(), dim=-1)
        logp_s_NV = F.log_softmax(logits_of(student_ND[start:end]).float(), dim=-1)
        total += (logp_t_NV.exp() * (logp_t_NV - logp_s_NV)).sum().item()
    return total


def _cosine_sum(student_BTD: torch.Tensor, teacher_BTD: torch.Tensor) -> float:
    """Summed per-token cosine similarity (float32) of two final hidden states."""
    return F.cosine_similarity(student_BTD.float(), teacher_BTD.float(), dim=-1).sum().item()


# ---------------------------------------------------------------------- plumbing


def _checked_chunks(
    heldout_NT: torch.Tensor, batch_size: int, max_chunks: int | None
) -> torch.Tensor:
    """The first `max_chunks` chunks; rejects empty data and bad sizes with the fix."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    if max_chunks is not None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks={max_chunks} must be >= 1, or None for all chunks.")
        heldout_NT = heldout_NT[:max_chunks]
    if heldout_NT.ndim != 2 or len(heldout_NT) == 0 or heldout_NT.shape[1] < 2:
        raise ValueError(
            f"Held-out chunks of shape {tuple(heldout_NT.shape)} cannot be scored: need at least "
            "one chunk of >= 2 tokens. Raise `data.heldout_fraction` or `data.max_heldout_chunks`."
        )
    return heldout_NT


@contextlib.contextmanager
def _eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Every module (and submodule) in eval mode inside the block, as it was afterwards."""
    saved = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, training in saved:
            module.training = training
