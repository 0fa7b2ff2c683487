"""Text corpora turned into fixed-length token chunks, with a held-out split.

Every stage of the distillation pipeline sees the same data: documents are split
into train and held-out *by document* (so no held-out text leaks into training
through a shared chunk), then each side is tokenized into non-overlapping,
unpadded chunks of `seq_len` tokens. Fixed-length unpadded chunks are what
`distill.model.teacher.Teacher` assumes, which is why no attention masks exist here.

Shape legend:
    N: number of chunks
    T: tokens per chunk (`data.seq_len`)
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pydoc_data.topics import topics

import torch

from distill.config import Source

log = logging.getLogger(__name__)

DEFAULT_HELDOUT_FRACTION = 0.1
"""Fraction of documents held out; the app default, also used to pre-train `distill.model.tiny`."""

DEFAULT_SPLIT_SEED = 0
"""Seed of the document split; the app default, also used to pre-train `distill.model.tiny`."""

_DATASET_BUILDERS = ("json", "text", "csv", "parquet")
"""`datasets` packaged builders that read local files given in `data.path`."""

_TOKENIZE_BATCH_DOCS = 256
"""Documents tokenized per call, so that `max_chunks` can stop a large corpus early."""

_MASK64 = (1 << 64) - 1


@dataclass
class TokenChunks:
    """Train and held-out token chunks of one corpus, split by document."""

    train_NT: torch.Tensor
    """int64 [num_train_chunks, seq_len]."""
    heldout_NT: torch.Tensor
    """int64 [num_heldout_chunks, seq_len]; empty (0 rows) when nothing is held out."""

    @property
    def seq_len(self) -> int:
        """Tokens per chunk."""
        return int(self.train_NT.shape[1])


# --------------------------------------------------------------------------- documents


def load_documents(
    source: str,
    path: str | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    max_documents: int | None = None,
) -> list[str]:
    """Read a corpus as a list of documents, in a deterministic order.

    `source` picks the reader: "pydoc" (offline default, the topic texts shipped with
    CPython), "text" (one document per file matching the glob `path`) or "hf_dataset"
    (a `datasets` dataset: a hub name, a builder such as "json" with `path` as its
    data files, or a directory written by `Dataset.save_to_disk`).
    """
    if source == Source.pydoc:
        docs = _load_pydoc()
    elif source == Source.text:
        docs = _load_text_files(path)
    elif source == Source.hf_dataset:
        docs = _load_hf_dataset(dataset_name, dataset_config, path, split, text_field)
    else:
        raise ValueError(f"Unknown `data.source={source!r}`. Choose one of {[s.value for s in Source]}.")
    docs = [doc for doc in docs if doc]
    if max_documents is not None:
        docs = docs[:max_documents]
    log.info("loaded %d documents from source %r", len(docs), source)
    return docs


def _load_pydoc() -> list[str]:
    """One document per pydoc topic, sorted by key: always present, no network needed."""
    return [topics[key] for key in sorted(topics)]


def _load_text_files(path: str | None) -> list[str]:
    """One document per file matching the glob, sorted by file name for a stable order."""
    docs = []
    for file in text_files(path):
        with open(file, encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    return docs


def text_files(path: str | None) -> list[str]:
    """The files the glob ``data.path`` matches, sorted; a ValueError naming the key when none."""
    if not path:
        raise ValueError("`data.source=text` needs `data.path`, a glob such as '/corpus/*.txt'.")
    files = sorted(f for f in glob.glob(os.path.expanduser(path), recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"`data.path={path!r}` matches no file. Give a glob such as '/corpus/*.txt'.")
    return files


def _load_hf_dataset(
    dataset_name: str | None,
    dataset_config: str | None,
    path: str | None,
    split: str,
    text_field: str,
) -> list[str]:
    """Read the text column of a `datasets` dataset (local builders need no network)."""
    import datasets  # lazy: ~1 s to import, and only data.source=hf_dataset needs it


    if not dataset_name:
        raise ValueError(
            "`data.source=hf_dataset` needs `data.dataset_name`: a hub name, a builder such as "
            "'json' (with `data.path` as its files), or a directory saved with save_to_disk."
        )
    if os.path.isdir(dataset_name) and _is_saved_dataset(dataset_name):
        dataset = datasets.load_from_disk(dataset_name)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    elif dataset_name in _DATASET_BUILDERS:
        if not path:
            raise ValueError(f"`data.dataset_name={dataset_name}` needs `data.path`, its data files.")
        dataset = datasets.load_dataset(dataset_name, data_files=path, split=split)
    else:
        dataset = datasets.load_dataset(dataset_name, dataset_config, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(
            f"`data.text_field={text_field!r}` is not a column of {dataset_name!r}; "
            f"its columns are {dataset.column_names}."
        )
    return [str(text) for text in dataset[text_field] if text]


def _is_saved_dataset(directory: str) -> bool:
    """Whether `directory` was written by `Dataset(Dict).save_to_disk`."""
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    return any(os.path.exists(os.path.join(directory, m)) for m in markers)


# --------------------------------------------------------------------------- split


def split_documents(
    docs: list[str], heldout_fraction: float, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Split documents into (train, held-out), keeping the input order within each.

    Each document's side is decided by a stable hash of (seed, text), not by its
    position, so the split is identical across runs and processes, does not change
    when documents are reordered or added, and duplicate texts always land together.
    When the hash puts nothing on one side of a non-trivial split, the document with
    the extreme hash is moved there, which is just as order-independent.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(
            f"`data.heldout_fraction={heldout_fraction}` must be in [0, 1), e.g. 0.1."
        )
    key = _seed_key(seed)
    scores = [_document_score(doc, key) for doc in docs]
    is_heldout = [score < heldout_fraction for score in scores]
    if heldout_fraction > 0 and len(set(docs)) >= 2:
        is_heldout = _ensure_both_sides(scores, is_heldout)
    train = [doc for doc, held in zip(docs, is_heldout, strict=True) if not held]
    heldout = [doc for doc, held in zip(docs, is_heldout, strict=True) if held]
    return train, heldout


def _document_score(doc: str, key: bytes) -> float:
    """A uniform number in [0, 1) fixed by (seed key, text); blake2b, never python's salted hash()."""
    digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _seed_key(seed: int) -> bytes:
    """The blake2b key for a seed (keys are at most 64 bytes, so the seed is hashed first)."""
    return hashlib.blake2b(str(seed).encode(), digest_size=32).digest()


