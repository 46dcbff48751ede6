"""The one small collective every agreement in collgrad goes through: each rank contributes a short
row of int64, every rank receives every row (in group-rank order) and decides from the same data.

Two uses: the registry's capability agreement (once per group and device type), and the check of a
call's arguments (``agree_on_call``), which every public collective call runs before any data moves
so that a rank with invalid or different arguments makes every rank raise at once::

    row of rank r   [ status | field 0 | field 1 | ... ]     status: 0 ok, INVALID, or a caller's code
    every rank      all rows -> the same verdict: ok, or the same error (naming ranks and fields)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends.waits import wait_work
from collgrad.errors import ArgumentMismatchError, CollgradError, NoBackendError, PreStepHookError

__all__ = [
    "exchange",
    "control_device_type",
    "Field",
    "INVALID",
    "HOOK_FAILED",
    "agree_on_call",
    "HookFailures",
    "call_verdict",
    "stable_hash",
    "ranks_by_value",
    "tell_invalid",
]

#: The status of a rank whose own arguments were invalid: it joins the check only to tell the others.
INVALID = -1
#: The status of a rank whose pre-step hook raised (collgrad/state/hook.py): it joins whatever check the
#: others are in (their next collgrad call inside the hook, or the hook's own check) to tell them.
HOOK_FAILED = -2


class HookFailures:
    """How many times calls made through its owner (a dispatcher) saw another rank's HOOK_FAILED: the
    pre-step hook then knows those ranks are done (see collgrad/state/hook.py)."""

    def __init__(self) -> None:
        self.seen = 0


def control_device_type(group: ProcessGroup, preferred: str = "cpu") -> str:
    """A device type the group has a backend for, ``preferred`` first (a ``cpu:gloo,cuda:nccl`` group
    agrees over Gloo; an NCCL-only group over CUDA)."""
    for device_type in (preferred, "cpu", "cuda", "xpu"):
        if _compat.backend_name(group, device_type) is not None:
            return device_type
    raise NoBackendError(f"process group {_compat.group_ranks(group)} has no backend for cpu, cuda or xpu")


def exchange(
    group: ProcessGroup,
    row: Sequence[int],
    device_type: str | None = None,
    *,
    timeout_s: float,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> list[list[int]]:
    """All-gather ``row`` (same length on every rank) over ``group``, waiting at most ``timeout_s``;
    returns every rank's row. ``what`` names the agreement in a timeout error. ``meanwhile``: local
    work run while the exchange is in flight (it must not communicate); the exchange is waited for
    even if it raises, so this rank never leaves a collective of its own behind."""
    device_type = device_type or control_device_type(group)
    device = _compat.agreement_device(device_type)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    work = _compat.all_gather_list(rows, mine, group)
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        wait_work(work, timeout_s, f"{what} (a small all_gather over group {_compat.group_ranks(group)})")
    return [r.tolist() for r in rows]


@dataclass(frozen=True)
class Field:
    """One argument of a call as every rank must pass it. ``shown``: the value means something to a
    reader (a size, a flag) and is printed in a mismatch; otherwise (a hash) only the ranks are.
    ``compare=False``: not an argument but something each rank tells the others (it may differ), carried
    by the same exchange at no extra cost."""

    name: str
    value: int
    shown: bool = True
    compare: bool = True


def stable_hash(value: object) -> int:
    """A hash that is the same in every process (``hash()`` of a str is salted per process), as an int
    that fits in int64. ``value`` must have a deterministic ``repr`` (no addresses)."""
    return zlib.crc32(repr(value).encode())


def ranks_by_value(rows: Sequence[Sequence[int]], column: int, group_ranks: Sequence[int]) -> dict[int, list[int]]:
    """Pure: the ranks grouped by what they put in ``column`` of their row (first seen value first)."""
    by_value: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_value.setdefault(row[column], []).append(group_ranks[i])
    return by_value


def call_verdict(
    rows: Sequence[Sequence[int]], fields: Sequence[Field], group_ranks: Sequence[int], *, call: str, rank: int
) -> ArgumentMismatchError | PreStepHookError | None:
    """Pure: the error every rank raises for these rows, or None when all ranks passed valid, equal
    arguments. ``rows`` are every rank's ``[status, *values]`` in group-rank order."""
    failed = [group_ranks[i] for i, row in enumerate(rows) if row[0] == HOOK_FAILED]
    if failed:
        return PreStepHookError(
            f"the pre-step hook raised on rank(s) {failed} (their own errors say why); {call} and the optimizer "
            f"step are not run [seen by rank {rank}]"
        )
    invalid = [group_ranks[i] for i, row in enumerate(rows) if row[0] == INVALID]
    if invalid:
        return ArgumentMismatchError(
            f"rank(s) {invalid} passed invalid arguments to {call} (their own errors say which) [seen by rank {rank}]"
        )
    differences, differing = [], []
    for k, field in enumerate(fields, start=1):
        if not field.compare:
            continue
        by_value = ranks_by_value(rows, k, group_ranks)
        if len(by_value) > 1:
            differing.append(field.name)
            if field.shown:
                differences.append(
                    f"{field.name}: " + ", ".join(f"rank(s) {r} passed {v}" for v, r in by_value.items())
                )
            else:
                differences.append(
                    f"{field.name} differ, ranks grouped by what they passed: {sorted(by_value.values())}"
                )
    if differences:
        return ArgumentMismatchError(
            f"ranks passed different arguments to {call} ({'; '.join(differences)}) [seen by rank {rank}]: pass the "
            "same arguments on every rank of the group",
            tuple(differing),
        )
    return None


def agree_on_call(
    group: ProcessGroup,
    fields: Sequence[Field],
    *,
    timeout_s: float,
    call: str,
    status: int = 0,
    device_type: str | None = None,
    meanwhile: Callable[[], None] | None = None,
    hook_failures: HookFailures | None = None,
) -> list[list[int]]:
    """Exchange this rank's ``status`` and call ``fields`` with the group and raise, on every rank alike,
    if any rank's arguments were invalid (``status=INVALID``) or differ. Returns every rank's row, so
    a caller can read the other statuses it defined. Collective: every rank of ``group`` calls it with
    the same number of fields. ``meanwhile``: see ``exchange``; ``hook_failures``: counts a pre-step
    hook's failure on another rank, where one is seen."""
    rows = exchange(
        group,
        [status, *(f.value for f in fields)],
        device_type,
        timeout_s=timeout_s,
        what=f"the argument check of {call}",
        meanwhile=meanwhile,
    )
    error = call_verdict(rows, fields, _compat.group_ranks(group), call=call, rank=_compat.rank())
    if error is not None:
        if isinstance(error, PreStepHookError) and hook_failures is not None:
            hook_failures.seen += 1
        raise error
    return rows


def tell_invalid(group: ProcessGroup, fields: int, timeout_s: float, call: str) -> None:
    """Join the argument check with status INVALID, so the ranks whose arguments were fine raise too;
    the caller then raises its own error."""
    try:
        exchange(group, [INVALID] + [0] * fields, timeout_s=timeout_s, what=f"the argument check of {call}")
    except CollgradError:
        pass  # the others are not in this check (a wait bounded by the timeout); this rank's error stands
