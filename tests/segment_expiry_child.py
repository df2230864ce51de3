"""Helper process for the segment expiry crash tests (run as a script, never imported by pytest).

``python tests/segment_expiry_child.py STORAGE``: apply ``max_segments: 1`` to the storage folder. The test sets
``CONTEXT_PERSISTENT_CRASH_AT`` to one of ``segment_expiry.STEPS``, where the process SIGKILLs itself. Prints
``DONE`` when it finished.
"""

from __future__ import annotations

import asyncio
import os
import sys

from context_persistent.operations import trash
from context_persistent.model.retention import RetentionPolicy


async def main(storage: str) -> None:
    await trash.apply_file(storage, RetentionPolicy(max_segments=1))
    os.write(1, b"DONE\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
