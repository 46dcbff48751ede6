"""Vocabulary shared by the backend registry, the planner and the dispatcher.

Everything here is plain data: enums and frozen dataclasses that can be built, compared and
printed without a process group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "Reason",
    "DTYPES",
    "UNLIMITED",
    "INT32_MAX",
    "LocalFinding",
]


class Reason(enum.IntEnum):
    """Why a primitive cannot be used on one rank. Codes travel between ranks, so never renumber."""

    OK = 0
    FORBIDDEN = 1
    NOT_FORCED = 2
    NOT_INSTALLED = 3
    NOT_LAUNCHED = 4
    BACKEND_LACKS = 5
    DEVICE_UNSUPPORTED = 6
    DTYPE_UNSUPPORTED = 7
    RANK_MAPPING = 8
    POLICY_INVALID = 9
    NO_BACKEND_FOR_DEVICE = 10

    def describe(self) -> str:
        return _REASON_TEXT[self]


_REASON_TEXT = {
    Reason.OK: "available",
    Reason.FORBIDDEN: "forbidden by the override (COLLGRAD_FORBID or policy=)",
    Reason.NOT_FORCED: "another backend/primitive is forced (COLLGRAD_FORCE or policy=)",
    Reason.NOT_INSTALLED: "the package or build that provides it is not installed",
    Reason.NOT_LAUNCHED: "the process was not started by an MPI launcher (mpiexec/mpirun/srun)",
    Reason.BACKEND_LACKS: "the group's backend for this device does not implement it",
    Reason.DEVICE_UNSUPPORTED: "it cannot use tensors of this device type",
    Reason.DTYPE_UNSUPPORTED: "it cannot reduce/gather this dtype",
    Reason.RANK_MAPPING: "torch ranks of the group do not map onto ranks of one MPI job",
    Reason.POLICY_INVALID: "the override on this rank is invalid",
    Reason.NO_BACKEND_FOR_DEVICE: "the process group has no backend for this device type",
}

#: The dtypes the registry decides for, in the fixed order used in the agreement collective.
#: Any other dtype is carried per tensor by the group's backend.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)

#: Message-size limits are element counts. "No limit" is the largest int64 so that MIN works.
UNLIMITED = 2**63 - 1
#: C ``int`` counts: torch's MPI backend narrows numel() to int without a check (see backends/mpi.py).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class LocalFinding:
    """What one rank found out, alone, about one primitive for one (device type, op, dtype)."""

    reason: Reason
    max_elements: int = UNLIMITED
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is Reason.OK
