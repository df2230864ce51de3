"""Adapters that give other agent frameworks this store behind their own interfaces.

Each lives in its own module and is imported only when used (``openai_agents``, ``agent_framework`` and
``autogen`` need the extras of the same names); importing this package imports no framework.
"""
