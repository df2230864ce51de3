"""The package's layers (docs/architecture.md) hold: import-linter checks the contracts in ``.importlinter``
(each layer imports only the layers below it; no import cycle between the siblings of any package), imports
inside functions included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lint(*args: str) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_layer_contracts_are_kept() -> None:
    """Every contract of .importlinter is kept (lint-imports exits 0 and says so)."""
    result = _lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


def test_an_import_up_a_layer_breaks_the_contract(tmp_path: Path) -> None:
    """The check can fail: a copy of the package where a model module imports the store, inside a function,
    breaks both contracts."""
    import shutil

    copy = tmp_path / "context_persistent"
    shutil.copytree(ROOT / "context_persistent", copy, ignore=shutil.ignore_patterns("__pycache__"))
    tokens = copy / "model" / "tokens.py"
    tokens.write_text(tokens.read_text() + "\n\ndef _up() -> object:\n    from ..store import manager\n\n    return manager\n")
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "context_persistent.model.tokens -> context_persistent.store.manager" in result.stdout.replace("\n", " ")


PACKAGE = ROOT / "context_persistent"
LAYERS = ("cli", "viewer", "integrations", "store", "transfer", "operations", "storage", "model")


def _code_lines(source: str, node: "ast.AST") -> int:
    """Lines of ``node`` that hold code: docstrings, comments and blank lines left out."""
    import ast

    lines = set(range(node.lineno, node.end_lineno + 1))  # type: ignore[attr-defined]
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            lines -= set(range(body[0].lineno, body[0].end_lineno + 1))  # type: ignore[operator]
    text = source.splitlines()
    return sum(1 for i in lines if text[i - 1].strip() and not text[i - 1].lstrip().startswith("#"))


def test_no_module_over_600_lines_and_no_class_over_350_lines_of_code() -> None:
    """Size is a smell (docs/architecture.md): every module of the package has at most 600 lines and every
    class at most 350 lines of code (its docstrings, comments and blank lines aside)."""
    import ast

    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > 600:
            too_big.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (n := _code_lines(source, node)) > 350:
                too_big.append(f"{path.relative_to(ROOT)}: class {node.name} has {n} lines of code")
    assert not too_big, "\n".join(too_big)


def test_the_folders_are_the_layers() -> None:
    """At most a dozen modules at the top of the package; each layer of .importlinter is a folder whose
    ``__init__`` docstring says what it holds and what it may import."""
    import ast

    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    declared = (ROOT / ".importlinter").read_text()
    for layer in LAYERS:
        assert f"\n    {layer}" in declared, layer
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"{layer}/__init__.py does not say what it may import"


def test_every_module_compiles_without_a_warning() -> None:
    """No module of the package warns when compiled (an invalid escape sequence is a SyntaxWarning today and an
    error in a later Python): each is compiled with warnings turned into errors."""
    import warnings

    for path in sorted(PACKAGE.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")


def test_the_architecture_diagram_is_the_folder_tree() -> None:
    """docs/architecture.md's tree names every folder and module of the package (a module added without its
    place in the diagram fails here)."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    tree = doc[doc.index("```\ncontext_persistent/\n"):]
    tree = tree[:tree.index("\n```", 4)]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tree))
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            if rel.parent.parts and rel.parent.name not in words:
                missing.append(f"{rel.parent}/")
        elif path.stem not in words and path.stem not in ("__main__", "_apidoc"):
            missing.append(str(rel))
    assert not missing, f"not in docs/architecture.md's tree: {missing}"
