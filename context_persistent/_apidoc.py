"""Generate docs/api.md, the API reference, from the docstrings (``python -m context_persistent._apidoc``).

``python -m context_persistent._apidoc --check`` exits 1 when docs/api.md differs from what the docstrings
give, or when a public method, property or function is undocumented (tests/test_apidoc.py runs both). The
rules for a documented member: a docstring; every parameter named in it (as ````name````); for a method or
function that returns something, the word "Returns"; for a method or function, the word "Raises".
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"

HEADER = """# API reference

Generated from the docstrings by `python -m context_persistent._apidoc`; `tests/test_apidoc.py` fails when
this page is stale or a public method is undocumented. Prose guides: [architecture](architecture.md),
[configuration](configuration.md), [compaction](compaction.md), [snapshots](snapshots.md),
[operations](operations.md), [the command line](cli.md).

Everything below is importable from `context_persistent`.
"""


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties defined on ``cls``, in source order (constants are left out)."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            yield name, value.__func__
        elif isinstance(value, property) or inspect.isfunction(value):
            yield name, value


def _functions() -> list[tuple[str, Callable[..., Any]]]:
    import context_persistent

    import_: Any = context_persistent.import_  # (a lazy module attribute)
    read_usage: Any = context_persistent.read_usage  # (a lazy module attribute)
    return [("mount", context_persistent.mount), ("import_", import_), ("read_usage", read_usage)]


def _errors() -> list[type]:
    import context_persistent

    return sorted((v for n in context_persistent.__all__
                   if isinstance(v := getattr(context_persistent, n), type) and issubclass(v, Exception)),
                  key=lambda c: c.__name__)


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


def problems(cls: type | None = None, functions: list[tuple[str, Callable[..., Any]]] | None = None) -> list[str]:
    """What is undocumented: one line per missing docstring, parameter, "Returns" or "Raises"."""
    from .store.manager import PersistentContextManager

    cls = cls or PersistentContextManager
    items: list[tuple[str, Any]] = [(f"{cls.__name__}.{n}", v) for n, v in _members(cls)]
    items += functions if functions is not None else _functions()
    out = []
    for name, value in items:
        fn: Any = value.fget if isinstance(value, property) else value
        doc = inspect.getdoc(fn) or ""
        if not doc.strip():
            out.append(f"{name}: no docstring")
            continue
        if isinstance(value, property):
            continue
        for p in _params(fn):
            if f"``{p.name}``" not in doc:
                out.append(f"{name}: parameter {p.name!r} is not described (write ``{p.name}`` in the docstring)")
        ret = inspect.signature(fn).return_annotation
        if ret not in (None, "None", inspect.Signature.empty) and "Returns" not in doc and "returns" not in doc:
            out.append(f"{name}: the return value is not described (no 'Returns')")
        if "Raises" not in doc and "raises" not in doc:
            out.append(f"{name}: the errors are not described (no 'Raises')")
    return out


def _markdown(doc: str) -> str:
    """A docstring as Markdown: ``literal`` -> `literal`, :role:`x` -> `x`."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc)
    return doc.replace("``", "`")


class _Raw(str):
    """An annotation shown as written (``from __future__ import annotations`` keeps them as strings)."""

    def __repr__(self) -> str:
        return str(self).strip("'\"")


def _signature(name: str, fn: Callable[..., Any], prefix: str = "") -> str:
    sig = inspect.signature(fn)

    def raw(a: Any) -> Any:
        return _Raw(a) if isinstance(a, str) else a

    sig = sig.replace(parameters=[p.replace(annotation=raw(p.annotation)) for p in _params(fn)],
                      return_annotation=raw(sig.return_annotation))
    text = str(sig)
    kind = "async " if inspect.iscoroutinefunction(fn) else ""
    return f"{kind}{prefix}{name}{text}"


def render() -> str:
    from .store.manager import PersistentContextManager

    cls = PersistentContextManager
    parts = [HEADER, f"## class `{cls.__name__}`\n", _markdown(inspect.getdoc(cls) or "") + "\n"]
    props = [(n, v) for n, v in _members(cls) if isinstance(v, property)]
    methods = [(n, v) for n, v in _members(cls) if not isinstance(v, property)]
    parts.append("### Properties\n")
    for name, value in props:
        parts.append(f"- `{name}`: {_markdown(inspect.getdoc(value.fget) or '')}".replace("\n", "\n  "))
    parts.append("")
    for name, fn in methods:
        static = isinstance(vars(cls)[name], (staticmethod, classmethod))
        parts.append(f"### `{name}`\n")
        parts.append(f"```python\n{_signature(name, fn, cls.__name__ + '.' if static else 'store.')}\n```\n")
        parts.append(_markdown(inspect.getdoc(fn) or "") + "\n")
    parts.append("## Functions\n")
    for name, fn in _functions():
        parts.append(f"### `{name}`\n")
        parts.append(f"```python\n{_signature(name, fn)}\n```\n")
        parts.append(_markdown(inspect.getdoc(fn) or "") + "\n")
    parts.append("## Errors\n")
    parts.append("Every error raised on purpose derives from `ContextPersistentError`; bad arguments are "
                 "`ValueError`.\n")
    parts.append("| error | base | when |\n| --- | --- | --- |")
    for err in _errors():
        doc = " ".join((inspect.getdoc(err) or "").split("\n\n")[0].split())
        bases = ", ".join(b.__name__ for b in err.__bases__)
        parts.append(f"| `{err.__name__}` | {bases} | {_markdown(doc)} |")
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m context_persistent._apidoc", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale or a member is "
                        "undocumented; write nothing")
    args = parser.parse_args(argv)
    missing = problems()
    for line in missing:
        print(f"undocumented: {line}", file=sys.stderr)
    text = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is stale: run python -m context_persistent._apidoc", file=sys.stderr)
            return 1
        return 1 if missing else 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
