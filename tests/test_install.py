"""Packaging: the CLI reports the package's version, the version is one number everywhere, and the licence
metadata is the SPDX form setuptools accepts without a deprecation warning, with the LICENSE file it names.
(CI builds the wheel and installs it into a clean venv: .ci/smoke-install.)"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import context_persistent

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_flag_prints_the_package_version(subprocess_env: dict[str, str]) -> None:
    version = PYPROJECT["project"]["version"]
    assert context_persistent.__version__ == version
    proc = subprocess.run([sys.executable, "-m", "context_persistent", "--version"], env=subprocess_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"context-persistent {version}"


def test_the_licence_is_an_spdx_expression_with_its_file() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"  # a string: the table form is deprecated by setuptools
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text
    requires = PYPROJECT["build-system"]["requires"]
    setuptools_req = next(r for r in requires if r.startswith("setuptools"))
    minimum = tuple(int(x) for x in setuptools_req.split(">=")[1].split("."))
    assert minimum >= (77,), "license-files and an SPDX license need setuptools 77 or later"


def test_the_extras_named_in_the_readme_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name in ("postgres", "test", "bench"):
        assert name in extras and f"`{name}`" in readme
    assert "asyncpg" in " ".join(extras["postgres"])
