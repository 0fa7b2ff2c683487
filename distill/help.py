"""The reference of every config key: ``python -m distill --help`` and docs/config.md.

One source of truth: a key's meaning is the attribute docstring under its field in
``distill.config`` (the string literal right after it, read with ``ast``), its type the
field's annotation, its default the value of the default composition (``conf/config.yaml``
and the options it picks). A group's options are the files of ``conf/<group>/``, each
described by the opening comment of its file. ``replacement`` has no schema (its keys are
the arguments of the class an option names), so its keys are read from each option file:
the comment above a key is its meaning, the annotation of the class's ``__init__`` argument
its type.

``python -m distill.help > docs/config.md`` regenerates the docs; a test fails when they
are stale. Nothing here imports torch: ``--help`` answers in about a second.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from distill.config import CONF_DIR, Config, register_configs

DOCS_FILE = "docs/config.md"
REGENERATE = f"python -m distill.help > {DOCS_FILE}"
REPLACEMENT_GROUP = "replacement"
HELP_WIDTH = 100
TOP_LEVEL = "top-level keys"


@dataclass(frozen=True)
class Key:
    """One key a user can set: ``name=value``."""

    name: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    """The keys of one schema class (``student.e2e``), or of one replacement option."""

    name: str
    doc: str
    keys: list[Key]


@dataclass(frozen=True)
class Group:
    """A config group: ``name=option``, one option file each."""

    name: str
    default: str
    options: dict[str, str]
    """option -> what its file's opening comment says it is."""


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a class: field name -> the string literal right after it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = _one_paragraph(after.value.value)
    return docs


def first_sentence(text: str) -> str:
    """Up to the first full stop followed by a capital (``e.g. '/x'`` does not end it)."""
    return re.split(r"(?<=\.)\s+(?=[A-Z])", text, maxsplit=1)[0]


def config_groups() -> list[Group]:
    """The groups of ``conf/config.yaml``'s defaults list, in its order (not the ``*_schema`` entries)."""
    defaults = OmegaConf.load(CONF_DIR / "config.yaml").defaults
    groups = []
    for entry in defaults:
        if not isinstance(entry, DictConfig):
            continue  # config_schema, _self_
        (name, default), = entry.items()
        options = {path.stem: first_sentence(_opening_comment(path))
                   for path in sorted((CONF_DIR / name).glob("*.yaml"))}
        groups.append(Group(name, default, options))
    return groups


def schema_sections() -> list[Section]:
    """Every key of the schema with the default composition's value, one section per class."""
    top, *nested = _sections(Config, "", "", _default_config())
    return [Section(TOP_LEVEL, top.doc, top.keys), *nested]


