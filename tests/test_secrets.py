"""Secrets that never reach disk: the ``secret_scanner`` redacts matched spans before a record is written."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from context_persistent import PersistentContextManager, import_
from context_persistent.model.secret_scan import BUILTIN_LITERALS, BUILTIN_PATTERNS, SecretScanner, make_scanner

#: One sample per built-in kind (made-up values of the real shapes).
SAMPLES = {
    "aws_access_key": "AKIAIOSFODNN7EXAMPLE",
    "private_key": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
    "github_token": "ghp_" + "A1b2C3d4E5" * 4,
    "gitlab_token": "glpat-" + "x7Y8z9" * 4,
    "slack_token": "xoxb-123456789012-abcdefABCDEF",
    "anthropic_api_key": "sk-ant-api03-" + "Zq9_" * 10,
    "openai_api_key": "sk-proj-" + "Ab3De6Gh9" * 4,
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
}
BEARER = "0123456789abcdefXYZ.token"


async def _open(storage: Path, session: str = "s", **cfg: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=session, **cfg)


def _folder_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.is_file())


def test_the_samples_cover_every_built_in_kind() -> None:
    assert set(SAMPLES) | {"bearer_token"} == set(BUILTIN_PATTERNS)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
async def test_a_secret_never_reaches_disk(storage: Path, kind: str) -> None:
    secret = SAMPLES[kind]
    store = await _open(storage, secret_scanner="builtin", checkpoint_every=2)
    await store.add_message({"role": "user", "content": [{"type": "text", "text": f"here: {secret} ok"}]})
    await store.add_message({"role": "assistant", "content": "fine", "metadata": {"note": f"({secret})"}})
    msgs = await store.get_messages()
    assert msgs[0]["content"][0]["text"] == f"here: [secret:{kind}] ok"
    assert msgs[1]["metadata"]["note"] == f"([secret:{kind}])"
    await store.close()  # (writes a checkpoint too)
    folder = storage / "s"
    assert (folder / "checkpoint.json").exists()
    stored = _folder_bytes(folder)
    for piece in (secret.encode(), orjson.dumps(secret)[1:-1], secret.splitlines()[len(secret.splitlines()) // 2].encode()):
        assert piece not in stored
    recs = [orjson.loads(x) for x in (folder / "events.jsonl").read_bytes().splitlines()]
    assert recs[1]["data"]["secrets"] == [{"kind": kind, "count": 1}]


async def test_bearer_tokens_keep_the_word_and_lose_the_token(storage: Path) -> None:
    store = await _open(storage, secret_scanner="builtin")
    await store.add_message({"role": "tool", "tool_call_id": "c", "content": f"Authorization: Bearer {BEARER}"})
    assert (await store.get_messages())[0]["content"] == "Authorization: Bearer [secret:bearer_token]"
    await store.close()
    assert BEARER.encode() not in _folder_bytes(storage / "s")


async def test_off_by_default_and_ordinary_text_is_left_alone(storage: Path) -> None:
    store = await _open(storage)
    await store.add_message({"role": "user", "content": SAMPLES["aws_access_key"]})
    await store.close()
    assert SAMPLES["aws_access_key"].encode() in (storage / "s" / "events.jsonl").read_bytes()
    store = await _open(storage, "t", secret_scanner="builtin")
    plain = {"role": "user", "content": "ask the bearer; sk-short; eyJ alone; AKIA lower akiaiosfodnn7example"}
    await store.add_message(plain)
    assert await store.get_messages() == [plain]
    await store.close()
    assert b'"secrets"' not in (storage / "t" / "events.jsonl").read_bytes()


async def test_set_messages_replace_messages_and_hooks(storage: Path) -> None:
    seen: list[tuple[str, Any]] = []

    class Hooks:
        def emit(self, event: str, data: Any) -> None:
            seen.append((event, data))

    store = await PersistentContextManager.open(storage_path=storage, session_id="s", hooks=Hooks(),
                                                secret_scanner="builtin")
    await store.set_messages([{"role": "user", "content": "a"}, {"role": "user", "content": SAMPLES["jwt"]}])
    await store.replace_messages([{"role": "user", "content": SAMPLES["github_token"]}])
    assert await store.get_messages() == [{"role": "user", "content": "[secret:github_token]"}]
    await store.close()
    data = (storage / "s" / "events.jsonl").read_bytes()
    assert SAMPLES["jwt"].encode() not in data and SAMPLES["github_token"].encode() not in data
    recs = [orjson.loads(x) for x in data.splitlines()]
    assert recs[1]["data"]["secrets"] == [{"index": 1, "kind": "jwt", "count": 1}]
    assert [e for e, _ in seen].count("context:secret_redacted") == 2
    assert all(SAMPLES["jwt"] not in str(d) for _, d in seen)


async def test_imports_are_scanned(storage: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"role": "user", "content": "key " + SAMPLES["slack_token"]}) + b"\n")
    await import_(src, session_id="imp", storage_path=storage, secret_scanner="builtin")
    data = (storage / "imp" / "events.jsonl").read_bytes()
    assert SAMPLES["slack_token"].encode() not in data and b"[secret:slack_token]" in data
    assert b'"secrets":[{"index":0,"kind":"slack_token","count":1}]' in data


async def test_extra_patterns_and_callables(storage: Path) -> None:
    store = await _open(storage, secret_scanner=["builtin", {"name": "ticket", "pattern": r"TCK-\d{6}"}, r"pw=\S+"])
    await store.add_message({"role": "user", "content": "TCK-123456 pw=hunter2 " + SAMPLES["aws_access_key"]})
    assert (await store.get_messages())[0]["content"] == "[secret:ticket] [secret:custom] [secret:aws_access_key]"
    await store.close()

    def finder(text: str) -> list[tuple[int, int, str]]:
        at = text.find("swordfish")
        return [(at, at + 9, "password")] if at >= 0 else []

    store = await _open(storage, "c", secret_scanner=finder)
    await store.add_message({"role": "user", "content": "the word is swordfish"})
    assert (await store.get_messages())[0]["content"] == "the word is [secret:password]"
    await store.close()
    assert b"swordfish" not in (storage / "c" / "events.jsonl").read_bytes()


@pytest.mark.parametrize("value, match", [
    ("all", "secret_scanner must be"), (3, "secret_scanner must be"), ([{"name": "x"}], "secret_scanner\\[0\\]"),
    ([r"(unclosed"], "not a valid regular expression"), ([r"a*"], "matches the empty string"),
    ([{"name": "bad name!", "pattern": "x"}], "name must be"),
])
async def test_bad_settings_are_refused(storage: Path, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        await _open(storage, secret_scanner=value)
    assert not (storage / "s").exists()


def test_a_finder_returning_a_bad_span_is_an_error() -> None:
    scanner = SecretScanner({}, finder=lambda text: [(5, 2, "x")])
    with pytest.raises(ValueError, match="spans are"):
        scanner.find("abcdefgh")


async def test_a_resumed_replay_with_secrets_is_still_recognised(storage: Path) -> None:
    history = [{"role": "user", "content": "use " + SAMPLES["openai_api_key"]}, {"role": "assistant", "content": "ok"}]
    store = await _open(storage, secret_scanner="builtin")
    for m in history:
        await store.add_message(m)
    await store.close()
    store = await _open(storage, secret_scanner="builtin", recognise_replay=True)
    for m in history:  # a host replaying its transcript after a restart (written, then folded out)
        await store.add_message(m)
    await store.add_message({"role": "user", "content": "next"})  # confirms the replay
    assert await store.get_messages() == [{"role": "user", "content": "use [secret:openai_api_key]"},
                                          {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    await store.close()


def test_make_scanner_off_values() -> None:
    assert make_scanner(None) is None and make_scanner(False) is None
    s = make_scanner("builtin")
    assert s is not None and make_scanner(s) is s
    assert asyncio.iscoroutinefunction(PersistentContextManager.erase)


async def test_a_message_that_began_a_replay_keeps_its_secrets_note(storage: Path) -> None:
    secret = {"role": "user", "content": "use " + SAMPLES["aws_access_key"]}
    store = await _open(storage, secret_scanner="builtin")
    await store.add_message(secret)
    await store.add_message({"role": "assistant", "content": "ok"})
    await store.close()
    store = await _open(storage, secret_scanner="builtin", recognise_replay=True)
    await store.add_message(secret)  # looks like the start of a replay of the loaded history: written at once
    await store.add_message({"role": "user", "content": "something else"})  # it was not: both stay
    await store.close()
    recs = [orjson.loads(x) for x in (storage / "s" / "events.jsonl").read_bytes().splitlines()]
    added = [r for r in recs if r["type"] == "message_added"]
    assert len(added) == 4
    assert added[2]["data"]["secrets"] == [{"kind": "aws_access_key", "count": 1}]
    assert SAMPLES["aws_access_key"].encode() not in (storage / "s" / "events.jsonl").read_bytes()


def test_cli_import_with_the_scanner(storage: Path, tmp_path: Path) -> None:
    from context_persistent.cli import main

    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps({"role": "user", "content": "key " + SAMPLES["gitlab_token"]}) + b"\n")
    assert main(["--storage", str(storage), "import", str(src), "imp", "--secret-scanner", "builtin"]) == 0
    assert SAMPLES["gitlab_token"].encode() not in (storage / "imp" / "events.jsonl").read_bytes()


def _adversarial(literal: str, n: int) -> list[str]:
    """Texts of about ``n`` characters that make a backtracking pattern retry from many starts: the pattern's
    fixed string repeated with token characters, separators and dots between the copies."""
    return [(literal + tail) * (n // (len(literal) + len(tail)) + 1)
            for tail in ("", "Ab1-", "Ab1_", "aaaaaa.", "Ab1-" * 4 + ".", " ", "\n", "=")]


def _scan_seconds(scanner: Any, text: str) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        scanner.find(text)
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize("kind", sorted(BUILTIN_PATTERNS))
def test_every_builtin_pattern_runs_in_linear_time(kind: str) -> None:
    """Each built-in pattern scans adversarial repetitions of its fixed strings in time that grows with the
    text, not with its square: 16 times the text costs well under 16 x 16 times the time (a quadratic pattern,
    such as the old jwt one on ``eyJab-`` repeated, costs ~200x there; a linear one ~16x)."""
    scanner = SecretScanner({kind: BUILTIN_PATTERNS[kind]}, literals=BUILTIN_LITERALS)
    for literal in BUILTIN_LITERALS[kind]:
        for small, large in zip(_adversarial(literal, 12_000), _adversarial(literal, 192_000)):
            t_small, t_large = _scan_seconds(scanner, small), _scan_seconds(scanner, large)
            assert t_large < max(64 * t_small, 0.05), (kind, literal, small[:24], t_small, t_large)


def test_the_old_jwt_pattern_fails_the_linear_time_check() -> None:
    """The check above can fail: the jwt pattern as it was (a greedy header that may run over "-eyJ") is
    quadratic on ``eyJab-`` repeated."""
    old = SecretScanner({"jwt": r"\beyJ[A-Za-z0-9_\-]{5,}\.eyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}"})
    small, large = "eyJab-" * 500, "eyJab-" * 8_000
    assert _scan_seconds(old, large) > 64 * _scan_seconds(old, small)


def test_pgp_private_key_blocks_and_jwts_after_a_dash_are_caught() -> None:
    """A PGP private key block is a private key; a JWT is caught whatever precedes it, its payload and signature
    always inside the redacted span."""
    scanner = make_scanner("builtin")
    assert scanner is not None
    pgp = "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQOYBF0AAAAB\n-----END PGP PRIVATE KEY BLOCK-----"
    assert scanner.redact_text(f"key: {pgp} done", {}) == "key: [secret:private_key] done"
    jwt = SAMPLES["jwt"]
    for before in ("", "x-", "token=", "eyJab-", "eyJab-eyJcd-"):
        out = scanner.redact_text(before + jwt, {})
        assert jwt.split(".", 1)[1] not in out and out.endswith("[secret:jwt]"), (before, out)
