"""distill.model.tiny_cache and tiny_recipe: a recipe names one cache entry, bad recipes are
refused before anything is written, and a cache hit imports nothing heavy."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
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


HOLDER = """
import os, sys, time
from distill.model.tiny_cache import cached_dir

def build(out_dir):
    if sys.argv[3] == "fork" and os.fork() == 0:  # the child inherits the lock and outlives us
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.05)
        os._exit(0)
    print("building", flush=True)
    if sys.argv[3] == "fork":
        os._exit(0)  # the lock file names us; the lock stays held by the child
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    open(os.path.join(out_dir, "by"), "w").write("holder")

cached_dir(sys.argv[1], "slow", build)
"""


def _hold_the_lock(tmp_path: Path, how: str) -> tuple[subprocess.Popen, Path]:
    """A process building the entry ``slow`` until the file it returns exists."""
    release = tmp_path / "release"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cache"), str(release), how],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "building"
    return holder, release


def _wait_in_thread(cache: Path, built: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: built.append(tiny_cache.cached_dir(
        str(cache), "slow", lambda out_dir: Path(out_dir, "by").write_text("waiter"))), daemon=True)
    thread.start()
    return thread


def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_waiting_process_names_the_builder_s_pid_and_the_path_and_says_it_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_cache, "WAIT_LOG_EVERY_S", 0.3)
    holder, release = _hold_the_lock(tmp_path, "plain")
    try:
        lock = tmp_path / "cache" / "slow.lock"
        assert tiny_cache.lock_holder(str(lock)) == (holder.pid, True)
        built: list[str] = []
        with caplog.at_level(logging.INFO, logger="distill.model.tiny_cache"):
            thread = _wait_in_thread(tmp_path / "cache", built)
            said = lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]  # noqa: E731
            _until(lambda: len(said()) >= 3, "the waiter did not repeat what it waits for")
            lines = said()  # while the holder builds
            release.touch()
            thread.join(30)
        assert lines[0] == f"waiting 0s for pid {holder.pid} building {tmp_path / 'cache' / 'slow'} (lock {lock})"
        assert all(f"for pid {holder.pid} building" in line for line in lines)
        assert built == [str(tmp_path / "cache" / "slow")]
        assert (tmp_path / "cache" / "slow" / "by").read_text() == "holder"  # built once, by the holder
        assert lock.read_text() == ""  # nobody holds it now
        assert holder.wait(30) == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_outliving_the_pid_it_names_is_said_to_and_taken_once_free(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder, release = _hold_the_lock(tmp_path, "fork")
    holder.wait(30)  # exited; its forked child holds the lock
    lock = tmp_path / "cache" / "slow.lock"
    assert tiny_cache.lock_holder(str(lock)) == (holder.pid, False)
    built: list[str] = []
    with caplog.at_level(logging.INFO, logger="distill.model.tiny_cache"):
        thread = _wait_in_thread(tmp_path / "cache", built)
        _until(lambda: any("waiting" in r.getMessage() for r in caplog.records), "the waiter said nothing")
        release.touch()  # the child exits: the kernel releases its lock
        thread.join(30)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting"))
    assert f"for pid {holder.pid}, which has exited (a process that inherited its lock holds it still)" in line
    assert (tmp_path / "cache" / "slow" / "by").read_text() == "waiter"
