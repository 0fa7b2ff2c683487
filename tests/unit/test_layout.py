"""The package's imports flow one way and form no cycle; imports inside functions are the few
documented lazy ones.

Layers, top to bottom (a module imports its own subpackage and the layers below it):
``distill`` / ``distill.__main__`` -> ``modes`` -> ``results`` -> ``train`` | ``teacher`` ->
``stages`` | ``transport`` -> ``replacements`` -> ``model`` -> ``config`` -> ``errors`` | ``pipeline``
(which import nothing of the app; the schema's dataclasses raise ``ConfigError``). Parts on one layer (``a | b``) import neither each other: the
student's library (``train``) and the teacher worker's (``teacher``) share only what lies below
them, the stage layout first.
Every import statement counts, at module level, inside functions or under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).parents[2] / "distill"

RANKS = {"distill": 8, "distill.__main__": 8, "distill.modes": 7, "distill.results": 6, "distill.train": 5,
         "distill.teacher": 5, "distill.stages": 4, "distill.transport": 4, "distill.replacements": 3,
         "distill.model": 2, "distill.profiling": 2, "distill.config": 1, "distill.errors": 0, "distill.pipeline": 0}
"""The layer of each top-level part of the package; higher may import lower, never the reverse."""

LAZY_IMPORTS = {
    ("distill", "distill.model.assemble"): "`from distill import load_student` must not import "
                                           "transformers for `import distill.pipeline`",
    ("distill.model.location", "transformers"): "only a hub name needs it; the start-up checks run in "
                                                "every mode, the broker included",
    ("distill.model.data", "datasets"): "~1 s to import, only data.source=hf_dataset needs it",
    ("distill.model.tiny_cache", "distill.model.tiny"): "pre-training needs transformers; a cache hit, "
                                                        "what mode=local's supervisor meets, does not",
    ("distill.model.tiny_cache", "distill.pipeline.liveness"): "naming a lock's holder (only on a miss or a "
                                                               "wait) imports the pipeline, and so torch",
    ("distill.model.harness", "lm_eval"): "an optional extra (.[eval]) that only mode=eval needs",
    ("distill.model.gguf_cache", "transformers"): "only a GGUF teacher's config needs it; the start-up "
                                                  "checks run in every mode, the broker included",
    ("distill.model.gguf_cache", "distill.model.gguf_convert"): "converting needs torch and transformers; a "
                                                                "cache hit does not",
    ("distill.train.tracking", "torch.utils.tensorboard"): "an optional extra (.[tensorboard]) that only "
                                                            "tracking=tensorboard needs",
    ("distill.train.tracking", "wandb"): "an optional extra (.[wandb]) that only tracking=wandb needs",
    ("distill.train.tracking", "mlflow"): "an optional extra (.[mlflow]) that only tracking=mlflow needs",
}
"""(module, imported module) -> why it is imported inside a function."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imports(tree: ast.AST) -> list[tuple[ast.stmt, str]]:
    """(statement, imported module) of every import; ``from pkg import mod`` names pkg.mod."""
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(node, sub) for sub in subs if sub in MODULES] or [(node, node.module)]
    return found


def _function_imports(tree: ast.AST) -> list[str]:
    """Modules imported inside a function body, anywhere in the file."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out += [name for _, name in _imports(node)]
    return out


def _part(module: str) -> str:
    """The top-level part of ``module`` that RANKS knows."""
    for depth in (2, 1):
        prefix = ".".join(module.split(".")[:depth])
        if prefix in RANKS:
            return prefix
    raise AssertionError(f"{module} belongs to no layer of RANKS")


def _sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in MODULES.items()}


def _type_checking_imports(tree: ast.AST) -> set[int]:
    """ids of the import statements under ``if TYPE_CHECKING:``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out |= {id(stmt) for stmt, _ in _imports(node)}
    return out


