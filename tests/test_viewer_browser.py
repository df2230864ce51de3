"""The viewer in a real browser: Debian's headless chromium driven by playwright, against ``context-persistent
serve`` running as its own process on real sessions (tests/viewer_sessions.py).

One browser and one server for the module. Without /usr/bin/chromium (or $CONTEXT_PERSISTENT_CHROMIUM) or
playwright the tests are skipped, unless $CONTEXT_PERSISTENT_REQUIRE_BROWSER=1 (set by .ci/run, which
installs chromium with .ci/ensure-chromium): then they fail.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.viewer_sessions import build

CHROMIUM = os.environ.get("CONTEXT_PERSISTENT_CHROMIUM", "/usr/bin/chromium")
TIMEOUT_MS = 10_000


def _unavailable(reason: str) -> None:
    if os.environ.get("CONTEXT_PERSISTENT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"a browser is required (CONTEXT_PERSISTENT_REQUIRE_BROWSER=1) but {reason}", pytrace=False)
    pytest.skip(f"no browser: {reason}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The sessions, the server process and its URL."""
    if not Path(CHROMIUM).exists():
        _unavailable(f"{CHROMIUM} does not exist (apt-get install chromium; .ci/ensure-chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright package is not installed (the [test] extra)")
    storage = tmp_path_factory.mktemp("viewer-browser") / "store"
    facts = asyncio.run(build(storage))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "context_persistent", "--storage", str(storage), "serve",
                             "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and "?token=" in url, url
        yield {"url": url, "base": url.split("?", 1)[0], "storage": storage, "env": env, **facts}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def browser(served: dict[str, Any]) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, served: dict[str, Any]) -> Iterator[Any]:
    """A fresh browser context that opened the printed URL (so it holds the token's cookie)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.goto(served["url"])
    yield p
    context.close()
    assert errors == [], errors


def test_a_request_without_the_token_is_refused(browser: Any, served: dict[str, Any]) -> None:
    """A browser that never opened the printed URL gets 401 for the page and the API, and a wrong token 403."""
    context = browser.new_context()
    p = context.new_page()
    r = p.goto(served["base"])
    assert r is not None and r.status == 401 and "access token" in p.content()
    r = p.goto(served["base"] + "api/sessions")
    assert r is not None and r.status == 401
    r = p.goto(served["base"] + "?token=wrong-token-wrong-token-wrong")
    assert r is not None and r.status == 403
    context.close()


def test_the_list_opens_a_session_and_its_fork_link(page: Any, served: dict[str, Any]) -> None:
    """The printed URL shows the sessions (sortable, filterable); a click opens one; its fork is linked."""
    rows = page.locator("#sessions tbody tr")
    rows.first.wait_for()
    assert rows.count() == 2
    assert "null" not in page.inner_text("#main") and "undefined" not in page.inner_text("#main")
    page.fill("#filter", "try2")
    assert rows.count() == 1
    page.fill("#filter", "")
    page.click("th[data-sort=messages]")
    assert rows.nth(0).locator("td").nth(0).inner_text() == "agent"  # (31 messages, the most, sorted first)
    page.click("text=agent-try2")
    page.wait_for_selector("#parent")
    assert page.inner_text("#parent") == f"agent at seq {served['fork_at']}"
    page.click("#parent")
    page.wait_for_selector("#forks")
    assert "agent-try2" in page.inner_text("#forks")


def test_the_timeline_folds_results_under_calls_and_shows_hostile_text_as_text(page: Any) -> None:
    """Tool results sit in the fold of their call; the redacted message is a placeholder; script tags,
    javascript: links and control characters are shown as text and never run."""
    page.goto(page.url.split("#")[0] + "#/s/agent")
    page.wait_for_selector("#timeline .msg")
    fold = page.locator('details.fold[data-call="call_1"]')
    assert fold.locator(".msg").count() == 1 and "def rule_0" in (fold.text_content() or "")
    text = page.inner_text("#timeline")
    assert "<script>window.__pwned = 1</script>" in text and "javascript:window.__pwned=3" in text
    assert "\u241b[31mred" in text and "\u2400\u2407" in text and "\u27e8U+202E\u27e9" in text
    assert "[redacted: a redaction hides this message" in text and "REDACT-ME" not in page.content()
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#main script, #main img, #main a[href^='javascript']").count() == 0
    assert "more characters" in text  # (the 300,000-character line is clipped)


def test_switching_views_and_the_request_view_marks_dropped_messages(page: Any) -> None:
    """The view switch shows full, conversation and reasoning; the request view beside the history marks the
    messages compaction left out and the masked copies."""
    base = page.url.split("#")[0]
    page.goto(base + "#/s/agent")
    page.click("a.tab[data-view=conversation]")
    page.wait_for_selector("#pane[data-mode=conversation] #messages .msg")
    roles = page.locator("#messages .role").all_inner_texts()
    assert set(roles) == {"user", "assistant"}
    page.click("a.tab[data-view=full]")
    page.wait_for_selector("#pane[data-mode=full] #messages .msg")
    assert "system" in page.locator("#messages .role").all_inner_texts()
    page.click("a.tab[data-view=request]")
    page.fill("#budget", "1500")
    page.click("form.budget button")
    page.wait_for_selector("#history .msg.dropped")
    dropped = page.locator("#history .msg.dropped").first
    assert "left out (dropped)" in dropped.inner_text()
    assert page.locator("#history .status-masked").count() >= 1
    assert page.locator("#request .msg.kind-note").count() >= 1
    assert "left out here" in page.locator("#request .msg.kind-note").first.inner_text()


def test_the_time_travel_control_shows_the_session_as_it_was(page: Any) -> None:
    """Moving the slider to seq 4 shows the three messages of that moment, and the chart follows."""
    page.goto(page.url.split("#")[0] + "#/s/agent?view=full")
    page.wait_for_selector("#messages .msg")
    assert page.locator("#messages .msg").count() > 20
    slider = page.locator("#travel")
    slider.evaluate("(el) => { el.value = 4; el.dispatchEvent(new Event('input')); el.dispatchEvent(new Event('change')); }")
    from playwright.sync_api import expect  # (no wait_for_function: the page's CSP forbids eval, rightly)

    page.wait_for_url("**at=4**")
    page.wait_for_selector("#travel-seq:has-text('as of seq 4')")
    expect(page.locator("#messages .msg")).to_have_count(3)
    expect(page.locator("#chart svg rect.bar")).to_have_count(3)


def test_the_chart_shows_the_usage_the_provider_reported(page: Any) -> None:
    """The token chart draws each request the provider reported (a dot, with the store's estimate as a tick and
    both numbers in its tooltip) and says so in its legend; as of a seq before the second report, only one."""
    from playwright.sync_api import expect

    page.goto(page.url.split("#")[0] + "#/s/agent")
    points = page.locator("#chart svg g.usage-point")
    expect(points).to_have_count(3)
    expect(page.locator("#chart svg g.usage-point circle.reported")).to_have_count(3)
    expect(page.locator("#chart svg g.usage-point line.estimate")).to_have_count(3)
    title = points.first.locator("title").text_content() or ""
    assert "input tokens reported by the provider" in title and "estimated by the store" in title
    assert "reported by the provider: 3 request(s)" in page.inner_text("#usage-key")
    page.goto(page.url.split("#")[0] + "#/s/agent?at=20")
    expect(page.locator("#chart svg g.usage-point")).to_have_count(1)


def test_an_event_appended_by_another_process_appears_live(page: Any, served: dict[str, Any]) -> None:
    """While the timeline is open, a message a writer process appends shows up without a reload."""
    page.goto(page.url.split("#")[0] + "#/s/agent-try2")
    page.wait_for_selector("#live:has-text('live')")
    page.wait_for_selector("#timeline .msg")
    code = ("import asyncio, sys\n"
            "from context_persistent import PersistentContextManager\n"
            "async def main():\n"
            "    async with await PersistentContextManager.open(storage_path=sys.argv[1], session_id='agent-try2') as s:\n"
            "        await s.add_message({'role': 'user', 'content': 'appended by another process'})\n"
            "asyncio.run(main())\n")
    subprocess.run([sys.executable, "-c", code, str(served["storage"])], env=served["env"], check=True, timeout=60)
    page.wait_for_selector("#timeline .msg:has-text('appended by another process')")
