"""distill.help: attribute docstrings read from the schema's source, every key explained, docs/config.md fresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from distill import help as reference
from distill.config import StudentConfig

DOCS = Path(__file__).parents[2] / reference.DOCS_FILE


@dataclasses.dataclass
class Documented:
    """A class docstring is not a field's."""

    plain: int = 1
    """The literal right after a field is its docstring;
    its lines are joined."""
    undocumented: str = "x"
    nested: list[int] = dataclasses.field(default_factory=list)
    """Calls and annotations with brackets do not matter."""
    x = 3
    """An attribute without an annotation is no field."""


def test_field_docs_are_the_string_after_each_annotated_field() -> None:
    assert reference.field_docs(Documented) == {
        "plain": "The literal right after a field is its docstring; its lines are joined.",
        "nested": "Calls and annotations with brackets do not matter.",
    }


def test_field_docs_read_the_real_schema() -> None:
    docs = reference.field_docs(StudentConfig)
    assert docs["loss"] == "nmse = MSE(s, t) / MSE(t, 0) in fp32; cosine = 1 - cos(s, t)."
    assert set(docs) <= {f.name for f in dataclasses.fields(StudentConfig)}


def test_first_sentence_stops_at_a_full_stop_before_a_capital() -> None:
    assert reference.first_sentence("Steps; 0 = none. On by default.") == "Steps; 0 = none."
    assert reference.first_sentence("A glob, e.g. '/x/*.txt'. Then more.") == "A glob, e.g. '/x/*.txt'."


def test_every_key_has_a_type_a_default_and_a_meaning() -> None:
    keys = [k for s in [*reference.schema_sections(), *reference.replacement_sections()] for k in s.keys]
    undocumented = [k.name for k in keys if not k.doc]
    assert not undocumented, f"add a docstring under these fields in distill/config.py: {undocumented}"
    assert all(k.type and k.default for k in keys), [k for k in keys if not (k.type and k.default)]
    names = {k.name: k for k in keys}
    assert names["student.e2e.lr"].type == "float" and names["student.e2e.lr"].default == "0.003"
    assert names["student.loss"].type == "{nmse, cosine}"
    assert names["mode"].default == "local"  # the default composition's, not the schema's MISSING
    assert names["lm_eval.tasks"].default == "[arc_easy, hellaswag, piqa]"
    assert names["replacement.rank"].type == "int | None"  # from LowRankLayer.__init__


def test_groups_are_the_option_directories_without_schemas() -> None:
    groups = {g.name: g for g in reference.config_groups()}
    assert list(groups) == ["mode", "teacher", "replacement", "data", "pipeline", "device", "student", "tracking"]
    assert groups["teacher"].default == "tiny_llama" and "hf" in groups["teacher"].options
    assert not [o for g in groups.values() for o in g.options if o.endswith("_schema")]
    assert all(doc for g in groups.values() for doc in g.options.values())


def test_docs_config_md_is_fresh() -> None:
    assert DOCS.exists() and DOCS.read_text() == reference.markdown(), (
        f"{reference.DOCS_FILE} is stale: regenerate it with `{reference.REGENERATE}`")
