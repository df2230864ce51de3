"""docs/api.md is generated from the docstrings and cannot drift: the page equals what the docstrings give,
every public method, property and function is documented (parameters, return value, errors)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager, _apidoc
def test_every_public_member_is_documented() -> None:
    assert _apidoc.problems() == []


def test_docs_api_md_is_up_to_date() -> None:
    """Regenerate with `python -m context_persistent._apidoc` when this fails."""
    assert _apidoc.PAGE.read_text(encoding="utf-8") == _apidoc.render()


def test_the_page_lists_every_public_method_with_its_signature() -> None:
    page = _apidoc.PAGE.read_text(encoding="utf-8")
    for name, value in vars(PersistentContextManager).items():
        if name.startswith("_") or name.isupper():
            continue
        if isinstance(value, property):
            assert f"- `{name}`: " in page, name
        else:
            assert f"### `{name}`\n" in page, name
    for name in ("pin", "redact", "compact", "at", "follow", "export", "fork", "stats", "import_", "mount"):
        assert f"### `{name}`\n" in page
    assert "| `SessionLockedError` |" in page and "| `MalformedInputError` |" in page


class _Sloppy:
    def documented(self, a: int, *, b: str = "") -> int:
        """Returns twice ``a`` (``b`` is ignored). Raises nothing but ValueError."""
        return 2 * a

    def no_doc(self) -> None:
        pass

    def missing_param(self, a: int, hidden: int) -> None:
        """Uses ``a``. Raises ValueError."""

    def missing_return(self) -> int:
        """Computes a number. Raises ValueError."""
        return 1

    def missing_raises(self, a: int) -> None:
        """Stores ``a``."""

    @property
    def prop(self) -> int:
        return 1


def test_problems_names_each_gap() -> None:
    """The check itself: each kind of gap is reported, a documented method is not."""
    found = _apidoc.problems(_Sloppy, functions=[])  # type: ignore[arg-type]
    assert found == [
        "_Sloppy.no_doc: no docstring",
        "_Sloppy.missing_param: parameter 'hidden' is not described (write ``hidden`` in the docstring)",
        "_Sloppy.missing_return: the return value is not described (no 'Returns')",
        "_Sloppy.missing_raises: the errors are not described (no 'Raises')",
        "_Sloppy.prop: no docstring",
    ]


def test_check_mode_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: Any) -> None:
    page = tmp_path / "api.md"
    page.write_text(_apidoc.render().replace("Raises", "Throws", 1), encoding="utf-8")
    monkeypatch.setattr(_apidoc, "PAGE", page)
    assert _apidoc.main(["--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert _apidoc.main([]) == 0 and _apidoc.main(["--check"]) == 0


def test_markdown_of_docstrings_has_no_restructuredtext() -> None:
    page = _apidoc.PAGE.read_text(encoding="utf-8")
    prose = page.replace("```python\n", "").replace("\n```\n", "\n")
    assert "``" not in prose and ":func:" not in prose
    assert inspect.getdoc(PersistentContextManager.pin) is not None
