"""Adapters that give other agent frameworks this store behind their own interfaces.

Each lives in its own module and is imported only when used (``context_persistent.integrations.openai_agents``
needs the ``openai-agents`` extra); importing this package imports no framework.
"""
