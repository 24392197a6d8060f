"""The package's layers import only downward, and no modules import each other in a circle.

Read from the source with ``ast`` (nothing is imported): every ``import autofit...`` and
``from autofit... import`` anywhere in a module, inside functions too, since a lazy import
still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autofit"

# Lowest first. A module may import its own layer and the layers before it. The bench sits above
# the library; only the command line, the entry point of everything, is above it (``autofit bench``).
LAYERS = ("core", "workloads", "runtime", "profiling", "probes", "estimator", "trial", "study", "report",
          "sizing", "api", "bench", "cli")
BENCH_ENTRY = "autofit.cli.bench"  # the one module outside the bench that may import it
# The package root (``import autofit``: the public names) is the API; ``python -m autofit`` is the command line.
TOP = {"autofit": "api", "autofit.__main__": "cli"}


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The autofit modules ``name`` imports (a ``from package import module`` counts as the module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "autofit"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != "autofit":
                continue
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            names_only = [a for a in node.names if f"{base}.{a.name}" not in known]
            out |= subs | ({base} if names_only else set())
    return {m for m in out if m in known and m != name}


def layer_of(name: str) -> int:
    if name in TOP:
        return LAYERS.index(TOP[name])
    top = name.split(".")[1]
    if top not in LAYERS:
        raise AssertionError(f"{name}: not in any layer; add its package to LAYERS")
    return LAYERS.index(top)


def graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imported(name, path, set(names)) for name, path in names.items()}


def test_every_module_is_in_a_layer():
    for name in module_names():
        layer_of(name)


def test_layers_import_only_downward():
    backward = [f"{a} ({LAYERS[layer_of(a)]}) imports {b} ({LAYERS[layer_of(b)]})"
                for a, targets in graph().items() for b in targets if layer_of(b) > layer_of(a)]
    assert not backward, "imports against the layer order:\n" + "\n".join(sorted(backward))


def test_nothing_imports_the_bench():
    users = [a for a, targets in graph().items() if not a.startswith("autofit.bench") and a != BENCH_ENTRY
             for b in targets if b.startswith("autofit.bench")]
    assert not users, f"the bench is imported by {sorted(set(users))}"


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    # A package's __init__ importing its own modules is how a package exposes them, not a circle:
    # the edge from a module up to its package's __init__ is left out.
    edges = {a: {b for b in targets if not a.startswith(b + ".")} for a, targets in graph().items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("edges, has_cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
])
def test_cycle_finder(edges, has_cycle):
    assert (find_cycle(edges) is not None) == has_cycle


def test_modules_and_functions_stay_small():
    """One job per module: none over 500 lines, no function over 100."""
    package = PACKAGE
    long_modules, long_functions = [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_modules.append(str(path.relative_to(package)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100:
                long_functions.append(f"{path.relative_to(package)}:{node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)


# One row each in docs/architecture.md's table (their submodules are theirs).
TABLE_GROUPS = ("autofit.bench", "autofit.cli", "autofit.trial.pipeline", "autofit.workloads.hf")
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
TABLE_HEAD = "| module | imports within autofit |\n|---|---|\n"


def _grouped(name: str) -> str:
    return next((g for g in TABLE_GROUPS if name == g or name.startswith(g + ".")), name)


def import_table() -> str:
    """docs/architecture.md's "Who imports whom" table, from :func:`graph` (``autofit.core``, which any module
    may use, left out; each row's imports in layer order)."""
    rows: dict[str, set[str]] = {}
    for name, targets in graph().items():
        rows.setdefault(_grouped(name), set()).update(_grouped(t) for t in targets)

    def shown(name: str) -> str:
        return name if name in TOP else name.removeprefix("autofit.")

    def order(name: str) -> tuple:
        return layer_of(name), shown(name)

    lines = []
    for row in sorted((r for r in rows if not r.startswith("autofit.core")), key=order):
        used = sorted((t for t in rows[row] if t != row and not t.startswith("autofit.core")), key=order)
        lines.append(f"| `{shown(row)}` | " + (", ".join(f"`{shown(t)}`" for t in used) or "—") + " |")
    return TABLE_HEAD + "\n".join(lines) + "\n"


def test_the_architecture_docs_import_table_is_the_codes():
    """Regenerate with ``AUTOFIT_WRITE_DOCS=1 python -m pytest tests/test_layers.py -k import_table``."""
    import os
    import re

    text = ARCHITECTURE.read_text()
    pattern = re.compile(re.escape(TABLE_HEAD) + r"(?:\|.*\|\n)+")
    assert pattern.search(text), f"{ARCHITECTURE}: no import table"
    expected = import_table()
    if os.environ.get("AUTOFIT_WRITE_DOCS") == "1":
        ARCHITECTURE.write_text(pattern.sub(lambda _m: expected, text, count=1))
        text = ARCHITECTURE.read_text()
    assert pattern.search(text).group(0) == expected, \
        "docs/architecture.md's import table is not the code's: regenerate it (this test's docstring)"
