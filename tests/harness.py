"""Real ranks for tests: ``collgrad.launch.run_local`` with test defaults (Gloo, a timeout that turns
a hang into a failure, one thread per rank)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import time
from typing import Any, Callable

from collgrad.launch import RankError, run_local

__all__ = ["run_ranks", "RankError", "attempt", "run_example", "run_cli"]


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


def run_example(name: str, *args: str) -> str:
    """``examples/<name>.py`` run as ``python examples/<name>.py *args`` runs it, but in this process: its
    ``main`` with these arguments, its ranks forked from this process's server (the one the tests' own
    ranks come from: no interpreter, imports or server of its own); its standard output."""
    module = importlib.import_module(name)  # tests/conftest.py put examples/ on the path
    return _in_process(module.main, list(args))


def run_cli(*args: str) -> str:
    """``python -m collgrad *args`` in this process (as ``run_example``); its standard output. The
    exit status must be 0."""
    from collgrad.cli import main

    return _in_process(lambda argv: _succeeded(main(argv)), list(args))


def _succeeded(status: int) -> None:
    assert status == 0, f"exit status {status}"


def _in_process(main: Callable[[list[str]], object], argv: list[str]) -> str:
    """``main(argv)``'s standard output; the environment it sets (its defaults) put back after."""
    saved = dict(os.environ)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return out.getvalue()
