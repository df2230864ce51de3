"""The Amplifier entry point: ``mount(coordinator, config)``."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..store.config import KNOWN_KEYS
from ..errors import SessionLockedError
from ..store.manager import PersistentContextManager
from .amplifier_host import HostContext, SessionInUseError, cli_session_folder

if TYPE_CHECKING:
    from ..store.manager import PersistentContextManager

logger = logging.getLogger("context_persistent")

ENV_STORAGE = "CONTEXT_PERSISTENT_DIR"
#: The storage folder when neither the config nor the environment names one: one place per user, whatever the
#: working directory (docs/configuration.md, "Where sessions are stored").
DEFAULT_STORAGE = Path("~") / ".amplifier" / "context"
#: Events this module emits, registered with ``observability.events``.
OBSERVABLE_EVENTS = [
    "context:pre_compact",
    "context:post_compact",
    "context:compaction",
    "context:recovered",
    "context:transcript_ignored",
]


def is_validator(coordinator: Any) -> bool:
    """Whether ``coordinator`` is Amplifier's test coordinator (``amplifier_core.testing.MockCoordinator``).

    The kernel's module validator and its pytest plugin mount a module with one (session id
    ``test-session``, empty config); a real session never does. Recognised by class, not by session id, so a
    real session that happens to be called ``test-session`` is stored as usual.
    """
    return any(c.__name__ == "MockCoordinator" and c.__module__ == "amplifier_core.testing"
               for c in type(coordinator).__mro__)


def _validating() -> bool:
    """Whether this mount is called by amplifier_core's module validation (``amplifier_core.validation``: the
    kernel's loader validates a context module at load by mounting it with the mount plan's config)."""
    frame = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("amplifier_core.validation"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


#: Where the kernel's load-time validation mount puts its throwaway store when it can: a memory file system, where
#: the new session's synced creation costs nothing (the store is deleted at cleanup; every CLI process makes one).
SCRATCH = Path("/dev/shm")


def _scratch_folder(validating: bool) -> Path:
    """A new private folder (0700) for an ephemeral store: under SCRATCH for the kernel's validation where it is
    a writable folder, else in the system's temporary folder."""
    if validating and SCRATCH.is_dir() and os.access(SCRATCH, os.W_OK | os.X_OK):
        try:
            return Path(tempfile.mkdtemp(prefix="context-persistent-validate-", dir=SCRATCH))
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="context-persistent-validate-"))


def storage_from(config: dict[str, Any]) -> Path:
    """``config["storage_path"]`` > ``$CONTEXT_PERSISTENT_DIR`` > ``~/.amplifier/context``."""
    return storage_source(config)[0]


