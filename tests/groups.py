"""Gradient groups for tests without ranks: parameters of given sizes laid out as DeepSpeed's ZeRO-3
and FSDP2 lay them (each rank a ``ceil(numel / world)`` slice of every parameter, back to back), or as
ZeRO-1/2 lays them (back to back in one flat buffer cut into equal partitions)."""

from __future__ import annotations

import math

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


def flat_group(shapes: list[tuple[int, ...]] | list[int], world: int, index: int = 0, prefix: str = "") -> LayoutGroup:
    """A ZeRO-1/2 group as DeepSpeed lays it out: fp32 parameters ``<prefix>p0, <prefix>p1, ...`` of
    ``shapes`` (or 1-D of sizes) back to back, padded to 2 * world, cut into world equal partitions."""
    slots, offset = [], 0
    for i, shape in enumerate(shapes):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape)
        slots.append(ParamSlot(f"{prefix}p{i}", shape, n, offset, n))
        offset += n
    total = -(-offset // (2 * world)) * (2 * world)
    kind = Partitioning.PARTITIONED_FLAT
    return LayoutGroup(index, kind, tuple(range(world)), total // world, torch.float32, torch.float32, tuple(slots))
