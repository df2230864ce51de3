"""The examples of docs/integrations.md's Agent Framework, AutoGen, LangGraph and Pydantic AI sections run as written.

Each ``python`` block of a section runs in a fresh process in a tmp dir; the ``# -> ...`` comments in a block
are the lines it must print, in order.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "integrations.md"


def section_blocks(title: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("title", ["Microsoft Agent Framework", "AutoGen", "LangGraph", "Pydantic AI"])
def test_examples_run_and_print_what_they_say(title: str, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    blocks = section_blocks(title)
    assert blocks, f"no python example in the {title!r} section"
    for i, code in enumerate(blocks):
        expected = [line.strip()[len("# -> "):] for line in code.splitlines() if line.strip().startswith("# -> ")]
        assert expected, f"{title} example {i} says nothing about its output"
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, f"{title} example {i} failed:\n{run.stderr[-3000:]}"
        assert run.stdout.splitlines() == expected, f"{title} example {i} printed:\n{run.stdout}"
