"""Where a model lives: a local directory, a hub name or a GGUF file, and its config without its weights.

One rule decides whether ``teacher.name_or_path`` means a local path; :func:`teacher_model`
says which model the teacher keys name (a directory, a hub name or a ``.gguf`` file, the
last also as ``teacher.gguf_file`` in a directory or in an installed package's), and
:func:`teacher_source` where the processes load it from (that directory or hub name, the
GGUF file converted once to an HF directory, or the cached tiny teacher, built on first
use). They serve the start-up checks and ``mode=local``'s supervisor, which must stay fast
(the checks run in every mode, the broker included), so this module imports neither torch
nor transformers at import time; :meth:`distill.model.teacher.Teacher.from_pretrained` uses
the same rule. A GGUF file's config comes from its metadata (``gguf_cache.gguf_config``), so
the checks read it without converting anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from distill.config import Config, Family
from distill.model.gguf_cache import REAL_EXTRA, gguf_config, gguf_teacher_dir, require_gguf_support
from distill.model.tiny_cache import tiny_bert_dir, tiny_teacher_dir

GGUF_SUFFIX = ".gguf"


def looks_like_local_path(name: str) -> bool:
    """Hub names are ``model`` or ``org/model``; anything else is meant as a local path."""
    return (
        is_gguf(name)
        or name.startswith((".", "/", "~"))
        or name.endswith("/")
        or name.count("/") > 1
        or "\\" in name
        or os.path.isabs(name)
    )


def is_gguf(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF file (by its suffix, as llama.cpp names them)."""
    return str(name_or_path).lower().endswith(GGUF_SUFFIX)


def check_exists(name_or_path: str) -> str:
    """``name_or_path`` with ``~`` expanded; a ValueError naming the key if a local path is missing."""
    path = os.path.expanduser(str(name_or_path))
    if looks_like_local_path(str(name_or_path)) and not os.path.exists(path):
        raise ValueError(
            f"teacher.name_or_path={name_or_path!r} does not exist; give a model directory "
            "(with config.json), a .gguf file or a hub name such as Qwen/Qwen2-0.5B"
        )
    return path


def teacher_model(cfg: Config) -> str | None:
    """The model the teacher keys name: a directory, a hub name or a ``.gguf`` file (None: the tiny
    teacher). ``teacher.gguf_file`` is a file in ``teacher.name_or_path``'s directory, or in the
    directory of the installed package ``teacher.gguf_package`` (teacher=smollm2)."""
    teacher = cfg.teacher
    name_or_path, gguf_file = teacher.name_or_path, teacher.gguf_file
    package = teacher.gguf_package
    if package:
        if name_or_path or not gguf_file:
            raise ValueError(f"teacher.gguf_package={package!r} names the package holding teacher.gguf_file: "
                             f"set teacher.gguf_file (got {gguf_file!r}) and leave teacher.name_or_path null "
                             f"(got {name_or_path!r})")
        return os.path.join(_package_dir(str(package)), str(gguf_file))
    if gguf_file:
        directory = os.path.expanduser(str(name_or_path or ""))
        if not os.path.isdir(directory):
            raise ValueError(f"teacher.gguf_file={gguf_file!r} is a file in the directory teacher.name_or_path, "
                             f"and {name_or_path!r} is not a local directory: give the directory holding it, or "
                             "the .gguf file's path as teacher.name_or_path (then no gguf_file)")
        return os.path.join(directory, str(gguf_file))
    return str(name_or_path) if name_or_path else None


def _package_dir(package: str) -> str:
    """The directory of an installed Python package (found by importlib, never imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"teacher.gguf_package={package!r} is not installed; teacher=smollm2's package "
                         f"comes with the real-model extra: {REAL_EXTRA}")
    return str(next(iter(spec.submodule_search_locations)))


def teacher_source(cfg: Config) -> str:
    """The directory or hub name the processes load the teacher from, building on first use the
    tiny teacher or the HF directory of a GGUF teacher (in the distill cache, once per file)."""
    model = teacher_model(cfg)
    if model is not None and is_gguf(model):
        path = check_exists(model)
        require_gguf_support(path)
        return gguf_teacher_dir(cfg.teacher.cache_dir, path)
    if model is not None:
        return model
    tiny = cfg.teacher.tiny
    shape = {"hidden_size": tiny.hidden_size, "num_layers": tiny.num_layers, "num_heads": tiny.num_heads,
             "seq_len": cfg.data.seq_len, "vocab_size": tiny.vocab_size}
    steps = {"train_steps": tiny.train_steps} if tiny.train_steps is not None else {}
    if tiny.family == Family.bert:
        return tiny_bert_dir(cfg.teacher.cache_dir, **shape, **steps)
    return tiny_teacher_dir(cfg.teacher.cache_dir, **shape, **steps)


def read_config(name_or_path: str) -> dict[str, Any]:
    """The model's config as a dict: config.json of a local directory, a GGUF file's metadata, else the hub's."""
    path = check_exists(name_or_path)
    if is_gguf(path):
        return gguf_config(path).to_dict()
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
