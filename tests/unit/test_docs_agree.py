"""The README and docs/ agree with the code: every ``python -m distill`` command they show
composes, every config key they name in backticks exists, the README's group table lists each
group's option files and keys, and every relative link finds its file and heading.

Commands are read from fenced code blocks and inline code spans (continuation lines joined,
split the way a shell splits them, ``<placeholders>`` kept as placeholders) and their Hydra
overrides composed with Hydra's compose API, as ``python -m distill`` composes them before Hydra
runs (``distill.__main__._compose``), so a problem is reported the way the command line reports
it: ``unknown key student.stepz_per_stage: did you mean student.steps_per_stage?``.
Nothing is started and nothing is trained.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distill import config
from distill.__main__ import _compose, _keys, _override_error
from distill.config import CONF_DIR, register_configs

ROOT = Path(__file__).parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUPS = ["mode", "teacher", "replacement", "data", "pipeline", "device", "student", "tracking"]

PLUGIN_OVERRIDES = {
    "hydra/launcher=joblib": "the [sweep] extra (hydra-joblib-launcher), which [dev] does not install",
    "hydra/launcher=submitit_sweep": "docs/cluster/submitit_sweep.yaml, which docs/cluster.md has the user "
    "copy into distill/conf/hydra/launcher/ beside hydra-submitit-launcher",
}
"""Launcher options that come from a Hydra plugin this venv lacks: the command is composed without
them (and without their ``hydra.launcher.*`` keys); ``test_plugin_overrides_name_what_provides_them``
holds each to what provides it."""

INLINE_KEY_ALLOWED = {
    "student.stepz_per_stage": "README.md's example of the one-line error a typo gives",
}
"""Dotted names in backticks that look like config keys but are not one, with the reason."""

PLACEHOLDER = "PLACEHOLDER"
VALUE_FLAGS = frozenset({"--cfg", "-c", "--package", "-p", "--info", "--config-path", "-cp",
                         "--config-name", "-cn", "--config-dir", "-cd"})
"""Hydra's flags that take the next argument as their value (not an override)."""
MULTIRUN_FLAGS = frozenset({"-m", "--multirun"})
SHELL_OPERATORS = frozenset({"&&", "||", "&", ";", "|"})
RUNS_DISTILL = re.compile(r"-m\s+distill(\s|$)")


@dataclass(frozen=True)
class Command:
    """One ``python -m distill`` (or ``torchrun ... -m distill``) invocation shown in a doc."""

    where: str
    """``file:line`` of the code block or span it was read from."""
    text: str
    args: tuple[str, ...]
    """What follows ``-m distill``, as the shell passes it."""


FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _blocks(markdown: str) -> list[tuple[int, str]]:
    """(first line, text) of every fenced code block."""
    return [(markdown[: m.start()].count("\n") + 2, m.group(1)) for m in FENCED.finditer(markdown)]


def _spans(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside the fenced blocks, on one line."""
    prose = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
    return [(prose[: m.start()].count("\n") + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", prose)]


def _shell_words(line: str) -> list[str]:
    """A command line split as a shell splits it; ``&&``, ``&``, ``;`` and ``|`` are words of their own."""
    line = re.sub(r"<[^<>\n]*>", PLACEHOLDER, line)  # <this node's address>, <date>
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&;|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return [_expand_tilde(word) for word in lexer]


def _expand_tilde(word: str) -> str:
    """bash expands ``name=~/x`` in an argument when ``name`` could be a shell variable."""
    return re.sub(r"^([A-Za-z_]\w*)=~(?=/|$)", r"\1=/home/user", word)


def _lines(code: str, first_line: int) -> list[tuple[int, str]]:
    """(line, text) of each shell line of a code block, continuation lines (``\\``) joined to it."""
    joined: list[tuple[int, str]] = []
    for line_no, line in enumerate(code.splitlines(), first_line):
        if joined and joined[-1][1].endswith("\\"):
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
        else:
            joined.append((line_no, line))
    return joined


def commands_in(markdown: str, name: str) -> list[Command]:
    """Every distill command in a markdown text."""
    found = []
    lines = [line for start, code in _blocks(markdown) for line in _lines(code, start)] + _spans(markdown)
    for line_no, line in [(n, text) for n, text in lines if RUNS_DISTILL.search(text)]:
        words = _shell_words(line)
        for start in [i + 2 for i, w in enumerate(words[:-1]) if (w, words[i + 1]) == ("-m", "distill")]:
            args = tuple(itertools.takewhile(lambda w: w not in SHELL_OPERATORS, words[start:]))
            found.append(Command(f"{name}:{line_no}", " ".join(line.split()), args))
    return found


def _overrides(args: tuple[str, ...]) -> tuple[list[str], bool]:
    """The Hydra overrides among a command's arguments, and whether it is a multirun (``-m``)."""
    overrides, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):  # -m, --help, --cfg job
            skip = arg in VALUE_FLAGS
            continue
        overrides.append(arg)
    return overrides, any(arg in MULTIRUN_FLAGS for arg in args)


