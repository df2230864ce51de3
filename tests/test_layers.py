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
