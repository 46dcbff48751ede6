"""NCCL: CUDA collectives.

Facts (docs/notes/backend-capabilities.md, from ProcessGroupNCCL sources; not run here):
- ``allreduce_coalesced`` (2.1+) is ncclGroupStart, one ncclAllReduce per tensor, ncclGroupEnd: one
  Work, no flatten copy. Tensors must share dtype and device and be non-overlapping and dense.
- Counts are size_t; bf16/fp16/fp64/ints are native NCCL types (torch 2.13 needs NCCL >= 2.23).
- Plain collectives require contiguous tensors (the dispatcher always passes contiguous ones).
"""

from __future__ import annotations

import torch

from collgrad.backends.base import LocalFinding, Reason
from collgrad.backends.ops import Op, Primitive

NAME = "nccl"
DEVICES = frozenset({"cuda"})


def finding(device_type: str, op: Op, primitive: Primitive, dtype: torch.dtype) -> LocalFinding:
    if device_type not in DEVICES:
        return LocalFinding(Reason.DEVICE_UNSUPPORTED, detail="nccl serves cuda tensors only")
    return LocalFinding(Reason.OK)
