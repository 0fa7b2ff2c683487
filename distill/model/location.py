"""Where a model lives: a local directory or a hub name, and its config without its weights.

One rule decides whether ``teacher.name_or_path`` means a local path, and
:func:`teacher_source` says where the configured teacher is (that path or hub name, or
the cached tiny teacher, built on first use). Both serve the start-up checks and
``mode=local``'s supervisor, which must stay fast (the checks run in every mode, the
broker included), so this module imports neither torch nor transformers at import time;
:meth:`distill.model.teacher.Teacher.from_pretrained` uses the same rule.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig

from distill.config import Family
from distill.model.tiny_cache import tiny_bert_dir, tiny_teacher_dir


def looks_like_local_path(name: str) -> bool:
    """Hub names are ``model`` or ``org/model``; anything else is meant as a local path."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith("/")
        or name.count("/") > 1
        or "\\" in name
        or os.path.isabs(name)
    )


def check_exists(name_or_path: str) -> str:
    """``name_or_path`` with ``~`` expanded; a ValueError naming the key if a local path is missing."""
    path = os.path.expanduser(str(name_or_path))
    if looks_like_local_path(str(name_or_path)) and not os.path.exists(path):
        raise ValueError(
            f"teacher.name_or_path={name_or_path!r} does not exist; give a model directory "
            "(with config.json) or a hub name such as Qwen/Qwen2-0.5B"
        )
    return path


def teacher_source(cfg: DictConfig) -> str:
    """The directory or hub name of the teacher, building the tiny one on first use."""
    if cfg.teacher.name_or_path:
        return str(cfg.teacher.name_or_path)
    tiny = cfg.teacher.tiny
    shape = {"hidden_size": tiny.hidden_size, "num_layers": tiny.num_layers, "num_heads": tiny.num_heads,
             "seq_len": cfg.data.seq_len, "vocab_size": tiny.vocab_size}
    steps = {"train_steps": tiny.train_steps} if tiny.train_steps is not None else {}
    if tiny.family == Family.bert:
        return tiny_bert_dir(cfg.teacher.cache_dir, **shape, **steps)
    return tiny_teacher_dir(cfg.teacher.cache_dir, **shape, **steps)


def read_config(name_or_path: str) -> dict[str, Any]:
    """The model's config as a dict: config.json of a local directory, else the hub's."""
    path = check_exists(name_or_path)
    config_file = os.path.join(path, "config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            return json.load(f)
    # Lazy: only a hub name needs transformers here, and the broker's start must not pay for it.
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(name_or_path)).to_dict()


def has_lm_head(name_or_path: str) -> bool:
    """Whether the model's config names a causal-LM class (one with an LM head), as
    :func:`distill.model.teacher.model_class` would load it."""
    return any(str(name).endswith("ForCausalLM") for name in read_config(name_or_path).get("architectures") or [])


def model_shape(name_or_path: str) -> tuple[int, int]:
    """(num_layers, hidden_size) of a model, read from its config, without loading weights."""
    config = read_config(name_or_path)
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    hidden = config.get("hidden_size") or config.get("n_embd")
    if not layers or not hidden:
        raise ValueError(f"teacher.name_or_path={name_or_path!r}: config.json has no "
                         "num_hidden_layers/hidden_size")
    return int(layers), int(hidden)
