"""All-gathers into strided outputs through the dispatcher (``prepare(strided=True)``): Gloo lays a
coalesced gather out itself; checked against plain torch.distributed on the same data, with the
dispatcher's fault hook (one collective per tensor into scratch, then copied out) and the agreement
(a policy forbidding the coalesced primitive makes every rank raise before any data moves)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.guarantees

#: (equal slices per run, slice size) of each run, and the distance between a run's slices
RUNS = ((3, 5), (1, 5), (5, 1))  # 15, 5 and 5 elements
STRIDE_PAD = 2


def _views(local: torch.Tensor, result: torch.Tensor, world: int):
    """Per run, this rank's slices (1, count, numel), ``STRIDE_PAD`` apart, and where rank r's i-th
    slice lands in ``result``: parameter-major, each parameter's ``world`` slices end to end."""
    inputs, outputs, at, out_at = [], [], 0, 0
    for count, numel in RUNS:
        stride = numel + STRIDE_PAD
        inputs.append(local.as_strided((1, count, numel), (count * stride, stride, 1), at))
        outputs.append(result.as_strided((world, count, numel), (numel, world * numel, 1), out_at))
        at += count * stride
        out_at += world * count * numel
    return inputs, outputs


def _expected(world: int) -> torch.Tensor:
    """Parameter-major: for each run and slice, every rank's slice in rank order."""
    parts = []
    for r in range(world):
        parts.append(_local(r))
    out = []
    at = 0
    for count, numel in RUNS:
        stride = numel + STRIDE_PAD
        for i in range(count):
            for r in range(world):
                out.append(parts[r][at + i * stride : at + i * stride + numel])
        at += count * stride
    return torch.cat(out)


def _local(rank: int) -> torch.Tensor:
    total = sum(count * (numel + STRIDE_PAD) for count, numel in RUNS)
    return torch.arange(total, dtype=torch.float32) + 1000 * rank


def _worker(rank, world):
    import torch.distributed as dist

    import collgrad
    from collgrad import Op, Policy

    group = dist.group.WORLD
    out = {"rank": rank}
    total = sum(count * numel for count, numel in RUNS)
    caps = {"small buckets": 8, "pairs": 10}  # elements of this rank's part per bucket
    for case in ("strided", "fallback", "small buckets", "pairs"):
        dispatcher = collgrad.Dispatcher(timeout=30)
        if case == "fallback":

            def hook(point):
                raise RuntimeError("injected")

            dispatcher.fault_hook = hook
        result = torch.full((world * total,), -1.0)
        inputs, outputs = _views(_local(rank), result, world)
        cap = caps[case] * 4 * world if case in caps else None  # gathered bytes
        prepared = dispatcher.prepare(Op.ALL_GATHER, inputs, group, bucket_bytes=cap, strided=True)
        record = dispatcher.run(prepared, inputs, outputs, group, atomic=False)
        out[case] = {
            "equal": torch.equal(result, _expected(world)),
            "buckets": [(b.primitive.value, b.tensors, b.collectives, bool(b.fallback)) for b in record.buckets],
        }
    try:
        local = _local(rank)
        inputs, outputs = _views(local, torch.empty(world * total), world)
        collgrad.Dispatcher(timeout=30).prepare(
            Op.ALL_GATHER, inputs, group, strided=True, policy=Policy(forbid="coalesced")
        )
        out["forbidden"] = None
    except collgrad.NoPrimitiveError as exc:
        out["forbidden"] = str(exc)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_strided_outputs_laid_out_by_gloo_through_the_dispatcher(world):
    for res in run_ranks(_worker, world, timeout=120):
        assert res["strided"] == {"equal": True, "buckets": [("coalesced", 3, 1, False)]}, res
        # the injected failure on every rank: one gather per tensor into scratch, copied into place
        assert res["fallback"]["equal"] and res["fallback"]["buckets"] == [("per_tensor", 3, 3, True)], res
        # 8 elements a bucket: 15 never cut (alone, over the cap), then 5 and 5 apart (10 > 8)
        small = res["small buckets"]
        assert small["equal"] and [b[:3] for b in small["buckets"]] == [("coalesced", 1, 1)] * 3, res
        # 10 elements a bucket: 15 alone, 5 and 5 together
        pairs = res["pairs"]
        assert pairs["equal"] and [b[:3] for b in pairs["buckets"]] == [("coalesced", 1, 1), ("coalesced", 2, 1)], res
        assert res["forbidden"].startswith(f"rank {res['rank']}: ") and "strided outputs" in res["forbidden"], res
