"""Module boundaries: snapshot never imports the manager at run time; the pg package keeps its log apart from
its administration and still offers every name from ``context_persistent.storage.pg``."""

from __future__ import annotations

import ast
from pathlib import Path

import context_persistent

PKG = Path(context_persistent.__file__).parent


def _runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs (module level and inside functions; not under TYPE_CHECKING),
    as dotted names relative to the package (``.manager`` -> ``manager``)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    if path.name == "__init__.py":
        package = path.relative_to(PKG.parent).parts[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_snapshot_does_not_import_the_manager() -> None:
    """Export, time travel and new sessions (transfer/) name the manager only for type checking."""
    for name in ("snapshot", "time_travel", "new_session", "atomic_files"):
        imported = _runtime_imports(PKG / "transfer" / f"{name}.py")
        assert "context_persistent.store.manager" not in imported, name
        assert "context_persistent.store.importing" not in imported, name  # (the store sits above transfer)
    assert "context_persistent.transfer.snapshot" in _runtime_imports(PKG / "store" / "importing.py")


def test_the_pg_log_does_not_import_the_administration() -> None:
    for name in ("log", "schema", "connection", "dsn"):
        imported = _runtime_imports(PKG / "storage" / "pg" / f"{name}.py")
        assert "context_persistent.storage.pg.admin" not in imported, name
    assert "context_persistent.storage.pg.log" not in _runtime_imports(PKG / "storage" / "pg" / "admin.py")


def test_every_pg_name_is_offered_by_the_package() -> None:
    import context_persistent.storage.pg as pg

    for name in ("PostgresEventLog", "PostgresCheckpointStore", "connect", "redact_dsn", "resolve_dsn",
                 "resolve_schema", "init_schema", "status", "list_sessions", "session_bytes", "WRITER_KEEPALIVE",
                 "SCHEMA_VERSION", "ensure_schema", "lock_key", "channel_of", *pg.__all__):
        assert hasattr(pg, name), name
    assert pg.PostgresEventLog.__module__ == "context_persistent.storage.pg.log"
    assert pg.init_schema.__module__ == "context_persistent.storage.pg.admin"


PARTS = ("session", "writer", "appends", "system_prompt", "edits", "erase", "ledger", "request_views", "lifecycle")


def test_the_store_parts_load_with_the_first_store_not_with_the_import() -> None:
    """`import context_persistent` loads the facade only; its parts load when a store is made."""
    import subprocess
    import sys

    code = ("import sys, context_persistent\n"
            "print(' '.join(m for m in sys.modules if m.startswith('context_persistent.')))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=PKG.parent).stdout.split())
    assert "context_persistent.store.manager" in loaded
    assert not loaded & {f"context_persistent.store.{p}" for p in PARTS}


def test_the_store_is_a_facade() -> None:
    """Every method of PersistentContextManager but ``__init__`` (which wires the parts) delegates: a few
    statements each (a dozen at most), its docstring aside; the parts never import the facade at run time."""
    tree = ast.parse((PKG / "store" / "manager.py").read_text())
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PersistentContextManager")
    for node in store.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__init__":
            body = node.body[1:] if ast.get_docstring(node) else node.body
            statements = sum(1 for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.stmt))
            assert statements <= 12, f"PersistentContextManager.{node.name} has {statements} statements"
    for part in PARTS:
        assert "context_persistent.store.manager" not in _runtime_imports(PKG / "store" / f"{part}.py"), part
