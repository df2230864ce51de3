"""Times another context module inside the real CLI, for the host benchmark.

``config``: ``inner`` (the module id, resolved through the ``amplifier.modules`` entry points, else as
``amplifier_module_<id>`` on the path),
``inner_config`` (its config). The inner module is mounted through a coordinator that hands this module
the instance it mounts at ``"context"``; what is mounted instead is a proxy that forwards everything and
adds up the seconds spent in each coroutine method. At cleanup the totals (and the inner mount and
cleanup times) are appended as one JSON line to ``$CP_BENCH_TIMING``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import time
from typing import Any

__amplifier_module_type__ = "context"


class _Coordinator:
    def __init__(self, real: Any) -> None:
        self._real = real
        self.context: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def mount(self, point: str, instance: Any, *args: Any, **kwargs: Any) -> Any:
        if point == "context":
            self.context = instance
            return None
        return await self._real.mount(point, instance, *args, **kwargs)


class Timed:
    def __init__(self, inner: Any, totals: dict[str, list[float]]) -> None:
        self._inner = inner
        self._totals = totals

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(value):
            return value
        totals = self._totals

        @functools.wraps(value)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await value(*args, **kwargs)
            finally:
                entry = totals.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t

        return timed


def _inner_mount(module_id: str) -> Any:
    for ep in importlib.metadata.entry_points(group="amplifier.modules"):
        if ep.name == module_id:
            return ep.load()
    return importlib.import_module("amplifier_module_" + module_id.replace("-", "_")).mount


async def mount(coordinator: Any, config: dict[str, Any] | None = None) -> Any:
    config = config or {}
    totals: dict[str, list[float]] = {}
    proxy_coordinator = _Coordinator(coordinator)
    t = time.perf_counter()
    inner_cleanup = await _inner_mount(config["inner"])(proxy_coordinator, dict(config.get("inner_config") or {}))
    totals["mount"] = [1, time.perf_counter() - t]
    if proxy_coordinator.context is None:
        raise RuntimeError(f"context-timed: {config['inner']} mounted no context")
    await coordinator.mount("context", Timed(proxy_coordinator.context, totals))

    async def cleanup() -> None:
        t = time.perf_counter()
        if inner_cleanup is not None:
            result = inner_cleanup()
            if inspect.isawaitable(result):
                await result
        totals["cleanup"] = [1, time.perf_counter() - t]
        path = os.environ.get("CP_BENCH_TIMING")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"module": config["inner"], "pid": os.getpid(),
                                    "session_id": str(getattr(coordinator, "session_id", "")),
                                    "totals": totals}) + "\n")

    return cleanup