def _edges(sources: dict[str, str], *, runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the package modules it imports (its own package's __init__ excluded: an
    ``from distill.x import y`` inside distill.x is how a subpackage shares its helpers);
    ``runtime_only`` leaves out the imports under TYPE_CHECKING."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        tree = ast.parse(source)
        skip = _type_checking_imports(tree) if runtime_only else set()
        deps = {dep for stmt, dep in _imports(tree) if dep in sources and id(stmt) not in skip}
        graph[name] = {dep for dep in deps if dep != name and not name.startswith(dep + ".")}
    return graph


def _wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer into a higher one (or across equal layers)."""
    wrong = []
    for name, deps in graph.items():
        for dep in deps:
            src, dst = _part(name), _part(dep)
            if src != dst and RANKS[dst] >= RANKS[src]:
                wrong.append(f"{name} imports {dep} ({src} may not import {dst})")
    return sorted(wrong)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def _undocumented_lazy_imports(sources: dict[str, str]) -> tuple[list, list]:
    """(imports inside functions that LAZY_IMPORTS does not explain, stale LAZY_IMPORTS entries)."""
    found = set()
    for name, source in sources.items():
        for dep in _function_imports(ast.parse(source)):
            key = next(((m, k) for (m, k) in LAZY_IMPORTS if m == name and (dep == k or dep.startswith(k + "."))),
                       (name, dep))
            found.add(key)
    return sorted(found - set(LAZY_IMPORTS)), sorted(set(LAZY_IMPORTS) - found)


def test_every_module_belongs_to_a_layer() -> None:
    for name in MODULES:
        _part(name)


def test_imports_flow_one_way() -> None:
    wrong = _wrong_way(_edges(_sources()))
    assert not wrong, "imports flowing the wrong way:\n" + "\n".join(wrong)


def test_pipeline_imports_nothing_of_the_application() -> None:
    for name, deps in _edges(_sources()).items():
        if _part(name) == "distill.pipeline":
            assert all(_part(dep) == "distill.pipeline" for dep in deps), f"{name} imports {deps}"


def test_no_import_cycle() -> None:
    cycle = _find_cycle(_edges(_sources()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_inside_functions_are_the_documented_lazy_ones() -> None:
    undocumented, stale = _undocumented_lazy_imports(_sources())
    assert not undocumented, f"imports inside functions without a reason in LAZY_IMPORTS: {undocumented}"
    assert not stale, f"stale LAZY_IMPORTS entries: {stale}"


def test_the_checks_catch_a_wrong_way_import_a_cycle_and_a_hidden_import() -> None:
    """The same checks on a made-up package that breaks each rule (so they cannot pass vacuously)."""
    sources = {
        "distill.train.trainer": "import distill.train.e2e\n",
        "distill.train.e2e": "from distill.train import trainer\n",
        "distill.model.teacher": "def f():\n    from distill.train.trainer import x\n",
    }
    graph = _edges(sources)
    assert _wrong_way(graph) == ["distill.model.teacher imports distill.train.trainer "
                                 "(distill.model may not import distill.train)"]
    cycle = _find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"distill.train.e2e", "distill.train.trainer"}
    assert ("distill.model.teacher", "distill.train.trainer") in _undocumented_lazy_imports(sources)[0]


UNTYPED_ALLOWED = {
    "distill.config": "the boundary: typed_config turns the composed DictConfig into the schema's dataclasses",
    "distill.results.sweep": "a Hydra callback: Hydra calls on_multirun_end with its own DictConfig",
}
"""Modules below ``distill.modes`` that may name omegaconf's untyped config, and why."""


def test_no_dictconfig_below_modes() -> None:
    """Below ``distill.modes`` the code receives the schema's dataclasses (``typed_config``): a
    function that takes ``Config`` says which keys it reads; a ``DictConfig`` hides them."""
    found = []
    for name, source in _sources().items():
        if RANKS[_part(name)] >= RANKS["distill.modes"] or name in UNTYPED_ALLOWED:
            continue
        for stmt, dep in _imports(ast.parse(source)):
            if dep.split(".")[0] == "omegaconf":
                found.append(f"{name}:{stmt.lineno} imports {dep}")
    assert not found, "untyped config below distill.modes:\n" + "\n".join(found)
