"""Plan types: which elements of which tensors travel in which bucket. Plain, frozen data.

A bucket is a flat run of elements of one (device, dtype). Tensors are laid into it in call order;
a tensor that does not fit in what is left of a bucket continues in the next one::

    tensors     a(5)        b(3)    c(9)
    stream      a a a a a | b b b | c c c c c c c c c
    buckets     [ 0: a0-4  b0-2 ][ 1: c0-7          ][ 2: c8 ]      capacity 8
    segments    (a,0,0,5) (b,0,5,3) (c,0,0,8)          (c,8,0,1)
                (tensor, tensor_offset, bucket_offset, numel)

For an all-gather, the bucket holds this rank's input; the collective fills ``world_size * numel``
elements, rank-major, and rank r's copy of segment s lands at
``r * tensor.numel + s.tensor_offset`` of the tensor's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collgrad.backends.ops import Op, Primitive
from collgrad.errors import CollgradError

__all__ = ["TensorSpec", "Segment", "Bucket", "BucketRule", "Plan"]


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs to know of one input tensor."""

    numel: int
    dtype: torch.dtype
    device: str  # str(tensor.device), e.g. "cpu", "cuda:1"


@dataclass(frozen=True)
class Segment:
    tensor: int
    tensor_offset: int
    bucket_offset: int
    numel: int


@dataclass(frozen=True)
class BucketRule:
    """How buckets of one (device, dtype) are built: the agreed primitive and its capacity."""

    primitive: Primitive
    backend: str
    wire_dtype: torch.dtype
    capacity: int  # elements of this rank's contribution per bucket


@dataclass(frozen=True)
class Bucket:
    index: int
    device: str
    dtype: torch.dtype
    rule: BucketRule
    numel: int
    segments: tuple[Segment, ...]

    @property
    def primitive(self) -> Primitive:
        return self.rule.primitive


@dataclass(frozen=True)
class Plan:
    op: Op
    world_size: int
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    #: buckets hold whole tensors (``split_whole``): one larger than its bucket's capacity goes alone
    whole: bool = False

    def validate(self) -> None:
        """Check the plan's invariants: every element of every tensor lands exactly once, no bucket over
        its capacity, segments tile each bucket without gaps, one (device, dtype) per bucket. A
        violation is a bug in the planner; it raises (not ``assert``: checked under ``python -O`` too)
        before any data moves."""
        covered = [0] * len(self.tensors)
        for bucket in self.buckets:
            alone = self.whole and len(bucket.segments) == 1  # a whole tensor larger than a bucket
            _require(
                0 < bucket.numel and (bucket.numel <= bucket.rule.capacity or alone),
                f"bucket {bucket.index} holds {bucket.numel} elements",
            )
            offset = 0
            for seg in bucket.segments:
                spec = self.tensors[seg.tensor]
                _require(
                    (spec.device, spec.dtype) == (bucket.device, bucket.dtype),
                    f"tensor {seg.tensor} is not of bucket {bucket.index}'s device and dtype",
                )
                _require(seg.bucket_offset == offset and seg.numel > 0, f"a gap in bucket {bucket.index}")
                _require(seg.tensor_offset == covered[seg.tensor], f"segments of tensor {seg.tensor} out of order")
                covered[seg.tensor] += seg.numel
                offset += seg.numel
            _require(offset == bucket.numel, f"bucket {bucket.index}'s segments do not fill it")
        _require(covered == [t.numel for t in self.tensors], "some element is missing or doubled")


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise CollgradError(f"internal error in collgrad's bucket plan: {what}; please report it")
