"""Where features meet: the secret scanner, erasure, the system prompt, replay folding and the CLI together."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from pgfixtures import pg_config, pg_dsn, pg_schema, sid  # noqa: F401

from context_persistent import PersistentContextManager
from context_persistent.cli import main
from context_persistent.operations.repair import verify

AWS = "AKIAIOSFODNN7EXAMPLE"


async def _open(storage: Path, session: str = "s", **cfg: Any) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id=session, **cfg)


def _folder_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.is_file())


async def test_a_secret_in_the_factory_system_prompt_never_reaches_disk(storage: Path) -> None:
    store = await _open(storage, secret_scanner="builtin")

    async def factory() -> str:
        return f"You are a bot. key={AWS}"

    await store.set_system_prompt_factory(factory)
    await store.add_message({"role": "user", "content": "hi"})
    view = await store.get_messages_for_request()
    assert view[0] == {"role": "system", "content": "You are a bot. key=[secret:aws_access_key]"}
    size = (storage / "s" / "events.jsonl").stat().st_size
    await store.get_messages_for_request()  # the same prompt: nothing more is written
    assert (storage / "s" / "events.jsonl").stat().st_size == size
    await store.close()
    assert AWS.encode() not in _folder_bytes(storage / "s")


async def test_a_secret_in_a_system_prompt_added_at_a_resume_never_reaches_disk(storage: Path) -> None:
    store = await _open(storage, secret_scanner="builtin")
    await store.add_message({"role": "system", "content": "old"})
    await store.add_message({"role": "user", "content": "hi"})
    await store.close()
    store = await _open(storage, secret_scanner="builtin")
    await store.add_message({"role": "system", "content": f"new {AWS}"})
    assert (await store.get_messages())[0] == {"role": "system", "content": "new [secret:aws_access_key]"}
    await store.close()
    data = (storage / "s" / "events.jsonl").read_bytes()
    assert AWS.encode() not in data
    assert orjson.loads(data.splitlines()[-1])["data"]["secrets"] == [{"kind": "aws_access_key", "count": 1}]


PROMPT = {"role": "system", "content": "You assist Alice Example, passport X1234567."}


async def test_erase_removes_a_system_prompt_copied_into_a_system_prompt_set(storage: Path) -> None:
    await _erase_a_copied_prompt(storage, "s", {})
    assert b"X1234567" not in (storage / "s" / "events.jsonl").read_bytes()
    assert verify(storage / "s", "s").ok


@pytest.mark.postgres
async def test_erase_removes_a_copied_system_prompt_on_postgres(pg_config: dict[str, str], sid: str,
                                                                storage: Path) -> None:
    await _erase_a_copied_prompt(storage, sid, pg_config)


async def _erase_a_copied_prompt(storage: Path, sid: str, cfg: dict[str, Any]) -> None:
    store = await _open(storage, sid, **cfg)
    await store.add_message(PROMPT)  # seq 2
    await store.add_message({"role": "user", "content": "hi"})
    await store.close()
    store = await _open(storage, sid, **cfg)  # a resume: the host's fallback adds the same prompt again
    await store.add_message(PROMPT)  # seq 4: a system_prompt_set holding a copy
    await store.add_message({"role": "user", "content": "again"})
    receipt = await store.erase(seq=2, reason="gdpr")
    assert [(r["seq"], r["type"]) for r in receipt["records"]] == [(2, "message_added"), (4, "system_prompt_set")]
    assert await store.verify_erasure(receipt) == []
    expected = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    assert await store.get_messages() == expected
    await store.close()
    store = await _open(storage, sid, readonly=True, **cfg)
    assert await store.get_messages() == expected
    await store.close()


async def test_the_current_factory_prompt_can_be_erased(storage: Path) -> None:
    store = await _open(storage)

    async def factory() -> str:
        return PROMPT["content"]

    await store.set_system_prompt_factory(factory)
    await store.add_message({"role": "user", "content": "hi"})
    await store.get_messages_for_request()
    await store.set_system_prompt_factory(None)
    await store.erase(message_index=0)
    assert await store.get_messages() == [{"role": "user", "content": "hi"}]
    await store.close()
    assert b"X1234567" not in (storage / "s" / "events.jsonl").read_bytes()
    store = await _open(storage, readonly=True)
    assert await store.get_messages() == [{"role": "user", "content": "hi"}]
    await store.close()


async def test_time_travel_hides_an_earlier_copy_of_a_redacted_system_prompt(storage: Path) -> None:
    store = await _open(storage)
    await store.add_message(PROMPT)  # seq 2
    await store.add_message({"role": "user", "content": "hi"})
    await store.close()
    store = await _open(storage)
    await store.add_message(PROMPT)  # seq 4: system_prompt_set, the same prompt under a new key
    await store.add_message({"role": "user", "content": "again"})
    await store.redact(message_index=0)
    for seq in (2, 3, 5):
        past = await store.at(seq)
        assert PROMPT not in await past.get_messages(), seq
        await past.close()
    await store.close()


async def test_time_travel_hides_a_redacted_message_of_a_partly_erased_list(storage: Path) -> None:
    store = await _open(storage)
    kept = {"role": "user", "content": "kept then redacted"}
    await store.add_message(kept)  # seq 2
    await store.set_messages([{"role": "user", "content": "erase me"}, kept])  # seq 3 (a fresh store: accepted)
    await store.erase(seq=3, index=0)  # seq 3 is now a tombstone holding `kept` at index 1
    await store.redact(message_index=0)  # the key of `kept` in seq 3
    past = await store.at(2)
    assert kept not in await past.get_messages()
    await past.close()
    await store.close()


@pytest.mark.parametrize("erase_seq", [3, 6])
async def test_erasing_a_message_whose_replay_was_folded_keeps_the_session_loadable(storage: Path,
                                                                                    erase_seq: int) -> None:
    user = {"role": "user", "content": "my passport is X1234567"}
    reply = {"role": "assistant", "content": "noted"}
    store = await _open(storage)
    await store.add_message({"role": "system", "content": "p"})  # seq 2
    await store.add_message(user)  # seq 3
    await store.add_message(reply)  # seq 4
    await store.close()
    store = await _open(storage, recognise_replay=True)
    await store.add_message({"role": "system", "content": "p"})  # seq 5: session start (system_prompt_set)
    await store.add_message(user)  # seq 6: the host replays the loaded history ...
    await store.add_message(reply)  # seq 7
    await store.add_message({"role": "user", "content": "next"})  # seq 8: fold (replay_recognised), seq 9
    assert [r["type"] for r in [orjson.loads(x) for x in (storage / "s" / "events.jsonl").read_bytes().splitlines()]
            ][7] == "replay_recognised"
    await store.erase(seq=erase_seq)  # both copies (seq 3 and seq 6) go
    expected = [{"role": "system", "content": "p"}, reply, {"role": "user", "content": "next"}]
    assert await store.get_messages() == expected
    await store.close()
    store = await _open(storage)
    assert await store.get_messages() == expected
    past = await store.at(8)
    assert await past.get_messages() == expected[:2]
    await past.close()
    await store.close()
    assert b"X1234567" not in (storage / "s" / "events.jsonl").read_bytes()
    assert verify(storage / "s", "s").ok


async def test_tail_describes_the_new_event_types(storage: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = await _open(storage)
    await store.add_message({"role": "system", "content": "p"})
    await store.add_message({"role": "user", "content": "u"})
    await store.close()
    store = await _open(storage, recognise_replay=True)
    await store.add_message({"role": "system", "content": "the new prompt"})
    await store.add_message({"role": "user", "content": "u"})
    await store.add_message({"role": "user", "content": "next"})
    await store.set_messages([{"role": "user", "content": "u"}])
    await store.close()
    assert await asyncio.to_thread(main, ["--storage", str(storage), "tail", "s"]) == 0
    out = capsys.readouterr().out
    assert "system prompt (add_message): the new prompt" in out
    assert "1 replayed messages folded out of the views (seq 5)" in out
    assert "set_messages of 1 messages ignored (" in out
    assert '{"' not in out  # no raw JSON for a known type


async def test_erase_never_writes_through_a_link_planted_as_its_temp_file(storage: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import context_persistent.operations.erasure as erasure

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not the store's")
    store = await _open(storage)
    await store.add_message({"role": "user", "content": "passport X1234567"})
    await store.add_message({"role": "user", "content": "ok"})
    real = erasure.clean_leftovers

    def clean_then_plant(directory: Path, **kw: Any) -> list[str]:  # a link appearing right after the clean-up
        gone = real(directory, **kw)
        (directory / "events.jsonl.erasing").symlink_to(outside)
        return gone

    monkeypatch.setattr(erasure, "clean_leftovers", clean_then_plant)
    await store.erase(seq=2)
    assert outside.read_bytes() == b"not the store's"
    assert await store.get_messages() == [{"role": "user", "content": "ok"}]
    await store.close()
    assert b"X1234567" not in (storage / "s" / "events.jsonl").read_bytes()


async def test_a_repair_quarantining_a_replayed_copy_leaves_a_loadable_log(storage: Path) -> None:
    user, reply = {"role": "user", "content": "u1"}, {"role": "assistant", "content": "r1"}
    store = await _open(storage)
    for m in ({"role": "system", "content": "p"}, user, reply):
        await store.add_message(m)
    await store.close()
    store = await _open(storage, recognise_replay=True)
    for m in ({"role": "system", "content": "p"}, user, reply, {"role": "user", "content": "next"}):
        await store.add_message(m)  # seq 5..7 and 9; seq 8 folds the replay (seq 6, 7) out of the views
    await store.close()
    log = storage / "s" / "events.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    assert b'"seq":6,' in lines[5] and b'"replay_recognised"' in lines[7]
    lines[5] = lines[5].replace(b'"u1"', b'"u2"')  # one flipped byte in the replayed copy
    log.write_bytes(b"".join(lines))
    st = ["--storage", str(storage)]
    assert await asyncio.to_thread(main, [*st, "repair", "s"]) == 0
    assert verify(storage / "s", "s").ok
    store = await _open(storage)
    assert await store.get_messages() == [{"role": "system", "content": "p"}, user, reply,
                                          {"role": "user", "content": "next"}]
    await store.close()


async def test_erasing_a_pinned_message_leaves_no_pin(storage: Path) -> None:
    store = await _open(storage, checkpoint_every=2)
    await store.add_message({"role": "user", "content": "passport X1234567"})
    await store.add_message({"role": "user", "content": "b"})
    await store.pin(0)  # seq 4 pins seq 2, which the erasure turns into a tombstone
    await store.erase(0)
    assert store.stats()["pinned"] == 0
    await store.add_message({"role": "assistant", "content": "c"})
    await store.close()
    store = await _open(storage)
    assert store.stats()["pinned"] == 0 and store._state.pinned == set()
    await store.close()


async def test_a_host_repair_keeps_the_secrets_note_of_what_it_added(storage: Path) -> None:
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    store = await _open(storage, secret_scanner="builtin")
    await store.add_message({"role": "user", "content": "go"})
    await store.add_message(call)
    await store.close()
    store = await _open(storage, secret_scanner="builtin")
    history = await store.get_messages()
    result = {"role": "tool", "tool_call_id": "c1", "content": f"interrupted; key {AWS}"}
    await store.set_messages([*history, result])  # the host's repair: one result for the unanswered call
    assert (await store.get_messages())[-1]["content"] == "interrupted; key [secret:aws_access_key]"
    await store.close()
    last = orjson.loads((storage / "s" / "events.jsonl").read_bytes().splitlines()[-1])
    assert last["type"] == "messages_replaced" and last["data"]["reason"] == "host_repair"
    assert last["data"]["secrets"] == [{"index": 2, "kind": "aws_access_key", "count": 1}]
    assert AWS.encode() not in (storage / "s" / "events.jsonl").read_bytes()
