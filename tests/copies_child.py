"""Helper process for the erase-reaches-every-copy property test (run as a script, never imported by pytest).

``python tests/copies_child.py STORAGE OP ARG``: one operation on session ``s`` of STORAGE. It prints PAUSED
and sleeps where the test kills it in the middle of a file-writing step that has no named crash step
(``CONTEXT_PERSISTENT_CRASH_AT`` names the others: rolls, compression, checkpoints, repair, erase), else DONE.

OP: ``append N`` (N messages: segment rolls, compression, checkpoints), ``export PAUSE`` (the reasoning view
written as a compaction export, as export_on_compact writes it), ``fork NAME PAUSE``, ``expire`` (the oldest
sealed segments to the trash), ``purge PAUSE`` (delete the trash entries), ``repair``, ``erase SEQ``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from context_persistent import PersistentContextManager

CONFIG: dict[str, Any] = {"segment_bytes": 4096, "compress_sealed": True, "checkpoint_every": 7, "fsync": "always"}


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


def _pause() -> None:
    _say("PAUSED")
    time.sleep(3600)


async def _open(storage: str) -> PersistentContextManager:
    return await PersistentContextManager.open(storage_path=storage, session_id="s", recognise_replay=False,
                                               **CONFIG)


async def main(storage: str, op: str, args: list[str]) -> None:
    from context_persistent.transfer import atomic_files, new_session

    pause = args[-1:] == ["pause"]
    if op == "append":
        store = await _open(storage)
        for i in range(int(args[0])):
            await store.add_message({"role": "user" if i % 2 else "assistant", "content": f"filler {i} " + "f" * 300})
        await store.close()
    elif op == "export":
        store = await _open(storage)
        path = Path(storage) / "s" / f"compaction-{os.getpid():010d}.jsonl"
        scratch = Path(storage).parent / "scratch.jsonl"
        await store.export(scratch, view="reasoning")
        data = scratch.read_bytes()
        scratch.unlink()

        async def chunks() -> Any:
            yield data
            if pause:  # killed with the temp file written and not yet renamed
                await asyncio.to_thread(_pause)

        await atomic_files.write_atomic(path, chunks())
        await store.close()
    elif op == "fork":
        store = await _open(storage)
        if pause:  # killed with the new session's temp folder written, before its rename
            real = new_session.fsync_dir

            def fsync_then_pause(path: Any) -> None:
                real(path)
                if Path(path).name.startswith(new_session.TMP_PREFIX):
                    _pause()

            new_session.fsync_dir = fsync_then_pause  # type: ignore[assignment]
        await store.fork(args[0])
        await store.close()
    elif op == "expire":
        from context_persistent.model.retention import RetentionPolicy
        from context_persistent.operations import trash

        await trash.apply_file(storage, RetentionPolicy(max_segments=1, grace_days=0))
    elif op == "purge":
        from context_persistent.operations import trash

        if pause:  # killed after the rename to .purging-<entry>, with part of its files deleted
            def rmtree_then_pause(path: Any, *a: Any, **k: Any) -> None:
                files = sorted(Path(path).iterdir())
                for f in files[: len(files) // 2]:
                    f.unlink()
                _pause()

            trash.shutil.rmtree = rmtree_then_pause  # type: ignore[attr-defined]
        await trash.purge(storage, force=True)
    elif op == "repair":
        from context_persistent.operations.repair import repair

        repair(Path(storage) / "s", "s")
    elif op == "erase":
        store = await _open(storage)
        try:
            await store.erase(seq=int(args[0]), reason="property test")
        except ValueError as e:
            _say(f"REFUSED {e}")
        await store.close()
    else:
        raise SystemExit(f"unknown op {op}")
    _say("DONE")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
