"""The viewer's web app (Starlette): the page, its assets, and a read-only JSON API over a :class:`Source`.

Every route reads; none writes to the storage (an export is written to a private temporary folder outside
it and deleted once sent). The API's answers are the stored JSON, clipped (shaping.py); the page turns them
into text nodes, never HTML. docs/viewer.md lists the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import __version__
from ..errors import ContextPersistentError, SessionNotFoundError
from ..model import events as ev
from .extensions import Extensions
from .gate import TokenGate, cookie_name
from .shaping import clip, shape_record
from .source import Source
from .timeline import follow_records, read_records, timeline_page
from .usage import USAGE_POINTS, LogUsage, thin
from .views import messages_page, request_compare, token_series

STATIC = Path(__file__).parent / "static"
#: Seconds between the comments that keep a live-follow stream open through idle proxies and tell a closed
#: browser tab from an open one.
HEARTBEAT = 15.0
EXPORT_FORMATS = {"jsonl": "application/x-ndjson", "json": "application/json", "markdown": "text/markdown"}
_EXT = {"jsonl": "jsonl", "json": "json", "markdown": "md"}


class JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def _int(request: Request, name: str, default: int | None = None) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {text!r}") from None


Handler = Callable[[Request], Awaitable[Response]]


def _answers(fn: Handler) -> Handler:
    """A route whose errors become JSON answers: 400 for a bad request, 404 for no such session, 500 for a
    log that cannot be read (its message says why)."""

    async def run(request: Request) -> Response:
        try:
            return await fn(request)
        except SessionNotFoundError as e:
            return JSON({"error": str(e)}, status_code=404)
        except ContextPersistentError as e:
            return JSON({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        except ValueError as e:
            return JSON({"error": str(e)}, status_code=400)

    return run


class Api:
    """The routes' handlers over one source of sessions."""

    def __init__(self, source: Source, extensions: Extensions) -> None:
        self.source = source
        self.marks = source.marks
        if extensions.usage is None:  # (the session's own usage_reported records: the usage ledger)
            extensions = Extensions(search=extensions.search, usage=LogUsage(source, self.marks))
        self.extensions = extensions

    async def info(self, request: Request) -> Response:
        return JSON({"program": "context-persistent", "version": __version__, "source": self.source.describe(),
                     "backend": "postgres" if self.source.is_postgres else "file", "read_only": True,
                     "features": self.extensions.features()})

    async def sessions(self, request: Request) -> Response:
        return JSON({"source": self.source.describe(), "sessions": await self.source.listing()})

    async def session(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        async with self.source.store(sid) as store:
            state = store._state
            summary = {"session_id": sid, "head_seq": store.head_seq, "messages": len(state.messages),
                       "pinned": len(state.pinned), "events": dict(state.counts), "tokenizer": store.tokenizer,
                       "path": str(store.path), "bytes": _bytes(store._log),
                       "parent": state.session.get("parent"), "imported": state.session.get("imported"),
                       "budget": store.resolve_budget()[0]}
        summary["forks"] = [{"session_id": r["session_id"], "seq": (r.get("parent") or {}).get("seq")}
                            for r in await self.source.listing()
                            if (r.get("parent") or {}).get("session_id") == sid]
        return JSON(summary)

    async def timeline(self, request: Request) -> Response:
        page = await timeline_page(self.source, self.marks, request.path_params["sid"],
                                   after=_int(request, "after"), limit=_int(request, "limit", 200) or 200,
                                   until=_int(request, "at"))
        return JSON(page)

    async def messages(self, request: Request) -> Response:
        view = request.query_params.get("view", "full")
        async with self.source.store_at(request.path_params["sid"], _int(request, "at")) as store:
            return JSON(messages_page(store, view, _int(request, "start"), _int(request, "limit", 200) or 200))

    async def request_view(self, request: Request) -> Response:
        async with self.source.store_at(request.path_params["sid"], _int(request, "at"), "request") as store:
            return JSON(await request_compare(store, _int(request, "budget")))

    async def tokens(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        async with self.source.store(sid) as head:
            counts = head._state.counts
        # The index of notable events reads the whole log the first time: only when it has something to show.
        noted = bool(counts.get(ev.COMPACTED) or counts.get(ev.USAGE_REPORTED))
        events = [dict(m) for m in (await self.marks.of(self.source, sid)).events] if noted else []
        at = _int(request, "at")
        provider = self.extensions.usage
        usage = None
        if isinstance(provider, LogUsage) and not counts.get(ev.USAGE_REPORTED):
            usage = []
        elif provider is not None:
            usage = thin(await provider.usage(sid, at_seq=at, limit=USAGE_POINTS), USAGE_POINTS)
        async with self.source.store_at(sid, at) as store:
            out = await token_series(store, budget=_int(request, "budget"),
                                     count_missing=request.query_params.get("count") == "1", marks=events,
                                     usage=usage)
        return JSON(out)

    async def marks_of(self, request: Request) -> Response:
        marks = await self.marks.of(self.source, request.path_params["sid"])
        return JSON({"last_seq": marks.last_seq, "omitted": marks.omitted, "events": list(marks.events)})

    async def record(self, request: Request) -> Response:
        sid, seq = request.path_params["sid"], request.path_params["seq"]
        async with self.source.store(sid) as store:
            redactions = bool(store._state.counts.get("redacted"))
        marks = await self.marks.of(self.source, sid) if redactions else None
        async with self.source.log(sid) as log:
            found = [r for r in await read_records(log, after=max(0, seq - 1), limit=1) if r["seq"] == seq]
        if not found:
            return JSON({"error": f"session {sid!r} has no event with seq {seq}"}, status_code=404)
        limit = 8 << 20  # (a whole record, up to 8 MiB per string: the export has everything)
        return JSON(shape_record(found[0], marks.hidden if marks is not None else None, limit=limit))

    async def follow(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        after = _int(request, "after")
        async with self.source.store(sid) as store:
            start = store.head_seq if after is None else after
        return StreamingResponse(self._events(sid, start), media_type="text/event-stream",
                                 headers={"x-accel-buffering": "no"})

    async def _events(self, sid: str, after: int) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue(maxsize=1000)

        async def pump() -> None:
            try:
                async for rec in follow_records(self.source, self.marks, sid, after):
                    await queue.put(rec)
            except Exception as e:  # (told to the page, which shows it and stops following)
                await queue.put(e)

        task = asyncio.create_task(pump())
        try:
            yield b": following\n\n"
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), HEARTBEAT)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                if isinstance(item, BaseException):
                    yield b"event: failed\ndata: " + orjson.dumps({"error": f"{type(item).__name__}: {item}"}) + b"\n\n"
                    return
                yield b"id: %d\ndata: " % item["seq"] + orjson.dumps(item) + b"\n\n"
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def export(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        fmt = request.query_params.get("format", "jsonl")
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
        view = request.query_params.get("view", "full")
        at, budget = _int(request, "at"), _int(request, "budget")
        folder = tempfile.mkdtemp(prefix="context-persistent-viewer-")  # (0700, outside the storage)
        name = f"{sid}{f'-at-{at}' if at else ''}-{view}.{_EXT[fmt]}"
        path = Path(folder) / "export"
        try:
            async with self.source.store(sid) as store:
                await store.export(path, format=fmt, view=view, at_seq=at,
                                   token_budget=budget if view == "request" else None)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return FileResponse(path, media_type=EXPORT_FORMATS[fmt], filename=name,
                            background=BackgroundTask(shutil.rmtree, folder, True))

    async def search(self, request: Request) -> Response:
        provider = self.extensions.search
        if provider is None:
            return JSON({"error": "search is not available in this viewer (it needs the search projection)"},
                        status_code=404)
        query = request.query_params.get("q", "")
        hits = await provider.search(query, limit=min(_int(request, "limit", 50) or 50, 500))
        return JSON({"query": query, "hits": [clip(h, 500) for h in hits]})

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")


def _bytes(log: Any) -> int | None:
    size = getattr(log, "size", None)
    return None if size is None else int(size) + int(getattr(log, "base", 0))


def create_app(source: Source, token: str, *, port: int, extensions: Extensions | None = None) -> Any:
    """The viewer as an ASGI app, behind its token gate (gate.py). ``port`` names the token's cookie."""
    api = Api(source, extensions or Extensions())
    s = "/api/sessions/{sid}"
    routes = [
        Route("/", _answers(api.page)),
        Route("/api/info", _answers(api.info)),
        Route("/api/sessions", _answers(api.sessions)),
        Route("/api/search", _answers(api.search)),
        Route(s, _answers(api.session)),
        Route(s + "/timeline", _answers(api.timeline)),
        Route(s + "/messages", _answers(api.messages)),
        Route(s + "/request", _answers(api.request_view)),
        Route(s + "/tokens", _answers(api.tokens)),
        Route(s + "/marks", _answers(api.marks_of)),
        Route(s + "/record/{seq:int}", _answers(api.record)),
        Route(s + "/follow", _answers(api.follow)),
        Route(s + "/export", _answers(api.export)),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        await source.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return TokenGate(app, token, cookie_name(port))


__all__ = ["create_app"]
