"""Pure planning: tensor specs + one rule per (device, dtype) -> Plan. No process group, no I/O.

Every rank calls this with the same specs and the same agreed rules and therefore builds the same
plan; nothing here depends on the rank.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from collgrad.backends.ops import Op
from collgrad.core.plan import Bucket, BucketRule, Plan, Segment, TensorSpec

__all__ = ["DEFAULT_BUCKET_BYTES", "bucket_capacity", "plan_buckets", "split_stream", "split_whole"]

#: 25 MiB, DDP's default bucket (torch/nn/parallel/distributed.py ``_DEFAULT_BUCKET_CAP_MB``): big
#: enough that per-collective latency is amortized, small enough that the pack copy is cheap and two
#: buckets in flight cost little memory.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def bucket_capacity(op: Op, bucket_bytes: int, wire_dtype: torch.dtype, world_size: int, limit: int) -> int:
    """Elements of one rank's contribution per bucket.

    The user's ``bucket_bytes`` bounds the largest buffer a bucket allocates: the flat buffer for an
    all-reduce, the gathered output (``world_size`` contributions) for an all-gather. ``limit`` is the
    primitive's largest message in elements (per rank for an all-gather, as MPI counts it). At least
    one element, so every plan makes progress.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    itemsize = torch.empty((), dtype=wire_dtype).element_size()
    per_bucket = bucket_bytes // itemsize
    if op is Op.ALL_GATHER:
        per_bucket //= world_size
    return max(1, min(per_bucket, limit))


def plan_buckets(
    op: Op,
    tensors: Sequence[TensorSpec],
    rules: Mapping[tuple[str, torch.dtype], BucketRule],
    world_size: int,
    *,
    whole: bool = False,
) -> Plan:
    """Group tensors by (device, dtype) in order of first appearance and cut each group's element
    stream into buckets of ``rule.capacity`` elements (``split_stream``), or, ``whole``, into buckets
    of whole tensors (``split_whole``). Empty tensors take no place in any bucket."""
    groups: dict[tuple[str, torch.dtype], list[int]] = {}
    for index, spec in enumerate(tensors):
        if spec.numel:
            groups.setdefault((spec.device, spec.dtype), []).append(index)
    buckets: list[Bucket] = []
    for (device, dtype), members in groups.items():
        rule = rules[(device, dtype)]
        split = split_whole if whole else split_stream
        for numel, segments in split([(i, tensors[i].numel) for i in members], rule.capacity):
            buckets.append(Bucket(len(buckets), device, dtype, rule, numel, segments))
    return Plan(op, world_size, tuple(tensors), tuple(buckets), whole)


def split_stream(sizes: Sequence[tuple[int, int]], capacity: int) -> list[tuple[int, tuple[Segment, ...]]]:
    """Lay ``(tensor index, numel)`` end to end and cut every ``capacity`` elements.

    Why cut inside tensors rather than start a new bucket per tensor: it gives the fewest buckets
    (every bucket but the last is full), and a tensor larger than a bucket needs the same cut
    anyway (torch's MPI backend silently truncates counts above 2**31-1).
    """
    out: list[tuple[int, tuple[Segment, ...]]] = []
    current: list[Segment] = []
    used = 0
    for index, numel in sizes:
        offset = 0
        while offset < numel:
            take = min(numel - offset, capacity - used)
            current.append(Segment(index, offset, used, take))
            used += take
            offset += take
            if used == capacity:
                out.append((used, tuple(current)))
                current, used = [], 0
    if current:
        out.append((used, tuple(current)))
    return out


def split_whole(sizes: Sequence[tuple[int, int]], capacity: int) -> list[tuple[int, tuple[Segment, ...]]]:
    """Lay ``(tensor index, numel)`` end to end in buckets of whole tensors: a bucket closes before the
    tensor that would take it past ``capacity``; a tensor larger than ``capacity`` has a bucket of its
    own. For tensors that cannot be cut (strided views handed to the backend as they are)."""
    out: list[tuple[int, tuple[Segment, ...]]] = []
    current: list[Segment] = []
    used = 0
    for index, numel in sizes:
        if current and used + numel > capacity:
            out.append((used, tuple(current)))
            current, used = [], 0
        current.append(Segment(index, 0, used, numel))
        used += numel
    if current:
        out.append((used, tuple(current)))
    return out
