"""What the command modules share besides their output (output.py): opening a session read-only, a
subcommand's parser with its examples, running an async command, and the argparse types for seqs, counts and
seconds."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..storage.pages import STREAM_CACHE_BYTES
from . import backend_of, require_storage

async def _open(args: argparse.Namespace, session: str) -> Any:
    from ..store.manager import PersistentContextManager

    return await PersistentContextManager.open(storage_path=require_storage(args), session_id=session,
                                               readonly=True, page_cache_bytes=STREAM_CACHE_BYTES,  # (a pass: no residency)
                                               **backend_of(args))


def _run(coro_fn: Any) -> Any:
    return lambda args: asyncio.run(coro_fn(args))


#: The largest seq or count a command takes: the store's integers are 64-bit.
MAX_INT = 2**63 - 1


def _whole_number(what: str, minimum: int = 1) -> Any:
    """An argparse type: an integer from ``minimum`` to MAX_INT, with ``what`` named in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if not minimum <= value <= MAX_INT:
            raise argparse.ArgumentTypeError(f"expected {what} (an integer from {minimum} to {MAX_INT}), got {text!r}")
        return value

    return parse


def _how_many(text: str) -> int:
    """An argparse type for ``-n N``: a count >= 0; a count larger than any history means all of it (as
    ``tail -n`` takes it), never an overflow."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of messages or events (an integer >= 0), got {text!r}")
    return min(value, MAX_INT)


_seq = _whole_number("an event seq")
_positive = _whole_number("a positive integer")
_after_seq = _whole_number("an event seq", minimum=0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _parser(sub: Any, common: argparse.ArgumentParser, name: str, help_: str, examples: str) -> Any:
    return sub.add_parser(name, parents=[common], help=help_, description=help_,
                          epilog="examples:\n" + examples, formatter_class=argparse.RawDescriptionHelpFormatter)
