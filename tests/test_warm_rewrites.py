"""tests/warm_rewrites.py (run by ``make test`` before the pytest-xdist workers collect) writes what pytest reads.

It uses pytest's private rewriting functions: a pytest that changed them would leave every worker rewriting the
test modules itself again, with only a line on stderr; these tests fail instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _pytest.assertion import rewrite as pytest_rewrite

import warm_rewrites


def test_the_rewritten_bytecode_is_where_pytest_reads_it_and_rewritten_after_a_change(tmp_path: Path) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text("def test_sample():\n    x = 1\n    assert x == 2\n")
    pyc = pytest_rewrite.get_cache_dir(module) / ("test_sample" + pytest_rewrite.PYC_TAIL)

    assert warm_rewrites.rewrite(module) is True
    code = pytest_rewrite._read_pyc(module, pyc, lambda *_: None)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(code, namespace)
    with pytest.raises(AssertionError, match=r"assert 1 == 2"):  # pytest's explanation: the assert was rewritten
        namespace["test_sample"]()  # type: ignore[operator]

    assert warm_rewrites.rewrite(module) is False  # current: left as it is
    module.write_text(module.read_text().replace("x == 2", "x == 3"))
    assert pytest_rewrite._read_pyc(module, pyc, lambda *_: None) is None  # (pytest would not take the old one)
    assert warm_rewrites.rewrite(module) is True


def test_it_covers_the_test_modules_and_conftest_and_nothing_else() -> None:
    found = warm_rewrites.modules(warm_rewrites._ini())
    here = Path(__file__).resolve().parent
    assert here / "conftest.py" in found and Path(__file__).resolve() in found
    assert here / "realhost.py" not in found and here / "warm_rewrites.py" not in found
    assert {p.name for p in here.glob("test_*.py")} <= {p.name for p in found}
