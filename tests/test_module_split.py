"""Module boundaries: snapshot never imports the manager at run time; the pg package keeps its log apart from
its administration and still offers every name from ``context_persistent.pg``."""

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
    imported = _runtime_imports(PKG / "snapshot.py")
    assert "context_persistent.manager" not in imported
    assert "context_persistent.transfer" not in imported  # transfer sits above snapshot and the manager
    assert "context_persistent.snapshot" in _runtime_imports(PKG / "transfer.py")


def test_the_pg_log_does_not_import_the_administration() -> None:
    for name in ("log", "schema", "connection", "dsn"):
        imported = _runtime_imports(PKG / "pg" / f"{name}.py")
        assert "context_persistent.pg.admin" not in imported, name
    assert "context_persistent.pg.log" not in _runtime_imports(PKG / "pg" / "admin.py")


def test_every_pg_name_is_offered_by_the_package() -> None:
    import context_persistent.pg as pg

    for name in ("PostgresEventLog", "PostgresCheckpointStore", "connect", "redact_dsn", "resolve_dsn",
                 "resolve_schema", "init_schema", "status", "list_sessions", "session_bytes", "WRITER_KEEPALIVE",
                 "SCHEMA_VERSION", "ensure_schema", "lock_key", "channel_of", *pg.__all__):
        assert hasattr(pg, name), name
    assert pg.PostgresEventLog.__module__ == "context_persistent.pg.log"
    assert pg.init_schema.__module__ == "context_persistent.pg.admin"
