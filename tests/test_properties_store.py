"""Property: for any sequence of add/set/clear/pin commands, reopening yields the in-memory fold."""

from __future__ import annotations

import asyncio
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_persistent import PersistentContextManager
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"])
text = st.text(max_size=20)
content = st.none() | text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
message = st.builds(lambda r, c, extra: {"role": r, "content": c, **extra}, roles, content,
                    st.dictionaries(st.sampled_from(["name", "metadata"]), text, max_size=1))
#: Replay recognition (tests/test_replay.py) is off here: the model is "every add is stored".
OPTS = {"recognise_replay": False}
command = st.one_of(
    st.tuples(st.just("add"), message),
    st.tuples(st.just("set"), st.lists(message, max_size=4)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("pin"), st.integers(0, 10)),
    st.tuples(st.just("reopen"), st.none()),
)


def _lead(model: list) -> int:
    n = 0
    while n < len(model) and model[n]["role"] == "system":
        n += 1
    return n


async def _run(commands: list, fsync: str) -> None:
    """The model follows docs/resume.md: a set_messages is accepted on a fresh store or after this process's
    clear(), else only as a recognised repair; a system message added at the start of a resumed session
    replaces the leading system messages."""
    from context_persistent.model.resume import REPAIR, classify

    with tempfile.TemporaryDirectory() as d:
        model: list = []
        loaded = cleared_here = False
        start: list | None = None
        s = await PersistentContextManager.open(storage_path=d, session_id="p", fsync=fsync, **OPTS)
        try:
            for kind, arg in commands:
                if kind == "add":
                    await s.add_message(arg)
                    meta = arg.get("metadata")
                    if start is not None and arg["role"] == "system" and not (
                            isinstance(meta, dict) and meta.get("source") == "hook"):
                        start = [*start, arg]
                        model = [*start, *model[_lead(model):]]
                    else:
                        start = None
                        model.append(arg)
                elif kind == "set":
                    verdict, merged = classify(model, arg)
                    await s.set_messages(arg)
                    start = None
                    if not loaded or cleared_here:
                        model = list(arg)
                    elif verdict == REPAIR:
                        model = merged
                elif kind == "clear":
                    await s.clear()
                    model, cleared_here, start = [], True, None
                elif kind == "pin" and arg < len(model):
                    await s.pin(arg)
                    start = None
                elif kind == "reopen":
                    await s.close()
                    s = await PersistentContextManager.open(storage_path=d, session_id="p", fsync=fsync, **OPTS)
                    loaded, cleared_here = s.loaded_from_file, False
                    start = [] if loaded else None
                assert await s.get_messages() == model
            await s.close()
            s = await PersistentContextManager.open(storage_path=d, session_id="p", readonly=True)
            assert await s.get_messages() == model
        finally:
            await s.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commands=st.lists(command, max_size=12), fsync=st.sampled_from(["always", "batch", "never"]))
def test_reopen_equals_fold(commands: list, fsync: str) -> None:
    """Reopening the log at any point yields exactly the history the commands describe."""
    asyncio.run(_run(commands, fsync))
