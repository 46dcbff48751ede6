"""Gradient groups for tests without ranks: parameters of given sizes laid out as DeepSpeed's ZeRO-3
and FSDP2 lay them (each rank a ``ceil(numel / world)`` slice of every parameter, back to back)."""

from __future__ import annotations

import torch

from collgrad.state.adapters.layout import GradGroup, Kind, ParamSlot


def sliced_group(sizes: list[int], world: int) -> GradGroup:
    """A SLICED group of 1-D fp32 parameters ``p0, p1, ...`` of ``sizes`` elements over ``world`` ranks."""
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        per_rank = -(-n // world)
        slots.append(ParamSlot(f"p{i}", (n,), n, offset, per_rank))
        offset += per_rank
    return GradGroup(0, Kind.SLICED, tuple(range(world)), offset, torch.float32, torch.float32, tuple(slots))