def _jobs(overrides: list[str], multirun: bool) -> tuple[list[list[str]], list[str]]:
    """The override lists to compose (each sweep's values in turn, the others at their first) and
    the problems found parsing."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        return [], [str(exc).splitlines()[0]]
    swept = [i for i, o in enumerate(parsed) if o.is_sweep_override()]
    if swept and not multirun:
        return [], [f"{overrides[swept[0]]}: a sweep needs -m (--multirun)"]
    values = {i: [f"{parsed[i].get_key_element()}={v}" for v in parsed[i].sweep_string_iterator()]
              for i in swept}
    base = [values[i][0] if i in values else line for i, line in enumerate(overrides)]
    return [base] + [[*base[:i], value, *base[i + 1:]] for i in swept for value in values[i][1:]], []


def _without_plugins(overrides: list[str]) -> list[str]:
    """The overrides less the launcher plugins this venv lacks (``PLUGIN_OVERRIDES``)."""
    if not any(o in PLUGIN_OVERRIDES for o in overrides):
        return overrides
    return [o for o in overrides if o not in PLUGIN_OVERRIDES and not o.startswith("hydra.launcher.")]


@functools.cache
def _compose_problem(overrides: tuple[str, ...]) -> str | None:
    """Why these overrides do not compose, in the command line's words; None when they do.

    An override whose value is a ``<placeholder>`` is held to its key alone (the value is the user's)."""
    register_configs()
    typed = [o for o in overrides if PLACEHOLDER not in o]
    try:
        cfg = _compose(_without_plugins(typed))
    except (HydraException, OmegaConfBaseException) as exc:
        return _override_error(exc, typed)
    known = set(_keys(OmegaConf.to_container(cfg))) | {"hydra.run.dir", "hydra.sweep.dir"}
    unknown = [key for key, _ in (o.split("=", 1) for o in overrides if PLACEHOLDER in o) if key not in known]
    return f"unknown key {unknown[0]}" if unknown else None


def problems(command: Command) -> list[str]:
    """What is wrong with a command's overrides against the schema, each naming where and what."""
    jobs, found = _jobs(*_overrides(command.args))
    found += [p for job in jobs if (p := _compose_problem(tuple(job)))]
    return [f"{command.where}: `{command.text}`: {p}" for p in dict.fromkeys(found)]


@functools.cache
def known_keys() -> frozenset[str]:
    """Every key, leaf or not, of the default config and of each replacement option file.

    ``replacement`` is the one group the schema leaves untyped (``Config.replacement: Any``): every
    other group's option files can only set the keys of its dataclass, which the default has. The
    replacement files have no defaults lists, so each file's keys are that option's keys."""
    register_configs()
    options = {f"replacement.{key}" for path in (CONF_DIR / "replacement").glob("*.yaml")
               for key in _keys(OmegaConf.to_container(OmegaConf.load(path)))}
    keys: set[str] = set()
    for leaf in [*_keys(OmegaConf.to_container(_compose([]))), *options]:
        parts = leaf.split(".")
        keys.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return frozenset(keys)


def test_replacement_option_files_have_no_defaults_lists() -> None:
    """What ``known_keys`` relies on."""
    files = sorted((CONF_DIR / "replacement").glob("*.yaml"))
    assert files and not [p.name for p in files if "defaults" in OmegaConf.load(p)]


def inline_keys(markdown: str) -> list[tuple[int, str]]:
    """(line, key) of every backticked word that names a config key: dotted, its first part a
    top-level key of the config (``student.steps_per_stage``, ``data.seq_len=512``)."""
    top = {key for key in known_keys() if "." not in key}
    found = []
    for line_no, span in _spans(markdown):
        if RUNS_DISTILL.search(span):
            continue  # a command: composed by test_every_command_in_the_docs_composes
        for word in span.split():
            match = re.match(r"[+~]?([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)", word)
            if match and match.group(1).split(".")[0] in top:
                found.append((line_no, match.group(1)))
    return found


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


@pytest.mark.parametrize("path", DOC_FILES, ids=_doc_id)
def test_every_command_in_the_docs_composes(path: Path) -> None:
    found = [p for command in commands_in(path.read_text(), _doc_id(path)) for p in problems(command)]
    assert not found, "commands that do not compose:\n" + "\n".join(found)


def test_the_readme_shows_its_commands() -> None:
    """The extraction finds the commands a reader sees (so a broken reader cannot pass silently)."""
    texts = [c.text for c in commands_in((ROOT / "README.md").read_text(), "README.md")]
    assert "python -m distill" in texts and len(texts) >= 15
    assert any(c.startswith("torchrun --nproc_per_node=2 -m distill mode=student") for c in texts)


@pytest.mark.parametrize("path", DOC_FILES, ids=_doc_id)
def test_every_key_named_in_the_docs_exists(path: Path) -> None:
    keys = inline_keys(path.read_text())
    bad = [f"{_doc_id(path)}:{line}: `{key}`" for line, key in keys
           if key not in known_keys() and key not in INLINE_KEY_ALLOWED]
    assert not bad, "config keys named in backticks that no composed config has:\n" + "\n".join(bad)


def test_the_readme_names_keys() -> None:
    keys = {key for _, key in inline_keys((ROOT / "README.md").read_text())}
    assert {"student.steps_per_stage", "data.seq_len", "teacher.name_or_path"} <= keys


def _group_table() -> dict[str, tuple[set[str], list[str]]]:
    """README.md's config groups table: per group, the options it lists and the names in backticks
    of its last column."""
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (.*) \|$", (ROOT / "README.md").read_text(), re.M)
    return {group: (set(re.findall(r"`(\w+)`", options)), re.findall(r"`([^`]+)`", what))
            for group, options, what in rows if group in GROUPS}


def _enum_values() -> set[str]:
    """Every value a choice of the schema takes (``sequential``, ``nmse``)."""
    enums = [v for v in vars(config).values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    return {member.value for cls in enums for member in cls if isinstance(member.value, str)}


def _names_a_key(group: str, name: str) -> bool:
    """A name of the group table's last column is a key of that group (``slot_count``, ``e2e.*``,
    ``max_*``), a full key (``device.worker_gpu(s)``: both spellings), an option of the group or a
    choice's value (``sequential``)."""
    if "(s)" in name:
        return all(_names_a_key(group, name.replace("(s)", s)) for s in ("", "s"))
    keys = [name, f"{group}.{name}"]
    for key in keys:
        if key in known_keys() or (key.endswith("*") and any(k.startswith(key[:-1]) for k in known_keys())):
            return True
    return name in {p.stem for p in (CONF_DIR / group).glob("*.yaml")} or name in _enum_values()


def test_the_readme_group_table_lists_each_groups_options_and_keys() -> None:
    table = _group_table()
    assert set(table) == set(GROUPS)
    for group, (options, names) in table.items():
        files = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
        assert options == files, (f"README.md's config groups table, `{group}`: lists {sorted(options)}, "
                                  f"conf/{group}/ has {sorted(files)}")
        bad = [n for n in names if re.fullmatch(r"[\w.*()]+", n) and not _names_a_key(group, n)]
        assert not bad, f"README.md's config groups table, `{group}`: no such key {bad}"


def test_the_readme_top_level_keys_exist() -> None:
    paragraph = re.search(r"^Top-level keys: (.*?)\. ", (ROOT / "README.md").read_text(), re.M | re.S).group(1)
    names = re.findall(r"`([\w.]+)`", paragraph)
    assert len(names) >= 8 and [n for n in names if n not in known_keys()] == []


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings."""
    headings = re.findall(r"^#+ (.*)$", FENCED.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file whose file or heading does not exist."""
    text, bad = path.read_text(), []
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        target, _, anchor = match.group(1).partition("#")
        if re.match(r"[a-z]+:", target):
            continue
        linked = path.parent / target if target else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            bad.append(f"{_doc_id(path)}:{text[: match.start()].count(chr(10)) + 1}: {match.group(1)}")
    return bad


@pytest.mark.parametrize("path", DOC_FILES, ids=_doc_id)
def test_every_link_in_the_docs_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("# A title (here)\n\n[ok](#a-title-here) [no](#a-title) [gone](y.md) [web](https://x.org/#z)\n")
    assert broken_links(doc) == [f"{doc}:3: #a-title", f"{doc}:3: y.md"]


def test_plugin_overrides_name_what_provides_them() -> None:
    assert "hydra-joblib-launcher" in (ROOT / "pyproject.toml").read_text()
    assert (ROOT / "docs/cluster/submitit_sweep.yaml").is_file()


BAD_DOC = """\
Run it:

```bash
python -m distill teacher=hf teacher.name_or_path=/m \\
    student.stepz_per_stage=3 data.seq_len=64   # a typo on the continuation line
torchrun --nproc_per_node=2 -m distill mode=student replacement=nope
python -m distill replacement=mlp,copy
```

or `python -m distill pipeline.tcp_host=<address> pipeline.brokr_port=1`; keys `data.seq_len`,
`student.lrr` and `data.seq_len=64`, a file `report.md`.
"""


def test_a_bad_key_or_option_in_a_command_is_reported() -> None:
    reported = [p for command in commands_in(BAD_DOC, "BAD.md") for p in problems(command)]
    assert len(reported) == 4, reported
    assert reported[0].startswith("BAD.md:4: `python -m distill teacher=hf")
    assert "unknown key student.stepz_per_stage: did you mean student.steps_per_stage?" in reported[0]
    assert reported[1].startswith("BAD.md:6: ") and "replacement=nope: no such option" in reported[1]
    assert reported[2].startswith("BAD.md:7: ") and "needs -m" in reported[2]
    assert reported[3].startswith("BAD.md:10: ") and "unknown key pipeline.brokr_port" in reported[3]


def test_a_good_command_is_not_reported() -> None:
    good = ("```\npython -m distill -m replacement=mlp,copy keys_dir=~/k --cfg job \\\n"
            "    pipeline.tcp_host=<this node's address>  # a comment\n```\n")
    [command] = commands_in(good, "GOOD.md")
    assert command.args == ("-m", "replacement=mlp,copy", "keys_dir=/home/user/k", "--cfg", "job",
                            f"pipeline.tcp_host={PLACEHOLDER}")
    assert problems(command) == []


def test_a_bad_inline_key_is_found() -> None:
    keys = inline_keys(BAD_DOC)
    assert (11, "student.lrr") in keys and (10, "data.seq_len") in keys and (11, "data.seq_len") in keys
    assert [key for _, key in keys if key not in known_keys()] == ["student.lrr"]


def test_a_bad_name_in_the_group_table_is_found() -> None:
    assert _names_a_key("pipeline", "slot_count") and not _names_a_key("pipeline", "slot_cont")
    assert _names_a_key("device", "device.worker_gpu(s)")
    assert not _names_a_key("device", "device.share_gpu(s)")
    assert _names_a_key("student", "e2e.*") and not _names_a_key("student", "e3.*")
