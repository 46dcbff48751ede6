"""Gloo: CPU collectives, and CUDA tensors by staging through host memory.

Facts (docs/notes/backend-capabilities.md, measured on torch 2.13 here):
- Element counts are size_t: an int8 all-reduce of 2**31+1024 elements was correct. No limit.
- ``allreduce_coalesced`` flattens, runs one ring all-reduce and copies back, for CPU tensors only;
  CUDA tensors get "unsupported device type" (pytorch issue #25416, still open).
- Plain ``all_reduce`` on a strided view with gaps reduces ``numel`` contiguous elements from
  ``data_ptr`` and overwrites memory outside the view. The dispatcher never hands a backend a
  non-contiguous tensor, whatever the backend; this module is where the reason is recorded.
- fp32, fp64, fp16, bf16 and the integer types reduce correctly on 2.13.
"""

from __future__ import annotations

import torch

from collgrad import _compat
from collgrad.backends.base import LocalFinding, Reason
from collgrad.backends.ops import Op, Primitive

NAME = "gloo"
DEVICES = frozenset({"cpu", "cuda"})


def finding(device_type: str, op: Op, primitive: Primitive, dtype: torch.dtype) -> LocalFinding:
    if device_type not in DEVICES:
        return LocalFinding(Reason.DEVICE_UNSUPPORTED, detail=f"gloo serves {sorted(DEVICES)}")
    if primitive is Primitive.COALESCED:
        if device_type != "cpu":
            return LocalFinding(Reason.BACKEND_LACKS, detail="gloo's coalesced calls reject CUDA tensors")
        if op is Op.ALL_GATHER and not _compat.gloo_has_all_gather_coalesced():
            return LocalFinding(Reason.BACKEND_LACKS, detail="gloo coalesced all-gather needs torch >= 2.3")
    return LocalFinding(Reason.OK)


def copies_gathers_out_strided(device_type: str) -> bool:
    """Whether Gloo's coalesced all-gather may be handed strided outputs. It stages the whole gather in
    one flat buffer (as every Gloo all-gather does, the plain one included) and copies each output out
    of it with ``copy_``, which honours the output's strides (ProcessGroupGloo.cpp,
    ``AsyncAllgatherCoalescedWork``, torch 2.3-2.13): given strided views, it lays a rank-major gather
    out parameter-major in the copy it makes anyway, at about the cost of a raw all-gather of the same
    bytes, where a flat gather needs a separate reorder copy (docs/notes/timings.md). CPU only (its
    coalesced calls reject CUDA tensors); its inputs are flattened first (a copy where there are
    several, or a strided one)."""
    return device_type == "cpu" and _compat.gloo_has_all_gather_coalesced()
