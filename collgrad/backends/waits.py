"""Bounded waits: no collective collgrad issues waits longer than a set time.

A rank that never joins a collective (it raised, took another code path, or died) would otherwise
keep the others waiting for the process group's own timeout (30 minutes for Gloo, 10 for DeepSpeed's
default). collgrad waits at most ``COLLGRAD_TIMEOUT`` seconds (default 120, or ``timeout=`` on the
Dispatcher/Registry), then raises CollgradTimeoutError naming the operation, the bucket and the group.

After a timeout the process group still holds the unfinished collective: the group cannot be used
for further collectives, and the job should stop (as after any NCCL/Gloo timeout).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import TYPE_CHECKING, Callable, Mapping

from collgrad import _compat
from collgrad.errors import CollgradTimeoutError, InvalidArgumentError

if TYPE_CHECKING:
    from torch.distributed import Work

__all__ = ["ENV_TIMEOUT", "DEFAULT_TIMEOUT_S", "timeout_from_env", "wait_work", "poll_until"]

ENV_TIMEOUT = "COLLGRAD_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0


def timeout_from_env(value: float | None = None, environ: Mapping[str, str] | None = None) -> float:
    """Seconds a collective may wait: ``value``, else ``COLLGRAD_TIMEOUT``, else the default (120).
    InvalidArgumentError (also a ValueError) for anything but a positive number."""
    where = "timeout=" if value is not None else ENV_TIMEOUT
    raw = value if value is not None else (os.environ if environ is None else environ).get(ENV_TIMEOUT)
    try:
        seconds = float(raw) if raw not in (None, "") else DEFAULT_TIMEOUT_S
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(raw, bool) or not seconds > 0:
        raise InvalidArgumentError(f"rank {_compat.rank()}: {where} must be a positive number of seconds, got {raw!r}")
    return seconds


#: With a ``watch``, waits go in slices of this many seconds and ``watch()`` runs between slices.
SLICE_S = 0.05


def wait_work(work: Work, timeout_s: float, what: str, watch: Callable[[], None] | None = None) -> None:
    """``work.wait`` bounded by ``timeout_s``; a timeout becomes CollgradTimeoutError naming ``what``.

    With ``watch`` (Gloo only: a Gloo Work can be waited on again after a timed-out wait, while NCCL
    may abort its communicator on a wait timeout), the wait goes in slices and ``watch()`` runs
    between them; it raises to end the wait early (another rank reported it cannot join).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        step = min(left, SLICE_S) if watch is not None else left
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(step, 1e-3)))
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            if watch is None or time.monotonic() >= deadline:
                raise CollgradTimeoutError(_message(what, timeout_s)) from exc
            watch()


def poll_until(done: Callable[[], bool], timeout_s: float, what: str, watch: Callable[[], None] | None = None) -> None:
    """Poll ``done()`` (an MPI request's Test) with a short back-off until true or ``timeout_s``;
    ``watch()`` runs every ``SLICE_S`` seconds (see ``wait_work``)."""
    start = time.monotonic()
    deadline, next_watch = start + timeout_s, start + SLICE_S
    pause = 1e-5
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise CollgradTimeoutError(_message(what, timeout_s))
        if watch is not None and now > next_watch:
            watch()
            next_watch = now + SLICE_S
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _message(what: str, timeout_s: float) -> str:
    return (
        f"rank {_compat.rank()}: {what} did not complete within {timeout_s:g} s: another rank of the group did not "
        "join it (it raised, returned early, called with other arguments, or stopped). The process group "
        f"is no longer usable; stop the job and look at the other ranks' errors. Raise {ENV_TIMEOUT} if the "
        "collective is legitimately slower."
    )
