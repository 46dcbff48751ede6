"""Shared body of the CUDA/NCCL and XPU/XCCL legs: the same checks as the Gloo tests, on device
tensors, in a group that also serves CPU tensors (``cpu:gloo,<device>:<backend>``)."""

from __future__ import annotations

import torch

from tests.ranks import cases

PRIMITIVES = ["auto", "flat", "coalesced", "per_tensor"]


def worker(rank, world, device_type):

    import collgrad
    from collgrad import Policy

    getattr(torch, device_type).set_device(rank)
    device = torch.device(device_type, rank)
    failures = []
    for case in ["fp32", "bf16", "fp16", "mixed", "noncontiguous", "large", "empty"]:
        def make():
            made = [t.to(device) if i % 3 else t for i, t in enumerate(cases.make(case, rank))]  # some stay on CPU
            if case == "noncontiguous":
                made = [t.t() if t.dim() == 2 else t for t in made]
            return made

        ref = cases.reduce_reference(make())
        for prim in PRIMITIVES:
            tensors = make()
            policy = None if prim == "auto" else Policy(force=prim)
            bucket_bytes = cases.LARGE_BUCKET_BYTES if case == "large" else None
            try:
                record = collgrad.all_reduce_coalesced(tensors, bucket_bytes=bucket_bytes, policy=policy)
            except collgrad.NoPrimitiveError as exc:  # e.g. gloo has no coalesced call for CUDA: say so
                failures.append((case, prim, f"no primitive: {exc}")) if prim == "auto" else None
                continue
            if not all(torch.equal(a, b) for a, b in zip(tensors, ref)):
                failures.append((case, prim, "values differ"))
            if prim != "per_tensor" and record.collectives != len(record.buckets):
                failures.append((case, prim, "more than one collective per bucket"))
        outs = [torch.empty(world * t.numel(), dtype=t.dtype, device=t.device) for t in make()]
        collgrad.all_gather_coalesced(outs, make())
        for out, ref_out in zip(outs, cases.gather_reference(make(), world)):
            if not torch.equal(out, ref_out):
                failures.append((case, "all_gather", "values differ"))
    return failures
