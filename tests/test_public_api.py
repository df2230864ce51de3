"""The public surface: everything in __all__ imports; __all__ is sorted; protocol methods are async."""

from __future__ import annotations

import inspect

import context_persistent


def test_all_names_import_and_are_sorted() -> None:
    """Each name in __all__ exists, and the list is sorted."""
    for name in context_persistent.__all__:
        assert getattr(context_persistent, name) is not None, name
    assert list(context_persistent.__all__) == sorted(context_persistent.__all__)


def test_protocol_methods_are_async() -> None:
    """The Amplifier ContextManager protocol methods and the extras are coroutine functions."""
    cls = context_persistent.PersistentContextManager
    for name in ("add_message", "get_messages_for_request", "get_messages", "set_messages", "clear",
                 "get_token_count", "compact", "get_conversation_view", "get_reasoning_view", "close"):
        assert inspect.iscoroutinefunction(getattr(cls, name)), name
    assert isinstance(cls.__dict__["loaded_from_file"], property)
    assert inspect.signature(cls.get_messages_for_request).parameters.keys() >= {"token_budget", "provider"}


def test_entry_point_is_registered() -> None:
    """The amplifier.modules entry point context-persistent resolves to mount()."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="amplifier.modules")}
    assert eps["context-persistent"].load() is context_persistent.mount
