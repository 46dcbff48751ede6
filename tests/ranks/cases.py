"""Inputs for the collective tests, built from (case, rank) so every rank can work out the others'.

Values are small integers stored in floating point: sums of them are exact in every dtype and in any
order, so results can be compared bitwise with the per-tensor reference whatever reduction order a
backend uses. ``random_fp32`` has arbitrary values and is compared with a tolerance.
"""

from __future__ import annotations

import zlib

import torch

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(7,), (3, 5), (1,), (16, 4), (2, 3, 4)]


def _ints(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def make(case: str, rank: int) -> list[torch.Tensor]:
    """Fresh input tensors of ``case`` on ``rank``."""
    seed = 1000 * (zlib.crc32(case.encode()) % 997) + rank
    if case in DTYPES:
        return [_ints(s, DTYPES[case], seed + 10 * i) for i, s in enumerate(SHAPES)]
    if case == "mixed":
        dts = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.float32, torch.bfloat16]
        return [_ints(SHAPES[i % len(SHAPES)], dt, seed + 10 * i) for i, dt in enumerate(dts)]
    if case == "noncontiguous":
        base = _ints((6, 8), torch.float32, seed)
        return [
            base[:, ::2],  # gaps between elements: must never reach a backend as is
            _ints((5, 4), torch.float32, seed + 1).t(),  # transposed
            _ints((4, 6), torch.bfloat16, seed + 2)[1:3, 2:5],
            _ints((9,), torch.float32, seed + 3),
        ]
    if case == "empty":
        return [
            torch.zeros(0),
            _ints((4,), torch.float32, seed),
            torch.zeros(3, 0),
            torch.zeros(0, dtype=torch.bfloat16),
        ]
    if case == "only_empty":
        return [torch.zeros(0), torch.zeros(2, 0)]
    if case == "large":  # larger than the bucket cap used with it (LARGE_BUCKET_BYTES)
        return [
            _ints((5,), torch.float32, seed),
            _ints((100,), torch.float32, seed + 1),
            _ints((30,), torch.float64, seed + 2),
        ]
    if case == "adjacent_views":  # back to back in one buffer: reduced in place, no packing copy
        base = _ints((40,), torch.float32, seed)
        return [base[0:7], base[7:22], base[22:23], base[23:40]]
    if case == "random_fp32":
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g) for s in SHAPES]
    if case == "int64":
        return [_ints(s, torch.int64, seed + i) for i, s in enumerate(SHAPES)]
    raise KeyError(case)


EXACT_CASES = [*DTYPES, "mixed", "noncontiguous", "empty", "only_empty", "large", "int64", "adjacent_views"]
LARGE_BUCKET_BYTES = 64  # 16 fp32 / 8 fp64 elements per bucket


def reduce_reference(tensors, op=None, group=None):
    """The per-tensor reference: one ``dist.all_reduce`` per (contiguous copy of each) tensor."""
    import torch.distributed as dist

    out = []
    for t in tensors:
        c = t.contiguous().clone()
        if c.numel():
            dist.all_reduce(c, op=dist.ReduceOp.SUM if op is None else op, group=group)
        out.append(c)
    return out


def gather_reference(inputs, world, group=None):
    """The per-tensor reference: one list ``dist.all_gather`` per input, concatenated rank-major."""
    import torch.distributed as dist

    out = []
    for t in inputs:
        parts = [torch.empty(t.numel(), dtype=t.dtype, device=t.device) for _ in range(world)]
        if t.numel():
            dist.all_gather(parts, t.contiguous().view(-1), group=group)
        out.append(torch.cat(parts))
    return out