def replacement_sections() -> list[Section]:
    """The keys of each ``replacement`` option, from its file and the class it names."""
    sections = []
    for path in sorted((CONF_DIR / REPLACEMENT_GROUP).glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_", "")
        types = _init_annotations(target)
        keys = [Key(f"{REPLACEMENT_GROUP}.{name}", types.get(name, ""), default, doc)
                for name, default, doc in _commented_keys(path)]
        sections.append(Section(f"{REPLACEMENT_GROUP}={path.stem}", "", keys))  # its doc: config_groups()
    return sections


def help_text() -> str:
    """What ``python -m distill --help`` prints: groups, then every key with type, default, meaning."""
    out = ["distill: layer-by-layer distillation of a HuggingFace transformer.", "",
           "usage: python -m distill [GROUP=OPTION ...] [KEY=VALUE ...]",
           "       python -m distill -m GROUP=A,B [KEY=X,Y ...]   a sweep: one run per combination",
           "       python -m distill --hydra-help                 Hydra's own flags",
           f"Every key in full: {DOCS_FILE}.", "",
           "Config groups (GROUP=OPTION; * = the default):"]
    for group in config_groups():
        out.append(f"  {group.name}")
        width = max(map(len, group.options)) + 2
        for option, doc in group.options.items():
            mark = "*" if option == group.default else " "
            out.append(_wrap(f"    {option:<{width}}{mark} {_plain(doc)}", 8 + width))
    out += ["", "Keys (KEY=VALUE): type = default, then what it does:"]
    for section in [*schema_sections(), *replacement_sections()]:
        out += ["", _wrap(f"  {section.name}: {_plain(first_sentence(section.doc))}".rstrip(), 4)]
        if not section.keys:
            out.append("    (no keys)")
        for key in section.keys:
            out.append(f"    {key.name}: {_signature(key)}")
            out.append(_wrap(f"        {_plain(first_sentence(key.doc))}", 8))
    return "\n".join(out) + "\n"


def markdown() -> str:
    """docs/config.md: the same source as ``--help``, every docstring in full."""
    out = ["# Config reference", "",
           f"Generated from the field docstrings of `distill/config.py` and the option files of "
           f"`distill/conf/`; do not edit by hand, regenerate with `{REGENERATE}` (a test fails "
           "when this file is stale). `python -m distill --help` prints the same, each meaning cut to its "
           "first sentence.", "",
           "Choose an option of a group with `GROUP=OPTION` and set a key with `KEY=VALUE`:", "",
           "```sh", "python -m distill teacher=hf teacher.name_or_path=/models/Qwen2-0.5B student.steps_per_stage=200",
           "```", "", "## Config groups", ""]
    for group in config_groups():
        out += [f"### `{group.name}`", "", "| option | what |", "| --- | --- |"]
        for option, doc in group.options.items():
            default = " (default)" if option == group.default else ""
            out.append(f"| `{option}`{default} | {_cell(doc)} |")
        out.append("")
    out += ["## Keys", "", "Defaults are those of `python -m distill` with no overrides; an option file "
            "may set others (`data=text` sets `data.seq_len: 512`).", ""]
    for section in schema_sections():
        out += _section_markdown(section)
    out += ["## Replacement keys", "", "Each `replacement` option takes its own keys (the arguments of "
            "its class); the values shown are its file's.", ""]
    for section in replacement_sections():
        out += _section_markdown(section)
    return "\n".join(out).rstrip("\n") + "\n"


def _section_markdown(section: Section) -> list[str]:
    out = [f"### {'Top-level keys' if section.name == TOP_LEVEL else f'`{section.name}`'}", ""]
    if section.doc:
        out += [_markdown_text(section.doc), ""]
    if not section.keys:
        return [*out, "(no keys)", ""]
    out += ["| key | type | default | what |", "| --- | --- | --- | --- |"]
    out += [f"| `{k.name}` | {_escape_pipes(_code(k.type))} | {_escape_pipes(_code(k.default))} | {_cell(k.doc)} |"
            for k in section.keys]
    return [*out, ""]


def _sections(cls: type, prefix: str, doc: str, defaults: DictConfig) -> list[Section]:
    """The keys of ``cls`` (its own section first), then a section per nested schema class."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        name, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            nested += _sections(hint, name + ".", docs.get(f.name) or _class_doc(hint), defaults)
        elif hint is not Any:  # replacement: a group of its own, described by its options
            keys.append(Key(name, _type_text(f.type, hint), _value_text(OmegaConf.select(defaults, name)),
                            docs.get(f.name, "")))
    return [Section(prefix.rstrip("."), doc, keys), *nested]


def _default_config() -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config")


def _type_text(annotation: str, hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "{" + ", ".join(member.value for member in hint) + "}"
    return annotation


def _value_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, ListConfig | list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return str(value)


def _class_doc(cls: type) -> str:
    return _one_paragraph(cls.__doc__ or "")


def _one_paragraph(text: str) -> str:
    """A docstring on one line (its paragraphs joined)."""
    return " ".join(inspect.cleandoc(text).split())


def _opening_comment(path: Path) -> str:
    """The prose of a YAML file's opening comment (not ``@package`` lines, not the commands it shows)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if text.strip().startswith("@package"):
            continue
        if text.startswith("   ") or text.strip().startswith(("Run:", "(")):
            break  # an example command
        lines.append(text.strip())
    return " ".join(lines)


def _commented_keys(path: Path) -> list[tuple[str, str, str]]:
    """(key, value, the comment right above it) of an option file's keys, ``_target_`` and such left out."""
    keys, comment = [], []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            comment.append(line[1:].strip())
            continue
        match = re.match(r"(\w+):\s*(.*)$", line)
        if match and not match.group(1).startswith("_"):
            keys.append((match.group(1), match.group(2), " ".join(comment)))
        comment = []
    return keys


def _init_annotations(target: str) -> dict[str, str]:
    """Argument -> annotation of ``__init__`` of a class in distill, read from its source (no import)."""
    module, _, name = target.rpartition(".")
    parts = module.split(".")
    if parts[0] != "distill":
        return {}
    path = CONF_DIR.parent.joinpath(*parts[1:]).with_suffix(".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return {a.arg: ast.unparse(a.annotation) for a in item.args.args if a.annotation}
    return {}


def _signature(key: Key) -> str:
    return f"{key.type} = {key.default}" if key.type else f"= {key.default}"


def _plain(text: str) -> str:
    """Docstring markup for a terminal: ``code`` -> code."""
    return text.replace("``", "")


def _wrap(line: str, indent: int) -> str:
    return textwrap.fill(line, HELP_WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False)


def _markdown_text(text: str) -> str:
    """Docstring markup for Markdown: ``code`` -> `code`; ``<dir>`` would read as an HTML tag."""
    return text.replace("``", "`").replace("<", "&lt;")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _cell(text: str) -> str:
    return _escape_pipes(_markdown_text(text))


def _escape_pipes(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(markdown())