def _ensure_both_sides(scores: list[float], is_heldout: list[bool]) -> list[bool]:
    """Move the lowest (highest) scoring text to held-out (train) if that side is empty."""
    if not any(is_heldout):
        lowest = min(scores)
        return [score == lowest for score in scores]
    if all(is_heldout):
        highest = max(scores)
        return [score != highest for score in scores]
    return is_heldout


# --------------------------------------------------------------------------- tokens


def tokenize_chunks(
    tokenizer, docs: list[str], seq_len: int, max_chunks: int | None = None
) -> torch.Tensor:
    """Concatenate the documents with an end-of-text token between them and cut the
    stream into non-overlapping full chunks; the tail shorter than `seq_len` is dropped.

    Returns int64 [N, seq_len]. With `max_chunks`, tokenization stops once enough tokens
    exist, so a large corpus costs only what is used.
    """
    if seq_len < 1:
        raise ValueError(f"`data.seq_len={seq_len}` must be a positive number of tokens.")
    separator_id = _separator_id(tokenizer)
    max_tokens = None if max_chunks is None else max_chunks * seq_len
    stream: list[int] = []
    for ids in _token_ids(tokenizer, docs):
        if stream:
            stream.append(separator_id)
        stream.extend(ids)
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    num_chunks = len(stream) // seq_len
    if max_chunks is not None:
        num_chunks = min(num_chunks, max_chunks)
    if num_chunks == 0:
        raise ValueError(
            f"The corpus ({len(docs)} documents, {len(stream)} tokens) gives no full chunk of "
            f"`data.seq_len={seq_len}` tokens. Lower `data.seq_len` or add documents."
        )
    chunks_NT = torch.tensor(stream[: num_chunks * seq_len], dtype=torch.int64)
    return chunks_NT.view(num_chunks, seq_len)


def _separator_id(tokenizer) -> int:
    """The token placed between documents: eos for LMs, [SEP] for BERT-style tokenizers."""
    for name in ("eos_token_id", "sep_token_id"):
        token_id = getattr(tokenizer, name, None)
        if token_id is not None:
            return int(token_id)
    raise ValueError(
        f"Tokenizer {type(tokenizer).__name__} has neither an eos nor a sep token to separate "
        "documents. Use the teacher's own tokenizer (`teacher.name_or_path`)."
    )


def _token_ids(tokenizer, docs: list[str]) -> Iterator[list[int]]:
    """Token ids per document, without special tokens, tokenized in batches for speed."""
    for start in range(0, len(docs), _TOKENIZE_BATCH_DOCS):
        batch = docs[start : start + _TOKENIZE_BATCH_DOCS]
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)
        yield from encoded["input_ids"]


def build_chunks(
    tokenizer,
    docs: list[str],
    seq_len: int,
    heldout_fraction: float,
    seed: int = 0,
    max_heldout_chunks: int | None = None,
    max_train_chunks: int | None = None,
) -> TokenChunks:
    """Split documents (see `split_documents`) and tokenize each side into chunks."""
    train_docs, heldout_docs = split_documents(docs, heldout_fraction, seed)
    if not train_docs:
        raise ValueError(
            "No training document is left. Add documents (`data.source`) or lower "
            f"`data.heldout_fraction={heldout_fraction}`."
        )
    train_NT = tokenize_chunks(tokenizer, train_docs, seq_len, max_train_chunks)
    if heldout_docs:
        heldout_NT = tokenize_chunks(tokenizer, heldout_docs, seq_len, max_heldout_chunks)
    else:
        heldout_NT = torch.empty(0, seq_len, dtype=torch.int64)
    log.info(
        "chunks of %d tokens: %d train (%d docs), %d held-out (%d docs)",
        seq_len, len(train_NT), len(train_docs), len(heldout_NT), len(heldout_docs),
    )
    return TokenChunks(train_NT=train_NT, heldout_NT=heldout_NT)


# --------------------------------------------------------------------------- sampling


def sample_indices(num_items: int, request_ids: list[int], seed: int) -> list[int]:
    """Map each request id to an item index in [0, num_items), as a pure function of
    (seed, request id), so that every worker picks the same chunk for the same request.
    """
    if num_items < 1:
        raise ValueError(f"Cannot sample from {num_items} items; the chunk set is empty.")
    seed_mix = _splitmix64(seed)
    return [_splitmix64(seed_mix ^ (request_id & _MASK64)) % num_items for request_id in request_ids]


def _splitmix64(x: int) -> int:
    """One splitmix64 step: a fast, well-mixed 64-bit hash (Steele et al., 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
