"""A local zero-shot multiple-choice task for ``mode=eval``, made from text no model trained on.

lm-evaluation-harness's published tasks download their data from the hub, which this
machine cannot reach. This writes one that needs nothing but a text file: each question is
two consecutive sentences of a document, and the choices are the sentence that follows them
and three other sentences of the same document of similar length (so topic words do not
give the answer away). The model picks the choice it finds most likely after the question,
as in HellaSwag-style tasks; ``acc_norm`` divides by the choice's length in bytes.

By default the text is the Debian Reference (``bench/real.py`` uses it as the corpus the
students never saw):

    apt-get download debian-reference-en && dpkg-deb -x debian-reference-en_*.deb /tmp/debref
    python bench/cloze_task.py /tmp/cloze                  # writes /tmp/cloze/{distill_cloze.yaml,data.jsonl}
    python -m distill mode=eval lm_eval.student=<run dir>/student lm_eval.tasks=[distill_cloze] \\
        lm_eval.include_path=/tmp/cloze

Deterministic for a given ``--seed``; ``--questions`` of them (200: a standard error of about
3.5 points on accuracy).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.real import DEFAULT_CORPUS, read_text  # noqa: E402

TASK = "distill_cloze"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
MIN_WORDS, MAX_WORDS = 6, 40
CHOICES = 4


def sentences(document: str) -> list[str]:
    """Prose sentences of a document: split at full stops, question and exclamation marks;
    what looks like code, tables, headings or a table of contents (section numbers, few
    letters, no final punctuation) dropped."""
    text = re.sub(r"\s+", " ", document)
    parts = [p.strip() for p in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)]
    return [p for p in parts if MIN_WORDS <= len(p.split()) <= MAX_WORDS and p[-1] in ".!?" and _prose(p)]


def _prose(sentence: str) -> bool:
    """Mostly letters, and no section numbers such as ``9.7.6``."""
    visible = sentence.replace(" ", "")
    letters = sum(c.isalpha() for c in visible)
    return letters >= 0.85 * len(visible) and not re.search(r"\d+\.\d+", sentence)


def questions(documents: list[str], count: int, seed: int) -> list[dict]:
    """``count`` questions: two sentences, the one after them, and distractors of similar
    length from the same document."""
    rng = random.Random(seed)
    candidates = []
    for doc_index, document in enumerate(documents):
        found = sentences(document)
        candidates += [(doc_index, i, found) for i in range(2, len(found))]
    rng.shuffle(candidates)
    out = []
    for _, i, found in candidates:
        answer = found[i]
        pool = [s for j, s in enumerate(found) if abs(j - i) > 2 and s != answer
                and 0.5 <= len(s) / len(answer) <= 2.0]
        if len(pool) < CHOICES - 1:
            continue
        choices = rng.sample(pool, CHOICES - 1)
        position = rng.randrange(CHOICES)
        choices.insert(position, answer)
        out.append({"context": f"{found[i - 2]} {found[i - 1]}", "choices": [" " + c for c in choices],
                    "answer": position})
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} questions could be made from this text; ask for fewer (--questions)")


def write_task(out_dir: Path, docs: list[dict]) -> Path:
    """The JSONL data and the task YAML, in a directory ``lm_eval.include_path`` can name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    path = out_dir / f"{TASK}.yaml"
    path.write_text(TASK_YAML.format(task=TASK, data=data.resolve()))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="text files (a glob; .txt or .txt.gz)")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    docs = questions(read_text(args.corpus), args.questions, args.seed)
    path = write_task(args.out_dir, docs)
    print(f"{len(docs)} questions; task {TASK} in {path.parent} (lm_eval.include_path={path.parent})")


if __name__ == "__main__":
    main()
