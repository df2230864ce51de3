"""Adapters that put the store behind other agent frameworks' own interfaces (each imported only when used)."""
