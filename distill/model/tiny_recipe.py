"""What names a tiny teacher: its recipe (every argument that changes the weights) and the
tokens its vocabulary starts with.

Kept apart from the pre-training (``tiny.py``, which needs transformers) so that looking a
cached teacher up (``tiny_cache.py``) costs no heavy import: ``mode=local``'s supervisor and
every worker and student do that at start-up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

RECIPE_VERSION = 1
"""Bump when the training recipe changes, so that stale caches are not reused."""

METRICS_FILE = "distill_tiny.json"
"""Written into the cached directory: arguments, held-out loss before/after, timings."""

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
"""The tiny BERT's mask token (masked-LM pre-training); the tiny Llama has none."""
NUM_BYTE_TOKENS = 256
"""The byte-level alphabet every BPE vocabulary starts from."""


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the cached teacher; its hash names the cache dir."""

    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int
    vocab_size: int
    train_steps: int
    batch_size: int
    lr: float
    seed: int
    recipe_version: int = RECIPE_VERSION

    def digest(self) -> str:
        """A short, stable hash of the recipe."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


BERT_RECIPE_VERSION = 1
"""Bump when the tiny BERT's pre-training recipe changes."""

BERT_TRAIN_STEPS = 800
"""Masked-LM steps of the default tiny BERT (about a minute on 2 idle CPU cores)."""

MASK_PROB = 0.15
"""Share of tokens the masked-LM loss predicts (BERT's)."""


@dataclass(frozen=True)
class TinyBertRecipe:
    """Everything that determines the cached tiny BERT; its hash names the cache dir."""

    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int
    vocab_size: int
    train_steps: int
    batch_size: int
    lr: float
    seed: int
    mask_prob: float = MASK_PROB
    recipe_version: int = BERT_RECIPE_VERSION

    def digest(self) -> str:
        """A short, stable hash of the recipe."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def check_recipe(recipe: TinyRecipe | TinyBertRecipe, rotary: bool) -> None:
    """Reject arguments that cannot build a teacher, naming the argument and the fix."""
    specials = special_tokens(mask=not rotary)
    min_vocab = NUM_BYTE_TOKENS + len(specials)
    if recipe.vocab_size < min_vocab:
        raise ValueError(
            f"`vocab_size={recipe.vocab_size}` is too small: a byte-level BPE needs at least "
            f"{min_vocab} (256 bytes + {' + '.join(specials)})."
        )
    if recipe.hidden_size % recipe.num_heads or (rotary and (recipe.hidden_size // recipe.num_heads) % 2):
        raise ValueError(
            f"`hidden_size={recipe.hidden_size}` must split into `num_heads={recipe.num_heads}` "
            + ("heads of even size (rotary embeddings rotate pairs)." if rotary else "heads.")
        )
    if min(recipe.num_layers, recipe.seq_len, recipe.train_steps, recipe.batch_size) < 1:
        raise ValueError("`num_layers`, `seq_len`, `train_steps` and `batch_size` must be >= 1.")


def special_tokens(mask: bool) -> tuple[str, ...]:
    """The special tokens of a tiny teacher's vocabulary, first in it."""
    return (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN) if mask else (EOS_TOKEN, PAD_TOKEN)
