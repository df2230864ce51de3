"""Reading and showing a PostgreSQL address: the DSN and schema settings, and masking their passwords (pure).

Used by the log (its messages name where the records live) and by the administration (``db`` commands).
"""

from __future__ import annotations

import contextlib
import os
import re
from urllib.parse import parse_qsl, unquote, urlsplit

DEFAULT_SCHEMA = "context_persistent"
ENV_DSN = "CONTEXT_PERSISTENT_DSN"
ENV_SCHEMA = "CONTEXT_PERSISTENT_PG_SCHEMA"
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def resolve_dsn(dsn: str | None) -> str:
    """``dsn`` if given, else ``$CONTEXT_PERSISTENT_DSN``; ValueError when neither is set."""
    value = dsn or os.environ.get(ENV_DSN)
    if not value:
        raise ValueError(f"the postgres backend needs a dsn (config 'dsn', --dsn, or ${ENV_DSN}), "
                         "e.g. postgresql://user@host:5432/dbname")
    if not isinstance(value, str) or not value.startswith(("postgresql://", "postgres://")):
        shown = redact_dsn(value) if isinstance(value, str) else value
        raise ValueError(f"dsn must be a postgresql:// or postgres:// URL, got {shown!r}")
    return value


def resolve_schema(schema: str | None) -> str:
    """``schema`` if given, else ``$CONTEXT_PERSISTENT_PG_SCHEMA``, else ``context_persistent``; validated."""
    value = schema or os.environ.get(ENV_SCHEMA) or DEFAULT_SCHEMA
    if not isinstance(value, str) or not _SCHEMA_RE.match(value):
        raise ValueError(f"pg_schema must be a lower-case SQL identifier (letters, digits, _; at most 63), "
                         f"got {value!r}")
    return value


#: Query parameters of a DSN that hold secrets (libpq's names): masked wherever a DSN is shown.
_SECRET_PARAMS = frozenset({"password", "sslpassword"})


def redact_dsn(dsn: str) -> str:
    """The DSN without its passwords (the userinfo part and ``?password=``/``?sslpassword=``), for messages."""
    try:
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, host = netloc.rsplit("@", 1)
            netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
        query = parts.query
        if query:
            pairs = [p.split("=", 1) for p in query.split("&")]
            query = "&".join(f"{p[0]}=***" if len(p) == 2 and unquote(p[0]).lower() in _SECRET_PARAMS
                             else "=".join(p) for p in pairs)
        out = f"{parts.scheme}://{netloc}{parts.path}"  # (not urlunsplit: it drops the // of an empty host)
        return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    except ValueError:  # not a URL we can take apart (a bad port, brackets): show no userinfo or query at all
        return re.sub(r"\?.*$", "?***", re.sub(r"//[^/@]*@", "//***@", dsn))


def _secrets(dsn: str) -> list[str]:
    """The password strings in a DSN (as written and decoded), longest first, to scrub from foreign text."""
    found: set[str] = set()
    with contextlib.suppress(ValueError):
        parts = urlsplit(dsn)
        if parts.password:
            found.update((parts.password, unquote(parts.password)))
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k.lower() in _SECRET_PARAMS and v:
                found.add(v)
        for p in parts.query.split("&"):
            k, _, v = p.partition("=")
            if unquote(k).lower() in _SECRET_PARAMS and v:
                found.add(v)
    return sorted(found, key=len, reverse=True)


def scrub(text: str, dsn: str) -> str:
    """``text`` (an error from the driver) with the DSN's passwords masked."""
    for secret in _secrets(dsn):
        text = text.replace(secret, "***")
    return text


def _endpoint(dsn: str) -> str:
    """``host:port`` a DSN points at, for messages (libpq's defaults: a local socket, port 5432)."""
    try:
        parts = urlsplit(dsn)
        query = dict(parse_qsl(parts.query))
        host = parts.hostname or query.get("host") or "localhost"
        port = parts.port or query.get("port") or 5432
    except ValueError:
        return "(unparsable host)"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

