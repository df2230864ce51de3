"""README.md and docs/: every relative link (and its #anchor) resolves, every docs/*.md named in the text
exists, and every `context-persistent ...` command shown parses with the real argument parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from context_persistent.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*context-persistent(?: (.*))?$")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _prose(page: Path) -> list[tuple[int, str]]:
    """Lines outside code blocks."""
    out, fenced = [], False
    for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((no, line))
    return out


def links() -> list[tuple[Path, int, str]]:
    return [(page, no, m.group(1)) for page in PAGES for no, line in _prose(page) for m in LINK.finditer(line)
            if not re.match(r"^[a-z]+:", m.group(1))]


def test_pages_have_links_to_check() -> None:
    assert len(links()) > 20


@pytest.mark.parametrize("page,no,target", links(), ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_every_relative_link_resolves(page: Path, no: int, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.name}:{no}: {target}: no such file"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{page.name}:{no}: {target}: no heading gives #{anchor}"


def test_every_docs_page_named_in_the_text_exists() -> None:
    missing = []
    for page in PAGES:
        for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"\bdocs/([\w.-]+\.md)\b", line):
                if not (ROOT / "docs" / name).exists():
                    missing.append(f"{page.name}:{no}: docs/{name}")
    assert missing == []


def commands() -> list[tuple[str, int, str]]:
    """`context-persistent ...` invocations: `$ ` lines of console blocks, lines of sh blocks, inline code."""
    found: list[tuple[str, int, str]] = []
    for page in PAGES:
        block: str | None = None
        for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                block = None if block is not None else (line[3:].strip() or "text")
                continue
            if block == "console":
                if line.startswith("$ "):
                    found.append((page.name, no, line[2:]))
            elif block in ("sh", "bash"):
                found.append((page.name, no, line))
            elif block is None:
                found += [(page.name, no, m) for m in re.findall(r"`([^`]*context-persistent [^`]*)`", line)]
    out = []
    for name, no, text in found:
        text = re.sub(r"\s+#.*$", "", text).strip()
        for part in re.split(r"\s*(?:&&|\|\|)\s*", text):
            part = part.split(" | ")[0].strip()
            m = COMMAND.match(part)
            if m is None:
                continue
            rest = m.group(1) or ""
            first = rest.split(" ", 1)[0]
            if not rest or first.endswith(":") or first in ("=",) or "=" in first or first.startswith("<"):
                continue  # output (`context-persistent ls: ...`), the entry-point line, a placeholder
            out.append((name, no, rest))
    return out


def test_pages_show_commands() -> None:
    assert len(commands()) > 30


@pytest.mark.parametrize("page,no,command", commands())
def test_every_command_shown_parses(page: str, no: int, command: str) -> None:
    """Parsed by the real parser: a wrong option or a missing argument is a doc bug. A bare command name
    (`context-persistent verify`, naming the command in prose) must name a real command."""
    parser = build_parser()
    argv = shlex.split(command)
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    if argv == ["--version"]:
        assert "--version" in parser._option_string_actions, f"{page}:{no}: no option --version"
        return
    if len(argv) == 1:
        assert argv[0] in action.choices, f"{page}:{no}: no command {argv[0]!r}"  # type: ignore[attr-defined]
        return
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}:{no}: `context-persistent {command}` does not parse (exit {e.code})")
    assert getattr(args, "func", None) is not None or argv[0] == "db", f"{page}:{no}: {command}"


def test_every_command_is_documented_where_cli_md_says() -> None:
    """Each command has a section in cli.md, or cli.md links the page where it is described."""
    cli_md = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    headings = {h.split()[0].strip("`") for h in re.findall(r"^## `([^`]+)`", cli_md, re.M)}
    elsewhere = {"verify": "operations.md#verify-and-repair", "repair": "operations.md#verify-and-repair",
                 "db": "postgres.md"}
    action = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in action.choices:  # type: ignore[attr-defined]
        if name in elsewhere:
            assert f"]({elsewhere[name]})" in cli_md, name
            page, _, anchor = elsewhere[name].partition("#")
            text = (ROOT / "docs" / page).read_text(encoding="utf-8")
            assert f"context-persistent {name}" in text and (not anchor or anchor in _anchors(ROOT / "docs" / page))
        else:
            assert name in headings, f"docs/cli.md has no section for `{name}`"


DEVELOPMENT_TALK = ("issue #", "previous run", "this machine", "benchmark host", "this host", "this run",
                    "baselines", "since an earlier run")


def test_docs_speak_of_the_software_not_its_development() -> None:
    found = [f"{page.name}:{no}: {phrase!r}" for page in PAGES
             for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for phrase in DEVELOPMENT_TALK if phrase in line.lower()]
    assert found == []
