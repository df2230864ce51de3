"""Write pytest's assertion-rewritten bytecode of the test modules before a pytest-xdist run (``make test``).

Every pytest-xdist worker collects the whole suite, and pytest rewrites the asserts of each test module as it
imports it, keeping the result in ``__pycache__/<module>.cpython-311-pytest-<version>.pyc`` (but never when
PYTHONDONTWRITEBYTECODE is set). In a clean clone, or with that variable set, each worker rewrote every test
module itself: about 5 s of one core per worker, of about 11 s each spends collecting. This writes the same
files beforehand, one process per core, with pytest's own functions; pytest checks each against a hash of its
source (a module changed since is rewritten as before), so the workers only read them.

``_pytest.assertion.rewrite`` is not a public API: if its functions are gone or fail, this says so on stderr
and exits 0, and the workers rewrite the modules themselves, as they did without it.

Usage: ``python tests/warm_rewrites.py`` (the Makefile's test targets run it after compileall).
"""

from __future__ import annotations

import fnmatch
import os
import sys
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _ini() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        options: dict[str, Any] = tomllib.load(f).get("tool", {}).get("pytest", {}).get("ini_options", {})
    return options


def modules(ini: dict[str, Any]) -> list[Path]:
    """The files pytest rewrites as it collects the test paths: the test modules (``python_files``) and the
    conftest.py files, largest first (the pool ends with the short ones)."""
    patterns = ini.get("python_files", ["test_*.py", "*_test.py"])
    patterns = patterns.split() if isinstance(patterns, str) else patterns
    found = [p for folder in ini.get("testpaths", ["tests"]) for p in (ROOT / folder).rglob("*.py")
             if p.name == "conftest.py" or any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    return sorted(found, key=lambda p: -p.stat().st_size)


class _Quiet:
    """What pytest's functions take for their trace messages (unused here)."""

    @staticmethod
    def trace(*_args: object) -> None:
        pass


def rewrite(path: Path) -> bool:
    """Write ``path``'s rewritten bytecode where pytest looks for it; False if it was already there, current."""
    from _pytest.assertion import rewrite as pytest_rewrite

    pyc = pytest_rewrite.get_cache_dir(path) / (path.name[:-3] + pytest_rewrite.PYC_TAIL)
    if pytest_rewrite._read_pyc(path, pyc, _Quiet.trace) is not None:
        return False
    # (no config: assertion pass hooks off, checked in main(); the only setting the rewrite reads)
    source_hash, code = pytest_rewrite._rewrite_test(path, None)
    pyc.parent.mkdir(exist_ok=True)
    if not pytest_rewrite._write_pyc(_Quiet, code, source_hash, pyc):
        raise OSError(f"could not write {pyc}")
    return True


def main() -> int:
    ini = _ini()
    if ini.get("enable_assertion_pass_hook"):
        print("warm_rewrites: enable_assertion_pass_hook is set; nothing written (pytest rewrites with it)",
              file=sys.stderr)
        return 0
    files = modules(ini)
    try:
        with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(rewrite, files, chunksize=1))
    except Exception as e:  # (a private API gone or changed, a file that does not parse: pytest reports the latter)
        print(f"warm_rewrites: pytest's rewritten bytecode not written ({type(e).__name__}: {e}); each pytest "
              "worker rewrites the test modules itself", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
