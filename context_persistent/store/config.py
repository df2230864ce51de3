"""The store's configuration: every key with its default, and the check that fills and validates it."""

from __future__ import annotations

from typing import Any

from ..storage.backends import BACKENDS
from ..storage.log import FSYNC_MODES, SEGMENT_BYTES, check_segment_bytes
from ..storage.pages import CACHE_BYTES
from ..model.tokens import DEFAULT_ENCODING, resolve_tokenizer

#: Every configuration key the store understands, with its default (see docs/configuration.md).
DEFAULTS: dict[str, Any] = {
    "fsync": "always",
    "reserve_tail": False,
    "segment_bytes": SEGMENT_BYTES,
    "compress_sealed": False,
    "roll_on_compaction": False,
    "tokenizer": DEFAULT_ENCODING,
    "max_tokens": 200_000,
    "safety_margin": 1000,
    "checkpoint_every": 10_000,
    "recognise_replay": False,  # the Amplifier mount turns it on (mount.py)
    "resume_rule": "recognise",
    "copy_request_view": False,
    "export_on_compact": False,
    "export_on_compact_every": 100,
    "backend": "file",
    "dsn": None,
    "pg_schema": None,
    "secret_scanner": None,
    "page_cache_bytes": CACHE_BYTES,
    "retention": None,
    "calibrate": True,  # fit the request view to the provider's reported counts (docs/tokens.md)
    "search_index": True,
}

#: What set_messages does once the store loaded its own log (docs/resume.md).
RESUME_RULES = ("recognise", "strict")

#: Keys validated and used by the compaction layer (docs/compaction.md, docs/configuration.md).
COMPACTION_KEYS = ("auto_compact", "compact_threshold", "compaction_threshold", "target_usage", "strategy",
                   "compaction_strategy", "keep_recent", "keep_head", "mask_min_tokens", "custom",
                   "custom_strategy", "summarizer", "export_on_compact", "export_on_compact_every",
                   "copy_request_view")

#: Every key open() accepts (mount() ignores the others with a warning).
KNOWN_KEYS = frozenset(DEFAULTS) | frozenset(COMPACTION_KEYS)


def _positive_int(config: dict[str, Any], key: str, minimum: int = 1) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def check_config(config: dict[str, Any]) -> dict[str, Any]:
    """The complete configuration for ``config``: defaults filled in, the compaction settings parsed, the
    backend resolved (a ``dsn`` alone selects PostgreSQL). ValueError names the key and the rule."""
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown configuration key(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(sorted(KNOWN_KEYS))}")
    cfg = {**DEFAULTS, **config}
    if cfg["fsync"] not in FSYNC_MODES:
        raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}; got {cfg['fsync']!r}")
    resolve_tokenizer(cfg["tokenizer"])  # ValueError naming what is allowed
    _positive_int(cfg, "max_tokens")
    _positive_int(cfg, "safety_margin", 0)
    _positive_int(cfg, "checkpoint_every")
    _positive_int(cfg, "page_cache_bytes", 0)
    cfg["segment_bytes"] = check_segment_bytes(cfg["segment_bytes"])
    for flag in ("recognise_replay", "copy_request_view", "export_on_compact", "reserve_tail", "compress_sealed",
                 "roll_on_compaction", "calibrate", "search_index"):
        if not isinstance(cfg[flag], bool):
            raise ValueError(f"{flag} must be true or false, got {cfg[flag]!r}")
    _positive_int(cfg, "export_on_compact_every")
    if cfg["resume_rule"] not in RESUME_RULES:
        raise ValueError(f"resume_rule must be one of {', '.join(RESUME_RULES)}; got {cfg['resume_rule']!r}")
    if cfg["retention"] is not None:
        from ..model.retention import RetentionPolicy

        cfg["retention"] = RetentionPolicy.from_config(cfg["retention"])
    if cfg["secret_scanner"] is not None:
        from ..model.secret_scan import make_scanner

        cfg["secret_scanner"] = make_scanner(cfg["secret_scanner"])
    from ..model.compaction import CompactionConfig

    cfg["compaction"] = CompactionConfig.from_config(config)
    if cfg["dsn"] is not None and "backend" not in config:
        cfg["backend"] = "postgres"  # a dsn alone selects the postgres backend
    if cfg["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {cfg['backend']!r}")
    if cfg["reserve_tail"] and (cfg["fsync"] != "always" or cfg["backend"] != "file"):
        raise ValueError(f"reserve_tail applies to the file backend with fsync='always' only; got "
                         f"backend={cfg['backend']!r}, fsync={cfg['fsync']!r} (docs/format.md, "
                         "'The reserved tail')")
    if cfg["backend"] != "file" and (cfg["compress_sealed"] or cfg["roll_on_compaction"]):
        raise ValueError(f"compress_sealed and roll_on_compaction apply to the file backend only (its log segments; "
                         f"docs/operations.md, 'Segments'); got backend={cfg['backend']!r}")
    if cfg["backend"] != "file" and cfg["retention"] is not None and cfg["retention"].follow_host:
        raise ValueError(f"retention.follow_host applies to the file backend only (it follows the Amplifier CLI's "
                         f"session folders; docs/amplifier.md); got backend={cfg['backend']!r}")
    if cfg["backend"] == "file" and (cfg["dsn"] is not None or cfg["pg_schema"] is not None):
        raise ValueError("dsn/pg_schema are set but backend is 'file': set backend='postgres' to use them")
    if cfg["backend"] == "postgres":
        from ..storage.pg import resolve_dsn, resolve_schema

        cfg["dsn"] = resolve_dsn(cfg["dsn"])
        cfg["pg_schema"] = resolve_schema(cfg["pg_schema"])
    return cfg