def storage_source(config: dict[str, Any]) -> tuple[Path, str]:
    """The storage folder and where it came from: ``"config"`` (``storage_path``), ``"environment"``
    (``$CONTEXT_PERSISTENT_DIR``) or ``"default"`` (``~/.amplifier/context``)."""
    if config.get("storage_path"):
        return Path(config["storage_path"]).expanduser(), "config"
    if os.environ.get(ENV_STORAGE):
        return Path(os.environ[ENV_STORAGE]).expanduser(), "environment"
    return DEFAULT_STORAGE.expanduser(), "default"


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> Any:
    """Open the session's store and mount it at ``"context"`` of ``coordinator``; returns the cleanup
    coroutine function that closes it.

    ``config`` is the mount plan's ``context.config`` (docs/configuration.md): the storage folder is
    ``storage_path``, else ``$CONTEXT_PERSISTENT_DIR``, else ``~/.amplifier/context``; the session id is
    ``session_id``, else ``coordinator.session_id``. Unknown keys are ignored with a warning. Raises
    ValueError without a session id or for a bad value, and whatever ``PersistentContextManager.open``
    raises (SessionLockedError, LogCorruptedError, ...).
    """
    config = dict(config or {})
    session_id = config.pop("session_id", None) or getattr(coordinator, "session_id", None)
    if not session_id:
        raise ValueError("context-persistent needs a session id: config['session_id'] or coordinator.session_id")
    ephemeral: Path | None = None
    validating = _validating()
    # (amplifier_core's validation is recognised by its frames too: a wrapper module between it and this mount,
    # such as a timing wrapper with its own coordinator, hides the test coordinator's class)
    if validating or is_validator(coordinator) and not any(config.get(k) for k in ("storage_path", "backend",
                                                                                   "dsn")):
        # A validator run (amplifier_core's validation, which passes the mount plan's config, or the test
        # coordinator with no storage configured) is not a session: give it a private store that the cleanup
        # deletes, so it leaves nothing in the storage and takes no lock another process could collide with. The
        # test coordinator given a storage by anything else is an app's own test: it persists there.
        ephemeral = _scratch_folder(validating)  # (created 0700)
        for key in ("backend", "dsn", "pg_schema"):
            config.pop(key, None)
        if validating:  # (the kernel's load-time check, in every CLI process: it calls no method; #23)
            config.update(fsync="never", search_index=False)
        logger.info("context-persistent: mounted by amplifier_core's test coordinator; using the ephemeral "
                    "store %s (deleted at cleanup)", ephemeral)
    storage = ephemeral or storage_from(config)
    config.pop("storage_path", None)
    # The host can replay a sub-session's transcript through add_message (docs/resume.md): recognise it here.
    config.setdefault("recognise_replay", True)
    for key in sorted(set(config) - KNOWN_KEYS):
        logger.warning("context-persistent: ignoring unknown config key %r (known: %s)", key,
                       ", ".join(sorted(KNOWN_KEYS)))
        config.pop(key)
    try:
        store = await HostContext.open(
            storage_path=storage, session_id=str(session_id), hooks=getattr(coordinator, "hooks", None), **config
        )
    except SessionLockedError as e:  # (a second amplifier process on the session: say it in the CLI's terms)
        if ephemeral is not None:
            shutil.rmtree(ephemeral, ignore_errors=True)
        raise SessionInUseError(e) from None
    except BaseException:
        if ephemeral is not None:
            shutil.rmtree(ephemeral, ignore_errors=True)
        raise
    unregister = None
    assert isinstance(store, HostContext)
    store.reopen_with = dict(config)
    if ephemeral is None:  # (the CLI's folder of a resumed session exists now; a new one's after its first save)
        store.host_folder = cli_session_folder(str(session_id))
    try:
        await store.try_link_host()
        await coordinator.mount("context", store)
        register = getattr(coordinator, "register_contributor", None)
        if callable(register):
            register("observability.events", "context-persistent", lambda: list(OBSERVABLE_EVENTS))
        unregister = register_usage_hook(coordinator, store)
    except BaseException:
        await store.close()
        if ephemeral is not None:
            shutil.rmtree(ephemeral, ignore_errors=True)
        raise

    async def cleanup() -> None:
        try:
            if callable(unregister):
                unregister()
            if not store.closed:
                await store.try_link_host()
            await store.close()
            # (the orchestrator may still write after this, e.g. its "cancelled" message after Ctrl-C)
            store.closed_by_host = ephemeral is None
        finally:
            if ephemeral is not None:
                shutil.rmtree(ephemeral, ignore_errors=True)

    return cleanup


#: The hook event loop-basic (and every orchestrator that follows it) emits after ``provider.complete()``:
#: ``{"provider": name, "usage": Usage, "tool_calls": bool}`` (amplifier_core.events.PROVIDER_RESPONSE).
PROVIDER_RESPONSE = "provider:response"


def _model_of(coordinator: Any, provider_name: Any) -> tuple[str | None, str | None]:
    """(provider, model) for a report: the mounted provider's own name and model where it says (the names the
    store's request views see), else the name the event gives."""
    from ..store.usage import provider_identity

    providers = None
    get = getattr(coordinator, "get", None)
    if callable(get):
        try:
            providers = get("providers")
        except Exception:  # (a coordinator without providers: the event's name alone)
            providers = None
    provider = providers.get(provider_name) if isinstance(providers, dict) else None
    name, model = provider_identity(provider)
    return name or (provider_name if isinstance(provider_name, str) else None), model


def register_usage_hook(coordinator: Any, store: PersistentContextManager) -> Any:
    """Record each ``provider:response`` of this session in ``store`` (``record_usage``); returns the
    unregister function, or None when the coordinator has no hooks. Events of other sessions (sub-sessions
    sharing the hooks) are left to their own stores. A report that cannot be recorded is one warning line:
    usage never fails a turn."""
    hooks = getattr(coordinator, "hooks", None)
    register = getattr(hooks, "register", None)
    if not callable(register):
        return None
    own = str(getattr(coordinator, "session_id", None) or store.session_id)

    async def on_provider_response(event: str, data: dict[str, Any]) -> Any:
        try:
            sid = data.get("session_id")
            usage = data.get("usage")
            if usage is not None and (sid is None or str(sid) in (own, store.session_id)) and not store.closed:
                provider, model = _model_of(coordinator, data.get("provider"))
                await store.record_usage(usage, provider=provider, model=model, source="amplifier")
        except Exception as e:
            logger.warning("context-persistent: usage of a provider response not recorded: %s", e)
        return _continue()

    try:
        return register(PROVIDER_RESPONSE, on_provider_response, name="context-persistent-usage")
    except TypeError:  # (a registry without names)
        return register(PROVIDER_RESPONSE, on_provider_response)


def _continue() -> Any:
    try:
        from amplifier_core.models import HookResult  # type: ignore[import-untyped]
    except ImportError:  # (a host without amplifier_core: its hooks take None as "continue")
        return None
    return HookResult(action="continue")
