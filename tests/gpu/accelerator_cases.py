"""Shared body of the CUDA/NCCL and XPU/XCCL legs: the same checks as the Gloo tests, on device
tensors, on two ranks: one device each in a ``cpu:gloo,<device>:<backend>`` group, or, on a host with
one device, two ranks sharing it over Gloo with device tensors (NCCL refuses two ranks on one device).

A forced primitive that the agreed capabilities say cannot carry a case must raise NoPrimitiveError
(and that is checked); one they say can carry it must run and match. No error is swallowed.
"""

from __future__ import annotations

import torch

from tests.ranks import cases

PRIMITIVES = ["auto", "flat", "coalesced", "per_tensor"]
CASES = ["fp32", "bf16", "fp16", "mixed", "noncontiguous", "large", "empty"]


def layout(device_type: str, backend: str) -> tuple[int, str] | str:
    """(world size, process-group backend) for two ranks on this host, or why there cannot be two."""
    count = getattr(torch, device_type).device_count()
    if count >= 2:
        return 2, f"cpu:gloo,{device_type}:{backend}"
    if count == 1 and device_type == "cuda":
        return 2, "gloo"  # two ranks share the one GPU; Gloo stages CUDA tensors through the host
    return f"{count} {device_type} device(s): two ranks need two devices (or one CUDA device shared over Gloo)"


def worker(rank, world, device_type):
    import collgrad
    from collgrad import Op, Policy

    module = getattr(torch, device_type)
    module.set_device(rank % module.device_count())
    device = torch.device(device_type, rank % module.device_count())
    failures = []
    for case in CASES:

        def make(case=case):
            made = [t.to(device) if i % 3 else t for i, t in enumerate(cases.make(case, rank))]  # some stay on CPU
            if case == "noncontiguous":
                made = [t.t() if t.dim() == 2 else t for t in made]
            return made

        ref = cases.reduce_reference(make())
        for prim in PRIMITIVES:
            tensors = make()
            policy = None if prim == "auto" else Policy(force=prim)
            bucket_bytes = cases.LARGE_BUCKET_BYTES if case == "large" else None
            carried = all(
                collgrad.capabilities(t.device.type, policy=policy).choice(Op.ALL_REDUCE, t.dtype).primitive is not None
                for t in tensors
            )
            try:
                record = collgrad.all_reduce_coalesced(tensors, bucket_bytes=bucket_bytes, policy=policy)
            except collgrad.NoPrimitiveError as exc:
                if carried:
                    failures.append((case, prim, f"NoPrimitiveError although the capabilities allow it: {exc}"))
                continue
            if not carried:
                failures.append((case, prim, "ran although the capabilities say no primitive can carry it"))
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
