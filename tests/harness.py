"""Real ranks for tests: ``collgrad.launch.run_local`` with test defaults (Gloo, a timeout that turns
a hang into a failure, one thread per rank)."""

from __future__ import annotations

import time
from typing import Any, Callable

from collgrad.launch import RankError, run_local

__all__ = ["run_ranks", "RankError", "attempt"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    return run_local(fn, world_size, *args, timeout=timeout, **kwargs)


def attempt(fn: Callable[[], Any], keep: bool = False) -> dict[str, Any]:
    """Run ``fn`` inside a rank and describe what happened, for the parent to assert on: the error's
    type, the types it also is, its message and how long it took; with ``keep``, also the value (for
    the rank itself to look at: tensors cannot travel back to the parent after the rank exits)."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return {
            "error": type(exc).__name__,
            "is_a": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    out = {"error": None, "seconds": time.monotonic() - start}
    if keep:
        out["value"] = value
    return out
