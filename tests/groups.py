"""Gradient groups for tests without ranks: parameters of given sizes laid out as DeepSpeed's ZeRO-3
and FSDP2 lay them (each rank a ``ceil(numel / world)`` slice of every parameter, back to back)."""

from __future__ import annotations

import torch

from collgrad.state.layout import LayoutGroup, ParamSlot, Partitioning


def sliced_group(sizes: list[int], world: int) -> LayoutGroup:
    """A SLICED group of 1-D fp32 parameters ``p0, p1, ...`` of ``sizes`` elements over ``world`` ranks."""
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        per_rank = -(-n // world)
        slots.append(ParamSlot(f"p{i}", (n,), n, offset, per_rank))
        offset += per_rank
    return LayoutGroup(0, Partitioning.SLICED, tuple(range(world)), offset, torch.float32, torch.float32, tuple(slots))
