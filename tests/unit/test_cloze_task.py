"""bench/cloze_task.py: the local zero-shot task mode=eval scores a real teacher and its student on.

Every question must have exactly one right answer, the sentence that follows its context in
the document, among distractors from elsewhere in that document; headings and tables of
contents must not become questions. The harness itself runs the task in
tests/unit/modes/test_eval.py's format (same YAML keys).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.cloze_task import CHOICES, TASK, questions, sentences, write_task

WORDS = ["river", "stone", "garden", "window", "letter", "market", "engine", "forest", "bridge", "candle"]


def _document(count: int, offset: int = 0) -> str:
    """``count`` distinct prose sentences of 8-10 words, with a table-of-contents line among them."""
    out = []
    for i in range(offset, offset + count):
        words = [WORDS[(i + j) % len(WORDS)] for j in range(7 + i % 3)]
        out.append(f"Sentence {i} tells of the {' '.join(words)}.")
        if i % 5 == 0:
            out.append("Making the empty disk image file 9.7.6.")
    return " ".join(out)


def test_each_answer_is_the_sentence_that_follows_its_context() -> None:
    docs = [_document(30), _document(30, offset=100)]
    made = questions(docs, 20, seed=0)
    assert len(made) == 20
    by_doc = [sentences(d) for d in docs]
    for q in made:
        assert len(q["choices"]) == CHOICES and len(set(q["choices"])) == CHOICES
        found = next(s for s in by_doc if q["choices"][q["answer"]].strip() in s)
        i = found.index(q["choices"][q["answer"]].strip())
        assert q["context"] == f"{found[i - 2]} {found[i - 1]}"
        assert all(c.strip() in found for c in q["choices"])  # distractors from the same document
        assert not any("9.7.6" in c for c in [q["context"], *q["choices"]])
    assert questions(docs, 20, seed=0) == made and questions(docs, 20, seed=1) != made
    assert {q["answer"] for q in made} == set(range(CHOICES))  # the right answer moves


def test_too_little_text_is_refused() -> None:
    with pytest.raises(SystemExit, match="only"):
        questions([_document(6)], 50, seed=0)


def test_the_task_directory_names_its_data(tmp_path: Path) -> None:
    docs = questions([_document(30)], 5, seed=0)
    path = write_task(tmp_path / "task", docs)
    spec = yaml.safe_load(path.read_text())
    assert spec["task"] == TASK and spec["output_type"] == "multiple_choice"
    data = Path(spec["dataset_kwargs"]["data_files"]["test"])
    assert [json.loads(line) for line in data.read_text().splitlines()] == docs
