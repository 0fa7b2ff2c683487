"""The tiny teachers' cache: ``<cache root>/tiny-<recipe hash>``, built once per recipe.

The cache root and its build-once rule (:func:`cached_dir`) serve the converted GGUF teachers
too (``distill.model.gguf_cache``).

Each directory is written to a temporary directory and moved into place with
``os.replace`` under an ``fcntl`` lock, so concurrent first calls train once and nobody
ever reads a half-written directory. A hit costs a ``stat``: the pre-training module
(``tiny.py``: transformers, tokenizers) is imported only on a miss, which keeps the start of
``mode=local``'s supervisor and of every worker and student light.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO

from distill.model.tiny_recipe import BERT_TRAIN_STEPS, TinyBertRecipe, TinyRecipe, check_recipe

log = logging.getLogger(__name__)


def tiny_teacher_dir(
    cache_dir: str | None = None,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    seq_len: int = 128,
    vocab_size: int = 1024,
    train_steps: int = 1000,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
) -> str:
    """Directory of the pre-trained tiny teacher (model + tokenizer), training it on first use.

    `cache_dir` defaults to $DISTILL_CACHE, else ~/.cache/distill; the teacher lives in
    its subdirectory tiny-<hash of all arguments>. The defaults pre-train in about a
    minute on 2 idle CPU cores (1000 steps x 8 chunks x 128 tokens, ~0.06 s a step) to a
    held-out perplexity near 23 (uniform would be 1024); small batches of many steps
    gave lower perplexity per second than fewer, larger ones at this size.
    """
    recipe = TinyRecipe(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seq_len=seq_len,
        vocab_size=vocab_size, train_steps=train_steps, batch_size=batch_size, lr=lr, seed=seed,
    )
    check_recipe(recipe, rotary=True)
    return cached_dir(cache_dir, f"tiny-{recipe.digest()}", lambda out_dir: _pretrain(recipe, out_dir))


def tiny_bert_dir(
    cache_dir: str | None = None,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    seq_len: int = 128,
    vocab_size: int = 1024,
    train_steps: int = BERT_TRAIN_STEPS,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
) -> str:
    """Directory of the pre-trained tiny BERT encoder (model + tokenizer), training it on first use.

    Masked-LM pre-training on the *train* split of the pydoc corpus (15% of tokens picked,
    of which 80% masked, 10% random, 10% kept, as in BERT), cached under the same root and
    lock as the tiny Llama, in its own subdirectory tiny-bert-<hash of all arguments>. The
    saved model is the bare ``BertModel`` encoder (its pooler deterministic from ``seed``; the
    MLM head is dropped): what an encoder student replaces. The defaults train in about a
    minute on 2 idle CPU cores; a randomly initialised BERT's layers barely change their
    input (every layer ends in a LayerNorm of ``x + small``), so a student of one scores a
    cosine of 1.0 whatever it does, while these layers do real work: ``METRICS_FILE`` records
    the held-out cosine of the teacher with every layer skipped (``identity_cosine``).
    """
    recipe = TinyBertRecipe(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seq_len=seq_len,
        vocab_size=vocab_size, train_steps=train_steps, batch_size=batch_size, lr=lr, seed=seed,
    )
    check_recipe(recipe, rotary=False)
    return cached_dir(cache_dir, f"tiny-bert-{recipe.digest()}", lambda out_dir: _pretrain(recipe, out_dir))


def cache_root(cache_dir: str | None) -> str:
    """`cache_dir`, else $DISTILL_CACHE, else ~/.cache/distill."""
    root = cache_dir or os.environ.get("DISTILL_CACHE") or "~/.cache/distill"
    return os.path.abspath(os.path.expanduser(root))


LOCK_POLL_S = 0.5
"""How often a process waiting for another's build tries the lock again."""
WAIT_LOG_EVERY_S = 30.0
"""How often it says again that it still waits, for whom and for how long."""


