"""The access token every request must carry, and the headers every answer gets (an ASGI middleware).

The token is given once, in the URL ``serve`` prints (``/?token=...``, as Jupyter does); that first page
answers with a cookie holding it and sends the browser to the same address without it, so the token does
not stay in the address bar or the history. Every later request carries the cookie (``EventSource``
too), or an ``Authorization: Bearer`` header for scripts. Without a token the answer is 401, with a wrong
one 403, for every path: pages, assets and the API.

Cookies are not separated by port, so the cookie's name holds the port: two viewers on one machine do not
overwrite each other's. The headers forbid what the page never needs (scripts and styles from anywhere but
the viewer, inline scripts, frames, the referrer), so even content that slipped into the document as HTML
could not run (docs/viewer.md, "Hostile content").
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


def cookie_name(port: int) -> str:
    return f"context_persistent_viewer_{port}"


class TokenGate:
    """Refuses every HTTP request without the token (401) or with another one (403)."""

    def __init__(self, app: ASGIApp, token: str, cookie: str) -> None:
        if len(token) < 16:
            raise ValueError("the access token must be at least 16 characters")
        self.app = app
        self.token = token.encode()
        self.cookie = cookie

    def _given(self, scope: Scope) -> tuple[str | None, bool]:
        """The token the request carries and whether it came in the query string."""
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if "token" in query:
            return query["token"], True
        headers = dict(scope.get("headers") or ())
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip(), False
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:  # (a malformed Cookie header is no token)
            return None, False
        morsel = jar.get(self.cookie)
        return (morsel.value if morsel is not None else None), False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token, in_query = self._given(scope)
        if token is None:
            await _refuse(send, 401, "this viewer needs its access token: open the URL `context-persistent serve` "
                                     "printed (it ends with ?token=...)")
            return
        if not hmac.compare_digest(token.encode(), self.token):
            await _refuse(send, 403, "wrong access token: open the URL `context-persistent serve` printed")
            return
        if in_query and scope.get("method") == "GET" and not scope["path"].startswith("/api/"):
            await self._set_cookie_and_redirect(scope, send, token)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers") or []) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)

    async def _set_cookie_and_redirect(self, scope: Scope, send: Send, token: str) -> None:
        rest = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k != "token"]
        location = scope["path"] + ("?" + urlencode(rest) if rest else "")
        cookie = f"{self.cookie}={token}; Path=/; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode()),
                                (b"content-length", b"0"), *SECURITY_HEADERS]})
        await send({"type": "http.response.body", "body": b""})


async def _refuse(send: Send, status: int, text: str) -> None:
    body = f"{status} {'Unauthorized' if status == 401 else 'Forbidden'}: {text}\n".encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS]})
    await send({"type": "http.response.body", "body": body})
