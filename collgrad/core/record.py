"""What a call did, for the caller to read: buckets, bytes, primitives, backends, fallbacks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collgrad.backends.ops import Op, Primitive

__all__ = ["BucketRecord", "Decision", "CallRecord"]


@dataclass(frozen=True)
class BucketRecord:
    index: int
    device: str
    dtype: torch.dtype
    wire_dtype: torch.dtype
    primitive: Primitive  # PER_TENSOR where the bucket fell back
    backend: str
    numel: int  # elements of this rank's contribution
    bytes: int  # bytes of this rank's contribution, in the wire dtype
    tensors: int  # distinct tensors with elements in this bucket
    collectives: int  # collective calls issued for this bucket
    #: Why the bucket went per tensor (the agreed primitive raised on every rank); empty when it did not.
    fallback_reason: str = ""

    @property
    def fallback(self) -> bool:
        """The bucket fell back to one collective per tensor (as ``Decision.fallback``)."""
        return bool(self.fallback_reason)


@dataclass(frozen=True)
class Decision:
    """The agreed primitive for one (device type, dtype) in this call, and why better ones were not used."""

    device_type: str
    dtype: torch.dtype
    primitive: Primitive
    backend: str
    wire_dtype: torch.dtype
    why: str

    @property
    def fallback(self) -> bool:
        return self.primitive is Primitive.PER_TENSOR


@dataclass(frozen=True)
class CallRecord:
    op: Op
    group_ranks: tuple[int, ...]
    buckets: tuple[BucketRecord, ...]
    decisions: tuple[Decision, ...]

    @property
    def collectives(self) -> int:
        return sum(b.collectives for b in self.buckets)

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.buckets)

    @property
    def fallbacks(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.fallback)

    def summary(self) -> str:
        prims = sorted({f"{b.primitive.value}/{b.backend}" for b in self.buckets})
        return (
            f"{self.op.value} over ranks {list(self.group_ranks)}: {len(self.buckets)} bucket(s), "
            f"{self.collectives} collective(s), {self.bytes} bytes per rank via {', '.join(prims) or 'nothing'}"
        )
