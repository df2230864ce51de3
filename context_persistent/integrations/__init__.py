"""The hosts: the store behind other programs' interfaces.

What it holds: ``amplifier`` (the Amplifier ``context`` module: ``mount(coordinator, config)``, entry point
``context-persistent``) and the adapters for other agent frameworks, each in its own module and imported only
when used (``openai_agents``, ``agent_framework``, ``autogen``, ``langgraph`` and ``pydantic_ai`` need the
extras of the same names; ``_loop`` is the event-loop thread two of them share);
importing this package imports no framework.

May import: ``store`` and everything below it. Never ``cli``. Checked by import-linter (``.importlinter``).
"""
