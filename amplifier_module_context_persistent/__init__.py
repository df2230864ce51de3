"""The Amplifier module-source layout for ``context-persistent``.

Amplifier's loader looks for a package named ``amplifier_module_<id>`` inside a module's source folder
(a local path or a git checkout named by ``source:`` in a mount plan), and its activator installs the
folder's ``pyproject.toml``, with its dependencies, into the host's environment. This package lets
``source:`` name the repository root; it re-exports the real module, ``context_persistent``.
"""

from context_persistent.integrations.amplifier import mount

__amplifier_module_type__ = "context"

__all__ = ["mount"]
