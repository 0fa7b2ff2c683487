"""distill.model.data: documents, the by-document split, token chunks, request sampling."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from distill.model.data import (
    TokenChunks,
    build_chunks,
    load_documents,
    sample_indices,
    split_documents,
    tokenize_chunks,
)
from distill.model.tiny import train_tokenizer

DOCS = [f"document number {i}" for i in range(20)]


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE trained offline on a slice of the pydoc corpus."""
    return train_tokenizer(load_documents("pydoc", max_documents=10), vocab_size=300, seq_len=64)


# ------------------------------------------------------------------ load_documents


def test_pydoc_source_is_sorted_topics() -> None:
    from pydoc_data.topics import topics

    docs = load_documents("pydoc")
    assert docs == [topics[key] for key in sorted(topics) if topics[key]]
    assert load_documents("pydoc", max_documents=3) == docs[:3]


def test_text_source_reads_one_document_per_file(tmp_path: Path) -> None:
    for name, text in [("b.txt", "second"), ("a.txt", "first"), ("c.md", "ignored")]:
        (tmp_path / name).write_text(text)
    assert load_documents("text", path=str(tmp_path / "*.txt")) == ["first", "second"]


def test_text_source_errors_name_data_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`data\.path"):
        load_documents("text", path=str(tmp_path / "*.txt"))
    with pytest.raises(ValueError, match=r"`data\.path`"):
        load_documents("text")


def test_unknown_source_names_data_source() -> None:
    with pytest.raises(ValueError, match=r"`data\.source='nope'`"):
        load_documents("nope")


@pytest.fixture
def offline_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`datasets` with no network and its cache in a temporary directory."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return datasets


def test_hf_dataset_source_reads_local_json(offline_datasets, tmp_path: Path) -> None:
    rows = [{"text": f"row {i}", "other": i} for i in range(5)] + [{"text": "", "other": 5}]
    data_file = tmp_path / "corpus.jsonl"
    data_file.write_text("\n".join(json.dumps(row) for row in rows))
    docs = load_documents("hf_dataset", path=str(data_file), dataset_name="json", max_documents=4)
    assert docs == ["row 0", "row 1", "row 2", "row 3"]
    with pytest.raises(ValueError, match=r"`data\.text_field='body'`"):
        load_documents("hf_dataset", path=str(data_file), dataset_name="json", text_field="body")


def test_hf_dataset_source_reads_saved_dataset_dir(offline_datasets, tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    offline_datasets.Dataset.from_dict({"content": ["x", "y"]}).save_to_disk(str(saved))
    docs = load_documents("hf_dataset", dataset_name=str(saved), text_field="content")
    assert docs == ["x", "y"]


def test_hf_dataset_source_needs_a_name() -> None:
    with pytest.raises(ValueError, match=r"`data\.dataset_name`"):
        load_documents("hf_dataset")


# ------------------------------------------------------------------ split_documents


def test_split_is_stable_across_processes() -> None:
    """Golden values: a salted hash() or an RNG-based split would change them."""
    _, heldout = split_documents(DOCS, 0.3, seed=0)
    assert heldout == [f"document number {i}" for i in (1, 2, 9, 17, 18)]


def test_split_is_order_independent_and_disjoint() -> None:
    train, heldout = split_documents(DOCS, 0.3, seed=0)
    shuffled = DOCS[:]
    random.Random(1).shuffle(shuffled)
    train2, heldout2 = split_documents(shuffled, 0.3, seed=0)
    assert set(train2) == set(train) and set(heldout2) == set(heldout)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(DOCS)
    assert train == [d for d in DOCS if d in set(train)]  # input order kept


def test_split_depends_on_seed_and_keeps_duplicates_together() -> None:
    assert split_documents(DOCS, 0.3, seed=0) != split_documents(DOCS, 0.3, seed=1)
    train, heldout = split_documents(DOCS + DOCS, 0.3, seed=0)
    assert not set(train) & set(heldout)
    assert len(heldout) == 10


def test_split_never_leaves_a_side_empty() -> None:
    train, heldout = split_documents(["a", "b"], 0.01)
    assert len(train) == 1 and len(heldout) == 1
    assert split_documents(["a", "b"], 0.0) == (["a", "b"], [])


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_split_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"`data\.heldout_fraction"):
        split_documents(DOCS, fraction)


# ------------------------------------------------------------------ chunks


def test_tokenize_chunks_concatenates_with_eos(tokenizer) -> None:
    docs = ["def f(x):\n    return x", "class A:\n    pass", "import os"]
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    stream = ids[0] + [tokenizer.eos_token_id] + ids[1] + [tokenizer.eos_token_id] + ids[2]
    chunks_NT = tokenize_chunks(tokenizer, docs, seq_len=4)
    assert chunks_NT.dtype == torch.int64
    assert chunks_NT.shape == (len(stream) // 4, 4)
    assert chunks_NT.flatten().tolist() == stream[: chunks_NT.numel()]


def test_tokenize_chunks_max_chunks(tokenizer) -> None:
    docs = load_documents("pydoc", max_documents=5)
    assert tokenize_chunks(tokenizer, docs, seq_len=16, max_chunks=3).shape == (3, 16)


def test_tokenize_chunks_without_full_chunk_names_seq_len(tokenizer) -> None:
    with pytest.raises(ValueError, match=r"`data\.seq_len=10000`"):
        tokenize_chunks(tokenizer, ["tiny"], seq_len=10_000)
    with pytest.raises(ValueError, match=r"`data\.seq_len=0`"):
        tokenize_chunks(tokenizer, ["tiny"], seq_len=0)


def test_build_chunks_shapes_and_split(tokenizer) -> None:
    docs = load_documents("pydoc", max_documents=30)
    chunks = build_chunks(tokenizer, docs, seq_len=32, heldout_fraction=0.2, max_heldout_chunks=5)
    assert isinstance(chunks, TokenChunks)
    assert chunks.seq_len == 32
    assert chunks.train_NT.shape[1] == chunks.heldout_NT.shape[1] == 32
    assert len(chunks.train_NT) > 0 and 0 < len(chunks.heldout_NT) <= 5
    train_docs, _ = split_documents(docs, 0.2)
    assert torch.equal(chunks.train_NT, tokenize_chunks(tokenizer, train_docs, 32))


def test_build_chunks_without_heldout(tokenizer) -> None:
    chunks = build_chunks(tokenizer, load_documents("pydoc", max_documents=3), 32, 0.0)
    assert chunks.heldout_NT.shape == (0, 32)


# ------------------------------------------------------------------ sample_indices


def test_sample_indices_is_a_pure_function_of_seed_and_id() -> None:
    assert sample_indices(1000, [0, 1, 2, 3, -1], seed=7) == [221, 415, 581, 93, 112]
    assert sample_indices(1000, [3, 0], seed=7) == [93, 221]
    assert sample_indices(1000, [0, 1, 2, 3], seed=8) != [221, 415, 581, 93]


def test_sample_indices_cover_the_range_evenly() -> None:
    counts = torch.bincount(torch.tensor(sample_indices(10, list(range(10_000)), seed=0)))
    assert len(counts) == 10 and counts.min() > 900 and counts.max() < 1100


def test_sample_indices_rejects_empty_set() -> None:
    with pytest.raises(ValueError, match="empty"):
        sample_indices(0, [1], seed=0)
