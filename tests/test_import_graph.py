"""No import cycle inside the package: the imports each module of ``context_persistent`` makes when it is
imported (at module level, in class bodies, in ``try``/``if`` blocks; not inside functions, which run later,
nor under ``if TYPE_CHECKING:``, which never runs) form a graph without cycles. A cycle known today is listed
in ``ALLOWED`` with the work that removes it, so any new cycle fails the suite and prints its path."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import context_persistent

PACKAGE = "context_persistent"
ROOT = Path(context_persistent.__file__).resolve().parent

#: Import edges (importer, imported) that close a cycle known today and are allowed until the work named beside
#: each removes them. Empty: the module-level graph has no cycle. (manager and snapshot name each other only
#: inside functions and under ``if TYPE_CHECKING:``, which this graph leaves out by design; issue #15 makes
#: them independent outright.) An entry that no longer closes a cycle fails ``test_allowed_cycles_are_current``,
#: so this list only ever shrinks.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements run when a module (or a class body) is executed."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _import_time_nodes(node.body)
            yield from _import_time_nodes(node.orelse)
        elif isinstance(node, ast.ClassDef):
            yield from _import_time_nodes(node.body)
        elif isinstance(node, (ast.Try, ast.TryStar)):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _import_time_nodes(block)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            yield from _import_time_nodes(node.body)
            yield from _import_time_nodes(getattr(node, "orelse", []))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                yield from _import_time_nodes(case.body)
        # (function bodies run when called, not when the module is imported)


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that importing ``name`` imports directly, packages on the way included (their
    ``__init__`` runs first), except the packages ``name`` is inside (they are already being imported)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    if is_package:
        ancestors.add(name)
    targets: set[str] = set()
    for node in _import_time_nodes(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            wanted = [a.name for a in node.names]
        else:
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from X import n``: X, and X.n when n is a module
            wanted = [source] + [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
        for target in wanted:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the packages on the way, then the module itself
                step = ".".join(parts[:i])
                if step in modules and step not in ancestors and step != name:
                    targets.add(step)
    return targets


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it is imported (``root``: the package's folder)."""
    modules = _modules(root)
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None when the graph has none."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt, WHITE) == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if colour.get(nxt, WHITE) == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = BLACK
        return None

    for start in sorted(graph):
        if colour[start] == WHITE:
            found = visit(start)
            if found:
                return found
    return None


def _without(graph: dict[str, set[str]], edges: frozenset[tuple[str, str]]) -> dict[str, set[str]]:
    return {a: {b for b in bs if (a, b) not in edges} for a, bs in graph.items()}


def test_no_import_cycle_in_the_package() -> None:
    graph = _without(import_graph(), ALLOWED)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle or [])


def test_allowed_cycles_are_current() -> None:
    """Every allowed edge still exists and still closes a cycle (else it must leave ``ALLOWED``)."""
    graph = import_graph()
    for a, b in sorted(ALLOWED):
        assert b in graph.get(a, set()), f"{a} no longer imports {b} at module level: remove it from ALLOWED"
        assert find_cycle(_without(graph, ALLOWED - {(a, b)})) is not None, \
            f"{a} -> {b} no longer closes a cycle: remove it from ALLOWED"


def test_the_checkpoint_layers_import_downwards_only() -> None:
    """payload <- front <- store <- replay <- policy: a layer never imports one after it (the package docstring)."""
    graph = import_graph()
    order = [f"{PACKAGE}.storage.checkpoint.{m}" for m in ("payload", "front", "store", "replay", "policy")]
    for i, module in enumerate(order):
        later = set(order[i + 1:])
        assert not graph[module] & later, f"{module} imports {sorted(graph[module] & later)}"
        assert f"{PACKAGE}.storage.checkpoint" not in graph[module]  # (nor the package, which imports them all)
    assert set(order) <= graph[f"{PACKAGE}.storage.checkpoint"]


# -- the graph builder itself, on a small package made for the purpose ------------------------------------
@pytest.fixture()
def fake_package(tmp_path: Path) -> Path:
    root = tmp_path / PACKAGE
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from . import b\nA = 1\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
                 "def f():\n    from .a import A\n    return A\n"
                 "try:\n    from .sub import c\nexcept ImportError:\n    pass\n"),
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import A\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_the_graph_follows_module_level_imports_only(fake_package: Path) -> None:
    graph = import_graph(fake_package)
    p = PACKAGE
    assert graph == {p: {f"{p}.a"}, f"{p}.a": {f"{p}.b"}, f"{p}.b": {f"{p}.sub", f"{p}.sub.c"}, f"{p}.sub": set(),
                     f"{p}.sub.c": {f"{p}.a"}}
    assert find_cycle(graph) == [f"{p}.a", f"{p}.b", f"{p}.sub.c", f"{p}.a"]


def test_imports_inside_functions_and_type_checking_make_no_cycle(fake_package: Path) -> None:
    (fake_package / "sub" / "c.py").write_text("def g():\n    from ..a import A\n    return A\n")
    assert find_cycle(import_graph(fake_package)) is None
