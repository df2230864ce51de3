"""Running the viewer: a random access token, a socket bound (loopback unless told otherwise), the URL on
stdout's first line, then uvicorn serving the app until Ctrl-C."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import sys
import webbrowser
from typing import Any, TextIO

from .extensions import Extensions
from .source import Source


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int, token: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"http://{shown}:{port}/?token={token}"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port). OSError if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # (listening before the URL is printed: a client that connects at once is queued)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def serve(source: Source, *, host: str = "127.0.0.1", port: int = 0, open_browser: bool = True,
          token: str | None = None, extensions: Extensions | None = None, out: TextIO = sys.stdout,
          err: TextIO = sys.stderr) -> None:
    """Serve the viewer until interrupted. The first line written to ``out`` is the URL to open."""
    import uvicorn

    from .app import create_app

    token = token or secrets.token_urlsafe(32)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    url = url_of(host, port, token)
    out.write(url + "\n")
    out.flush()
    if not is_loopback(host):
        err.write(f"context-persistent serve: warning: listening on {host}, not a loopback address: anyone who can "
                  "reach this port and has the token can read every session (use --host 127.0.0.1 to keep it "
                  "local)\n")
    err.write(f"context-persistent serve: showing {source.describe()} (read-only); Ctrl-C stops\n")
    err.flush()
    searching = None
    if extensions is None:  # (the search projection, without writing to the storage: search.py)
        from .search import ProjectionSearch

        searching = ProjectionSearch(source)
        extensions = Extensions(search=searching)
    app = create_app(source, token, port=port, extensions=extensions)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
    server = uvicorn.Server(config)
    if open_browser:
        _open_later(url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if searching is not None:
            searching.close()


def _open_later(url: str) -> None:
    """Open the URL in a browser without delaying the server (a browser that is missing is no error)."""
    import threading

    def run() -> Any:
        try:
            webbrowser.open(url)
        except Exception:
            pass

    threading.Thread(target=run, daemon=True).start()
