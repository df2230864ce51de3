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


#: The distribution each framework import of the docs' examples comes from.
DISTRIBUTIONS = {"autogen_agentchat": "autogen-agentchat", "autogen_ext": "autogen-ext", "autogen_core": "autogen-core",
                 "agent_framework": "agent-framework-core", "agents": "openai-agents"}


def test_each_framework_extra_installs_what_its_docs_example_imports() -> None:
    """Every framework package a framework's example in docs/integrations.md imports comes with that framework's
    extra (``[autogen]`` once installed only autogen-core while its example needs agentchat and ext)."""
    import re

    docs = (ROOT / "docs" / "integrations.md").read_text()
    extras = PYPROJECT["project"]["optional-dependencies"]
    examples = re.findall(r"```python\n(.*?)```", docs, re.S)
    for extra, marker in (("autogen", "integrations.autogen"), ("agent-framework", "integrations.agent_framework"),
                          ("openai-agents", "integrations.openai_agents")):
        code = "\n".join(e for e in examples if marker in e)
        assert code, f"no example of {marker} in docs/integrations.md"
        imported = {m.split(".")[0] for m in re.findall(r"^(?:from|import) ([\w.]+)", code, re.M)}
        frameworks = imported - set(sys.stdlib_module_names) - {"context_persistent", "__future__"}
        unknown = frameworks - set(DISTRIBUTIONS)
        assert not unknown, f"the {extra} example imports {sorted(unknown)}: add them to DISTRIBUTIONS"
        installed = {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] for r in extras[extra]}
        missing = {DISTRIBUTIONS[f] for f in frameworks} - installed
        assert not missing, f"[{extra}] does not install {sorted(missing)}, which its docs example imports"
