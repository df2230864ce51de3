"""The calls the Amplifier CLI makes of its context module, in-process: a resumed turn and an interactive one.

What ``amplifier run --resume`` asks of the module in one turn (docs/amplifier.md, ../shared/docs/AMPLIFIER.md),
made through the mount (``mount(coordinator, config)``, the store the CLI gets: ``HostContext``) on a session of
``turns_messages`` messages of 300 B (a system prompt first, as the CLI's sessions have), fsync=always:
``mount``, the system prompt factory, ``get_messages()`` (before the transcript is restored),
``set_messages(transcript)`` (the CLI's transcript.jsonl: the history without its system prompt), ``get_messages()``
twice (the system prompt check, the pre-turn repair check), ``add_message`` (the prompt),
``get_messages_for_request(provider=...)``, the ``provider:response`` hook (``record_usage``), ``add_message`` (the
answer), ``get_messages()`` (the transcript saved) and the cleanup. Each resumed turn opens a new store, as the
CLI's new process does (the interpreter's imports stay loaded: the real CLI's rows are bench_amplifier_cli's).
The same calls are made of an in-memory list with context-simple's semantics (``list(...)`` of its messages):
the floor.

The interactive rows: one store (one ``amplifier`` session) and ``turns_interactive`` turns, each
``get_messages()`` (the repair check), ``add_message``, ``get_messages_for_request``, the hook, ``add_message``
and ``get_messages()`` (the transcript saved), at fsync=never (what the module computes) and fsync=always (plus
two syncs of the disk), in wall-clock time and (fsync=never) in the process's CPU time; and the same turns of an
in-memory list with context-simple's semantics (its three lists of the history a turn: the floor). Targets
(issue #23): inside the module at most 50 ms a resumed turn at 10k messages and 500 ms at 100k; at most 5 ms an
interactive turn at 100k.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ._harness import Ctx, Row, info, median
from .workloads import sized_messages

GROUP = "amplifier-turns"
SYSTEM = "You are the benchmark agent."


class _Hooks:
    def __init__(self) -> None:
        self.handlers: dict[str, list[Any]] = {}

    def register(self, event: str, handler: Any, name: str | None = None) -> Any:
        self.handlers.setdefault(event, []).append(handler)
        return lambda: None

    async def emit(self, event: str, data: dict[str, Any]) -> None:
        for handler in self.handlers.get(event, []):
            await handler(event, data)


class _Info:
    defaults = {"model": "scripted-1", "context_window": 1_000_000_000, "max_output_tokens": 4000}


class _Provider:
    name = "scripted"

    def get_info(self) -> _Info:
        return _Info()


class _Coordinator:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.parent_id = None
        self.hooks = _Hooks()
        self.provider = _Provider()
        self.mounted: dict[str, Any] = {}

    async def mount(self, point: str, instance: Any, name: str | None = None) -> None:
        self.mounted[point] = instance

    def get(self, what: str) -> Any:
        return {"scripted": self.provider} if what == "providers" else self.mounted.get(what)


class _Simple:
    """context-simple's semantics, in memory: its ``get_messages`` is ``list(self.messages)``."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)

    async def get_messages(self) -> list[dict[str, Any]]:
        return list(self.messages)

    async def set_messages(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)

    async def add_message(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    async def get_messages_for_request(self, provider: Any = None) -> list[dict[str, Any]]:
        return list(self.messages)


async def _calls(ctx: Any, coordinator: _Coordinator, transcript: list[dict[str, Any]], prompt: str,
                 times: dict[str, float]) -> list[dict[str, Any]]:
    """The CLI's calls of one resumed turn (after the mount), each timed into ``times`` (ms)."""
    async def timed(name: str, call: Any) -> Any:
        t = time.perf_counter()
        out = await call
        times[name] = times.get(name, 0.0) + (time.perf_counter() - t) * 1000
        return out

    async def factory() -> str:
        return SYSTEM

    if hasattr(ctx, "set_system_prompt_factory"):
        await timed("set_system_prompt_factory", ctx.set_system_prompt_factory(factory))
    await timed("get_messages (3 calls)", ctx.get_messages())
    await timed("set_messages", ctx.set_messages(transcript))
    for _ in range(2):
        await timed("get_messages (3 calls)", ctx.get_messages())
    await timed("add_message (2 calls)", ctx.add_message({"role": "user", "content": prompt}))
    view = await timed("get_messages_for_request", ctx.get_messages_for_request(provider=coordinator.provider))
    usage = {"input_tokens": 80 * len(view), "output_tokens": 5}
    await timed("provider:response hook", coordinator.hooks.emit(
        "provider:response", {"provider": "scripted", "usage": usage, "session_id": coordinator.session_id}))
    await timed("add_message (2 calls)", ctx.add_message({"role": "assistant", "content": "reply to: " + prompt}))
    saved = await timed("get_messages (save)", ctx.get_messages())
    return [m for m in saved if m.get("role") not in ("system", "developer")]


async def _resumed(storage: Path, sid: str, transcript: list[dict[str, Any]], prompt: str
                   ) -> tuple[float, dict[str, float], list[dict[str, Any]]]:
    from context_persistent.integrations.amplifier import mount

    coordinator = _Coordinator(sid)
    times: dict[str, float] = {}
    t = time.perf_counter()
    cleanup = await mount(coordinator, {"storage_path": str(storage), "fsync": "always"})
    times["mount"] = (time.perf_counter() - t) * 1000
    saved = await _calls(coordinator.mounted["context"], coordinator, transcript, prompt, times)
    c = time.perf_counter()
    await cleanup()
    times["cleanup"] = (time.perf_counter() - c) * 1000
    return (time.perf_counter() - t) * 1000, times, saved


async def _simple(transcript: list[dict[str, Any]], prompt: str) -> float:
    coordinator = _Coordinator("simple")
    ctx = _Simple([{"role": "system", "content": SYSTEM}])
    t = time.perf_counter()
    await _calls(ctx, coordinator, transcript, prompt, {})
    return (time.perf_counter() - t) * 1000


async def _turns(ctx: Any, coordinator: _Coordinator, turns: int) -> tuple[list[float], list[float]]:
    """``turns`` interactive turns of ``ctx``: (wall-clock ms, CPU ms of the process) of each."""
    provider = coordinator.provider
    await ctx.get_messages()
    await ctx.get_messages_for_request(provider=provider)
    wall, cpu = [], []
    for turn in range(turns):
        t, c = time.perf_counter(), time.process_time()
        await ctx.get_messages()
        await ctx.add_message({"role": "user", "content": f"interactive turn {turn}"})
        view = await ctx.get_messages_for_request(provider=provider)
        await coordinator.hooks.emit("provider:response", {
            "provider": "scripted", "usage": {"input_tokens": 80 * len(view), "output_tokens": 5},
            "session_id": coordinator.session_id})
        del view
        await ctx.add_message({"role": "assistant", "content": f"reply {turn}"})
        await ctx.get_messages()
        wall.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    return wall, cpu


async def _interactive(storage: Path, sid: str, turns: int, fsync: str) -> tuple[list[float], list[float]]:
    from context_persistent.integrations.amplifier import mount

    coordinator = _Coordinator(sid)
    cleanup = await mount(coordinator, {"storage_path": str(storage), "fsync": fsync})
    try:
        return await _turns(coordinator.mounted["context"], coordinator, turns)
    finally:
        await cleanup()


async def _interactive_simple(history: list[dict[str, Any]], turns: int) -> tuple[list[float], list[float]]:
    """The same turns of an in-memory list with context-simple's semantics, whose messages are distinct dicts
    as a real history's are (``sized_messages`` repeats 16: copying a list of them stays in the CPU's cache)."""
    from context_persistent.model.events import copy_json

    return await _turns(_Simple(copy_json(history)), _Coordinator("simple"), turns)


async def _grow(storage: Path, sid: str, history: list[dict[str, Any]]) -> None:
    from context_persistent import PersistentContextManager

    store = await PersistentContextManager.open(storage_path=storage, session_id=sid, fsync="never")
    try:
        await store.add_messages(history)
    finally:
        await store.close()


def run(ctx: Ctx) -> list[Row]:
    ctx.defaults(quick={"turns_messages": 10_000, "turns_large": 100_000, "turns_rounds": 3, "turns_interactive": 30},
                 full={"turns_messages": 10_000, "turns_large": 100_000, "turns_rounds": 5, "turns_interactive": 100})
    rows: list[Row] = []
    sizes = [n for n in (ctx.size("turns_messages"), ctx.size("turns_large")) if n]
    for n in sizes:
        storage = ctx.tempdir(f"turns-{n}")
        sid = "cli-session"
        history = [{"role": "system", "content": SYSTEM}] + sized_messages(n, 300)
        ctx.log(f"a session of {n:,} messages of 300 B")
        asyncio.run(_grow(storage, sid, history))
        transcript = history[1:]
        asyncio.run(_resumed(storage, sid, transcript, "warm-up"))  # (the session as the CLI has resumed it before)
        ours, floor, calls = [], [], {}  # type: ignore[var-annotated]
        for r in range(ctx.size("turns_rounds")):
            ctx.log(f"{n:,} messages, resumed turn {r + 1}")
            total, times, transcript = asyncio.run(_resumed(storage, sid, transcript, f"turn {r}"))
            ours.append(sum(times.values()))
            floor.append(asyncio.run(_simple(transcript, f"turn {r}")))
            for name, ms in times.items():
                calls.setdefault(name, []).append(ms)
        target = {10_000: "<= 50 ms", 100_000: "<= 500 ms"}.get(n, "")
        rows.append(info(GROUP, f"{n:,} x 300 B: resumed turn, inside the module (new store), ours", median(ours),
                         "ms", samples=ours, note=f"target {target}" if target else ""))
        rows.append(info(GROUP, f"{n:,} x 300 B: resumed turn, the same calls of an in-memory list "
                                f"(context-simple's semantics)", median(floor), "ms", samples=floor))
        for name in sorted(calls, key=lambda k: -median(calls[k])):
            rows.append(info(GROUP, f"{n:,} x 300 B: resumed turn, ours, {name}", median(calls[name]), "ms",
                             samples=calls[name]))
        for fsync in ("never", "always"):
            ctx.log(f"{n:,} messages, interactive turns, fsync={fsync}")
            turns, cpu = asyncio.run(_interactive(storage, sid, ctx.size("turns_interactive"), fsync))
            rows.append(info(GROUP, f"{n:,} x 300 B: interactive turn (one store), fsync={fsync}, ours",
                             median(turns), "ms", samples=turns,
                             note="target <= 5 ms at 100k" if fsync == "never" else "plus two syncs of the disk"))
            if fsync == "never":  # (CPU time: what the turn computes, whatever else the cores run meanwhile)
                rows.append(info(GROUP, f"{n:,} x 300 B: interactive turn (one store), fsync=never, ours, CPU",
                                 median(cpu), "ms", samples=cpu))
        ctx.log(f"{n:,} messages, interactive turns of an in-memory list")
        _, cpu = asyncio.run(_interactive_simple(history, ctx.size("turns_interactive")))
        rows.append(info(GROUP, f"{n:,} x 300 B: interactive turn, the same calls of an in-memory list "
                                f"(context-simple's semantics, distinct dicts), CPU", median(cpu), "ms", samples=cpu,
                         note="the floor: three lists of the history a turn"))
    return rows
