"""distill.model.tiny_cache and tiny_recipe: a recipe names one cache entry, bad recipes are
refused before anything is written, and a cache hit imports nothing heavy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.model import tiny_cache, tiny_recipe

SMALL = {
    "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 32,
    "vocab_size": 300, "train_steps": 30, "batch_size": 8,
}


def test_each_argument_has_its_own_cache_entry() -> None:
    base = tiny_recipe.TinyRecipe(**SMALL, lr=3e-3, seed=0)
    assert base.digest() == tiny_recipe.TinyRecipe(**SMALL, lr=3e-3, seed=0).digest()
    assert base.digest() != tiny_recipe.TinyRecipe(**SMALL, lr=3e-3, seed=1).digest()
    assert base.digest() != tiny_recipe.TinyRecipe(**{**SMALL, "train_steps": 31}, lr=3e-3, seed=0).digest()
    bert = tiny_recipe.TinyBertRecipe(**SMALL, lr=3e-3, seed=0)
    assert bert.digest() != base.digest()


def test_cache_root_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DISTILL_CACHE", str(tmp_path))
    assert tiny_cache.cache_root(None) == str(tmp_path)
    assert tiny_cache.cache_root("/x/y") == "/x/y"
    monkeypatch.delenv("DISTILL_CACHE")
    assert tiny_cache.cache_root(None) == os.path.expanduser("~/.cache/distill")


def test_rejects_impossible_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`vocab_size=100`"):
        tiny_cache.tiny_teacher_dir(str(tmp_path), **{**SMALL, "vocab_size": 100})
    with pytest.raises(ValueError, match=r"`hidden_size=30`"):
        tiny_cache.tiny_teacher_dir(str(tmp_path), **{**SMALL, "hidden_size": 30})
    with pytest.raises(ValueError, match=r"`hidden_size=30`"):
        tiny_cache.tiny_bert_dir(str(tmp_path), **{**SMALL, "hidden_size": 30, "num_heads": 4})
    assert not any(tmp_path.iterdir())


HIT = """
import json, sys
from distill.model.tiny_cache import tiny_bert_dir, tiny_teacher_dir
paths = [tiny_teacher_dir(sys.argv[1], **json.loads(sys.argv[2])), tiny_bert_dir(sys.argv[1], **json.loads(sys.argv[2]))]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "tokenizers")
               or m == "distill.model.tiny")
print(json.dumps({"paths": paths, "heavy": heavy}))
"""


def test_a_cache_hit_imports_neither_torch_nor_the_pre_training(tmp_path: Path) -> None:
    """What keeps mode=local's supervisor (and every worker's start) light: an entry that
    exists is returned as it is, without importing the builder (transformers, ~2 s)."""
    entries = [tmp_path / f"tiny-{tiny_recipe.TinyRecipe(**SMALL, lr=3e-3, seed=0).digest()}",
               tmp_path / f"tiny-bert-{tiny_recipe.TinyBertRecipe(**SMALL, lr=1e-3, seed=0).digest()}"]
    for entry in entries:
        entry.mkdir()
    out = subprocess.run([sys.executable, "-c", HIT, str(tmp_path), json.dumps(SMALL)],
                         capture_output=True, text=True, timeout=60, check=True)
    found = json.loads(out.stdout)
    assert found["paths"] == [str(e) for e in entries]
    assert found["heavy"] == []
