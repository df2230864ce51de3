"""The syncs of a resumed Amplifier turn with ``fsync: always``: one ``fdatasync`` of the log per message the
turn appends, nothing else (docs/performance.md, "The fixed cost of a turn"). The ignored transcript's audit
record, the usage report and the request view ride with the appends; no ``fsync`` (a file's metadata or a
folder) once the session exists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from context_persistent.integrations.amplifier import mount


class _Coordinator:
    session_id = "turn-syncs"
    hooks = None
    context: Any = None

    async def mount(self, point: str, instance: Any) -> None:
        self.context = instance


async def _turn(storage: Path, n: int, syncs: list[tuple[str, str, str]], phase: list[str]) -> None:
    c = _Coordinator()
    phase[0] = "mount"
    cleanup = await mount(c, {"storage_path": str(storage), "fsync": "always"})
    ctx = c.context
    history = await ctx.get_messages()
    phase[0] = "set_messages"
    await ctx.set_messages([m for m in history if m["role"] != "system"])  # the CLI's filtered transcript
    phase[0] = "add_message"
    await ctx.add_message({"role": "user", "content": f"turn {n}"})
    phase[0] = "request view"
    await ctx.get_messages_for_request()
    phase[0] = "record_usage"
    await ctx.record_usage({"input_tokens": 10, "output_tokens": 2}, provider="scripted", model="m")
    phase[0] = "add_message"
    await ctx.add_message({"role": "assistant", "content": f"reply {n}"})
    phase[0] = "cleanup"
    await cleanup()


async def test_a_resumed_turn_syncs_the_log_once_per_appended_message(storage: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[tuple[str, str, str]] = []
    phase = ["-"]
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def counted(fd: int, real: Any = real, name: str = name) -> None:
            syncs.append((phase[0], name, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
            real(fd)

        monkeypatch.setattr(os, name, counted)
    await _turn(storage, 1, syncs, phase)  # (a new session: its folder and log are created, and synced)
    syncs.clear()
    await _turn(storage, 2, syncs, phase)
    assert syncs == [("add_message", "fdatasync", "events.jsonl")] * 2
    records = [line for line in (storage / "turn-syncs" / "events.jsonl").read_text().splitlines()
               if '"seq"' in line]
    tail = [r.split('"type":"', 1)[1].split('"', 1)[0] for r in records[-4:]]
    assert tail == ["transcript_ignored", "message_added", "usage_reported", "message_added"]
