"""Decode speed and cache memory of a causal LM at a given context: the student's figure of merit.

A linear-attention student pays O(1) per generated token where its teacher pays O(context):
this measures both the same way. The cache is first made to hold ``context`` positions, then
``steps`` single-token forward steps are timed (after ``warmup`` untimed ones), each feeding
back its argmax as ``generate`` does.

The cache is filled *synthetically*: one real forward of a short prompt builds every cache
layer with its real shapes and dtypes (KV layers, sliding windows, recurrent states), then each
KV layer is given ``context`` random positions (a sliding-window layer only its window) and
every layer's position count set to ``context``. A decode step's cost depends on how many
positions it reads, never on their values, so this times decoding at ``context`` without a
prefill whose cost grows with the context squared (minutes for a softmax teacher at 8k tokens
on a CPU). Bytes are those of the tensors the cache holds after the timed steps.

Shape legend: B batch, T tokens, H heads, S cached positions, E head size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

PROMPT_TOKENS = 4
"""The real prefill that builds every cache layer before it is grown to the context."""


@dataclass
class DecodeSpeed:
    """One model at one context and batch size."""

    context: int
    batch: int
    ms_per_token: float
    """Median milliseconds per decode step (one new token for each of ``batch`` sequences)."""
    cache_bytes: int
    """Bytes of the cache after the timed steps: KV tensors, recurrent states."""

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def measure_decode(
    model: PreTrainedModel, context: int, batch: int = 1, steps: int = 16, warmup: int = 3, seed: int = 0
) -> DecodeSpeed:
    """Time ``steps`` greedy decode steps of ``model`` with ``context`` positions cached."""
    if context < PROMPT_TOKENS:
        raise ValueError(f"context={context} must be at least {PROMPT_TOKENS} positions.")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_BT = torch.randint(0, vocab, (batch, PROMPT_TOKENS), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompt_BT, cache=cache, use_cache=True).logits
    grow_cache(cache, context, gen)
    token_B1 = logits[:, -1:].argmax(-1)
    times_s = []
    for step in range(warmup + steps):
        position_1 = torch.tensor([[context + step]], device=device)
        start = time.perf_counter()
        logits = model(input_ids=token_B1, cache=cache, position_ids=position_1, use_cache=True).logits
        token_B1 = logits[:, -1:].argmax(-1)
        times_s.append(time.perf_counter() - start)
    timed = sorted(times_s[warmup:])
    return DecodeSpeed(context=context, batch=batch, ms_per_token=1e3 * timed[len(timed) // 2],
                       cache_bytes=cache_bytes(cache))


def grow_cache(cache: DynamicCache, context: int, gen: torch.Generator) -> None:
    """Make every layer of ``cache`` hold ``context`` positions (random keys and values)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            window = getattr(layer, "sliding_window", None)
            kept = context if window is None else min(context, window - 1)
            shape_BHSE = (*keys.shape[:2], kept, keys.shape[-1])
            layer.keys = torch.randn(shape_BHSE, generator=gen).to(keys)
            layer.values = torch.randn(shape_BHSE, generator=gen).to(layer.values)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = context
        if hasattr(layer, "recurrent_states"):  # a linear-attention layer: its position count
            layer.cumulative_length_linear.fill_(context)


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes of every tensor the cache holds (keys, values, recurrent and conv states)."""
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "recurrent_states", None), getattr(layer, "conv_states", None)):
            tensors += list((states or {}).values())
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total
