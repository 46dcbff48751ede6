"""oneCCL through torch-ccl (backend ``ccl``, CPU and XPU) and torch's native XCCL (``xccl``, XPU).

Facts (docs/notes/backend-capabilities.md, from intel/torch-ccl and torch-xpu-ops sources; not
run here):
- torch-ccl registers ``ccl`` for ["xpu", "cpu"] when ``oneccl_bindings_for_pytorch`` is imported;
  it is deprecated in favour of XCCL. Its coalesced all-reduce is one ccl op per tensor because
  ``ccl::group_start`` is commented out: still one call for us, so it is offered, after FLAT.
  It rejects CUDA tensors and ReduceOp.AVG (collgrad never sends AVG: see dispatch.py).
- XCCL's ``allreduce_coalesced`` does not check contiguity (ProcessGroupXCCL.cpp
  ``checkTensorOnSameDevice``); the dispatcher always passes contiguous tensors.
- Counts are size_t. torch-ccl has open reports of segfaults for XPU all-gathers above ~11 MiB
  (intel/torch-ccl#56): a user bucket cap (``bucket_bytes``) is the workaround.
- dtypes: uint8, int8/16/32/64, fp16, bf16, fp32, fp64 for both.
"""

from __future__ import annotations

import torch

from collgrad.backends.base import LocalFinding, Reason
from collgrad.backends.ops import Op, Primitive

CCL_DEVICES = frozenset({"cpu", "xpu"})
XCCL_DEVICES = frozenset({"xpu"})


def ccl_finding(device_type: str, op: Op, primitive: Primitive, dtype: torch.dtype) -> LocalFinding:
    if device_type not in CCL_DEVICES:
        return LocalFinding(Reason.DEVICE_UNSUPPORTED, detail="ccl serves cpu and xpu tensors only")
    return LocalFinding(Reason.OK)


def xccl_finding(device_type: str, op: Op, primitive: Primitive, dtype: torch.dtype) -> LocalFinding:
    if device_type not in XCCL_DEVICES:
        return LocalFinding(Reason.DEVICE_UNSUPPORTED, detail="xccl serves xpu tensors only")
    return LocalFinding(Reason.OK)
