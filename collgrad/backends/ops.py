"""The vocabulary of collective communication: which operation a bucket takes part in, and how it travels.

Plain enums: the registry decides in them, the planner and the dispatcher (collgrad.core) plan with them.
"""

from __future__ import annotations

import enum

__all__ = ["ValueEnum", "Op", "Primitive"]


class ValueEnum(str, enum.Enum):
    """A str enum that prints as its value (``f"{Primitive.FLAT}"`` is ``flat``), as ``enum.StrEnum``
    does from Python 3.11 on, and compares equal to it."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Op(ValueEnum):
    """The collective operation a bucket takes part in."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"


class Primitive(ValueEnum):
    """How a bucket travels. Each one exists for both ``Op`` values.

    ``FLAT``        the bucket is packed into one flat buffer and sent with one torch.distributed call
                    (``all_reduce`` / ``all_gather_single``) of the group's backend for that device.
    ``COALESCED``   the bucket's tensors go, unpacked, into the backend's coalesced call
                    (``ProcessGroup.allreduce_coalesced`` / ``all_gather_single_coalesced``): one call,
                    which NCCL and XCCL run as one group of per-tensor ops and Gloo flattens itself.
    ``MPI4PY``      the bucket is packed into one flat buffer and sent with one mpi4py ``Allreduce`` /
                    ``Allgather`` on a communicator that mirrors the group.
    ``PER_TENSOR``  the reference and last resort: one torch.distributed call per tensor.
    """

    FLAT = "flat"
    COALESCED = "coalesced"
    MPI4PY = "mpi4py"
    PER_TENSOR = "per_tensor"

    @property
    def packs(self) -> bool:
        """Whether the primitive moves a packed flat buffer (one collective per bucket)."""
        return self in (Primitive.FLAT, Primitive.MPI4PY)
