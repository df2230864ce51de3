"""``serve``: the local, read-only web viewer of the sessions (docs/viewer.md). Needs the ``[viewer]`` extra."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ContextPersistentError
from . import backend_of, require_storage


class ViewerUnavailableError(ContextPersistentError):
    """The viewer cannot run: its extra is not installed, or its address cannot be listened on (exit 1)."""

EXAMPLES = """examples:
  context-persistent serve                           the sessions of the default storage; opens a browser
  context-persistent serve --storage /srv/agents --no-browser
  context-persistent serve --port 8765               a fixed port (default: a free one)
  context-persistent serve --dsn postgresql://localhost/agents
  context-persistent serve --host 0.0.0.0            other machines too (a warning says so; the token still guards it)
"""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port between 0 and 65535 (0: a free one), got {text!r}")
    return value


def _serve(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        from ..viewer.server import serve
        from ..viewer.source import Source
    except ImportError as e:
        raise ViewerUnavailableError(f"the viewer needs the [viewer] extra ({e.name} is not installed): "
                                   "pip install 'context-persistent[viewer]'") from None
    backend = backend_of(args)
    storage = require_storage(args)
    try:
        serve(Source(storage, backend), host=args.host, port=args.port, open_browser=not args.no_browser)
    except OSError as e:
        raise ViewerUnavailableError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    help_ = "a local, read-only web viewer of the sessions (prints the URL with its access token first)"
    p = sub.add_parser("serve", parents=[common], help=help_, description=help_, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1; any other than loopback is warned about)")
    p.add_argument("--port", type=_port, default=0, help="the port (default 0: a free one, shown in the URL)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser; only print the URL")
    p.set_defaults(func=_serve)
