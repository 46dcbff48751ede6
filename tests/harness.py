"""Real ranks for tests: ``collgrad.launch.run_local`` with test defaults (Gloo, a timeout that turns
a hang into a failure, one thread per rank)."""

from __future__ import annotations

from typing import Any, Callable

from collgrad.launch import RankError, run_local

__all__ = ["run_ranks", "RankError"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    return run_local(fn, world_size, *args, timeout=timeout, **kwargs)
