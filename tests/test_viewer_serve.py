"""``context-persistent serve`` as a process: the URL with its token on stdout's first line, loopback by
default and a warning otherwise, clear errors for a missing storage folder or a bad port, and a session the
viewer shows stays writable by an agent."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

from context_persistent import PersistentContextManager  # noqa: E402
from tests.conftest import PYTHON  # noqa: E402


@contextmanager
def _serving(storage: Path, env: dict[str, str], *extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = subprocess.Popen([PYTHON, "-m", "context_persistent", "--storage", str(storage), "serve", "--no-browser",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip(), proc
    finally:
        proc.terminate()
        proc.wait(10)


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def _session(storage: Path, sid: str) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id=sid) as store:
        await store.add_message({"role": "user", "content": "hello"})


def test_serve_prints_the_url_with_a_token_first_and_stays_beside_a_writer(storage: Path,
                                                                           subprocess_env: dict[str, str]) -> None:
    """The first stdout line is a loopback URL with a fresh token that opens the API (without it: 401); while
    the viewer has the session open, a writer opens it and appends, and the viewer then shows the append."""
    asyncio.run(_session(storage, "s1"))
    with _serving(storage, subprocess_env) as (url, proc):
        assert url.startswith("http://127.0.0.1:") and "/?token=" in url
        base, token = url.split("/?token=")
        assert len(token) >= 32
        assert _get(base + "/api/sessions/s1", None)[0] == 401
        status, body = _get(base + "/api/sessions/s1", token)
        assert status == 200 and json.loads(body)["messages"] == 1
        asyncio.run(_session(storage, "s1"))  # (a writer: it would fail with SessionLockedError if locked)
        assert json.loads(_get(base + "/api/sessions/s1", token)[1])["messages"] == 2
    with _serving(storage, subprocess_env) as (other, _):
        assert other.split("token=")[1] != token  # a new token every run


def test_serve_warns_when_it_listens_beyond_loopback(storage: Path, subprocess_env: dict[str, str]) -> None:
    """--host 0.0.0.0 still prints a URL that works here, and warns on stderr that others can reach it."""
    asyncio.run(_session(storage, "s1"))
    with _serving(storage, subprocess_env, "--host", "0.0.0.0") as (url, proc):
        assert url.startswith("http://127.0.0.1:")
        base, token = url.split("/?token=")
        assert _get(base + "/api/info", token)[0] == 200
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "warning: listening on 0.0.0.0, not a loopback address" in err


def test_serve_refuses_a_storage_folder_that_does_not_exist_and_a_bad_port(tmp_path: Path,
                                                                          subprocess_env: dict[str, str]) -> None:
    """A missing storage folder is exit 1 naming it; a port out of range is a usage error (exit 2)."""
    missing = tmp_path / "nope"
    r = subprocess.run([PYTHON, "-m", "context_persistent", "--storage", str(missing), "serve", "--no-browser"],
                       capture_output=True, text=True, env=subprocess_env, timeout=60)
    assert r.returncode == 1 and str(missing) in r.stderr and r.stdout == ""
    r = subprocess.run([PYTHON, "-m", "context_persistent", "serve", "--port", "70000"], capture_output=True,
                       text=True, env=subprocess_env, timeout=60)
    assert r.returncode == 2 and "expected a port between 0 and 65535" in r.stderr


def test_serve_refuses_json_output(subprocess_env: dict[str, str]) -> None:
    """``--json`` has no meaning for a server: a usage error, not ignored."""
    r = subprocess.run([PYTHON, "-m", "context_persistent", "serve", "--json"], capture_output=True, text=True,
                       env=subprocess_env, timeout=60)
    assert r.returncode == 2 and "--json is not supported by serve" in r.stderr