@contextlib.contextmanager
def _file_lock(lock_path: str) -> Iterator[None]:
    """An exclusive ``fcntl`` lock held for the duration of the block; the lock file names its
    holder (pid and process token) while it is held, so that a process waiting for it can say
    whom it waits for. The kernel releases a ``flock`` when its holder exits, so a dead builder
    never blocks anyone; the lock can outlive the pid written in it only in a child that
    inherited the descriptor, and the waiter says so."""
    with open(lock_path, "a+") as lock_file:
        if not _try_lock(lock_file):
            _wait_for_lock(lock_file, lock_path)
        _claim(lock_file)
        try:
            yield
        finally:
            lock_file.truncate(0)  # nobody holds it: a waiter reading it now finds no stale pid
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _try_lock(lock_file: IO[str]) -> bool:
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _claim(lock_file: IO[str]) -> None:
    """Write who holds the lock now: ``<pid> <process token>`` (``liveness.process_token``)."""
    # Here, on a miss only: importing the pipeline imports torch, which a cache hit must not.
    from distill.pipeline.liveness import process_token

    lock_file.truncate(0)
    lock_file.write(f"{os.getpid()} {process_token() or ''}\n")
    lock_file.flush()


def _wait_for_lock(lock_file: IO[str], lock_path: str) -> None:
    """Block until the lock is ours, saying now and every ``WAIT_LOG_EVERY_S`` what we wait for."""
    started = last_said = time.monotonic()
    log.info("%s", _waiting_line(lock_path, 0.0))
    while not _try_lock(lock_file):
        time.sleep(LOCK_POLL_S)
        now = time.monotonic()
        if now - last_said >= WAIT_LOG_EVERY_S:
            last_said = now
            log.info("%s", _waiting_line(lock_path, now - started))
    log.info("the lock %s is ours after %.0fs", lock_path, time.monotonic() - started)


def _waiting_line(lock_path: str, waited_s: float) -> str:
    """``waiting 1m30s for pid 4242 building <dir> (lock <path>)``, and whether that pid still runs."""
    built = lock_path[: -len(".lock")]
    pid, alive = lock_holder(lock_path)
    if pid is None:
        who = "another process"
    elif alive is False:
        who = f"pid {pid}, which has exited (a process that inherited its lock holds it still)"
    else:
        who = f"pid {pid}"
    return f"waiting {_duration(waited_s)} for {who} building {built} (lock {lock_path})"


def lock_holder(lock_path: str) -> tuple[int | None, bool | None]:
    """(pid, whether it still runs) of the process the lock file names; (None, None) when it
    names none (free, or just taken); whether it runs is None when this machine cannot tell."""
    from distill.pipeline.liveness import process_alive

    try:
        with open(lock_path) as f:
            fields = f.read().split()
    except OSError:
        return None, None
    if not fields or not fields[0].isdigit():
        return None, None
    return int(fields[0]), process_alive(fields[1]) if len(fields) > 1 else None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m{seconds % 60:02d}s"


def cached_dir(cache_dir: str | None, name: str, build: Callable[[str], None]) -> str:
    """``<cache root>/<name>``, built by ``build(tmp_dir)`` on first use under an exclusive lock."""
    root = cache_root(cache_dir)
    final_dir = os.path.join(root, name)
    if os.path.isdir(final_dir):
        return final_dir
    os.makedirs(root, exist_ok=True)
    with _file_lock(final_dir + ".lock"):
        if os.path.isdir(final_dir):  # another process finished while we waited
            return final_dir
        log.info("pid %d builds %s (first use; other processes that need it wait for it)", os.getpid(), final_dir)
        _build_atomically(build, root, final_dir)
    return final_dir


def _build_atomically(build: Callable[[str], None], root: str, final_dir: str) -> None:
    """Build into a temporary directory next to `final_dir`, then move it into place."""
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.tmp-", dir=root)
    try:
        build(tmp_dir)
        _make_readable(tmp_dir)
        os.replace(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    log.info("cached %s", final_dir)


def _make_readable(directory: str) -> None:
    """mkdtemp (and safetensors) create private files; a shared cache must be readable."""
    os.chmod(directory, 0o755)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o644)


def _pretrain(recipe: TinyRecipe | TinyBertRecipe, out_dir: str) -> None:
    """Pre-train the recipe's teacher into ``out_dir`` (a cache miss: the one heavy import)."""
    from distill.model import tiny

    if isinstance(recipe, TinyBertRecipe):
        tiny.build_bert(recipe, out_dir)
    else:
        tiny.build_teacher(recipe, out_dir)
