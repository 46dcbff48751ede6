"""The one small collective every agreement in collgrad goes through: each rank contributes a short
row of int64, every rank receives every row (in group-rank order) and decides from the same data."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.waits import wait_work

__all__ = ["exchange", "control_device_type"]


def control_device_type(group: ProcessGroup, preferred: str = "cpu") -> str:
    """A device type the group has a backend for, ``preferred`` first (a ``cpu:gloo,cuda:nccl`` group
    agrees over Gloo; an NCCL-only group over CUDA)."""
    for device_type in (preferred, "cpu", "cuda", "xpu"):
        if _compat.backend_name(group, device_type) is not None:
            return device_type
    raise RuntimeError(f"process group {_compat.group_ranks(group)} has no backend for cpu, cuda or xpu")


def exchange(
    group: ProcessGroup, row: Sequence[int], device_type: str | None = None, *, timeout_s: float, what: str
) -> list[list[int]]:
    """All-gather ``row`` (same length on every rank) over ``group``, waiting at most ``timeout_s``;
    returns every rank's row. ``what`` names the agreement in a timeout error."""
    device = _compat.agreement_device(device_type or control_device_type(group))
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    wait_work(work, timeout_s, f"{what} (a small all_gather over group {_compat.group_ranks(group)})")
    return [r.tolist() for r in rows]
