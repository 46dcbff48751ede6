"""all_gather_coalesced on real Gloo ranks (world sizes 2 and 3) against per-tensor dist.all_gather."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_ranks
from tests.ranks import cases

PRIMITIVES = ["auto", "flat", "coalesced", "per_tensor"]
GATHER_CASES = [c for c in cases.EXACT_CASES if c != "only_empty"] + ["random_fp32"]


def _outputs(inputs, world, strided):
    """Outputs of world * numel elements; with ``strided``, every other one is a view with gaps."""
    outs = []
    for i, t in enumerate(inputs):
        if strided and i % 2 == 0:
            outs.append(torch.full((2 * world * t.numel(),), -99, dtype=t.dtype)[::2])
        else:
            outs.append(torch.full((world * t.numel(),), -99, dtype=t.dtype))
    return outs


def _worker(rank, world):
    import collgrad
    from collgrad import Policy
    from tests.counting import count_collectives

    results = {}
    for case in GATHER_CASES:
        reference = cases.gather_reference(cases.make(case, rank), world)
        for prim in PRIMITIVES:
            for strided in (False, True):
                inputs = cases.make(case, rank)
                outputs = _outputs(inputs, world, strided)
                bucket_bytes = cases.LARGE_BUCKET_BYTES * world if case == "large" else None
                policy = None if prim == "auto" else Policy(force=prim)
                with count_collectives() as seen:
                    record = collgrad.all_gather_coalesced(outputs, inputs, bucket_bytes=bucket_bytes, policy=policy)
                results[(case, prim, strided)] = {
                    "equal": [torch.equal(o.reshape(-1), r) for o, r in zip(outputs, reference)],
                    "buckets": [(b.primitive, b.numel, b.collectives, str(b.dtype)) for b in record.buckets],
                    "collectives": seen.data,  # as torch received them
                    "reported": record.collectives,
                }
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world_results(request):
    return request.param, run_ranks(_worker, request.param)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous_out", "strided_out"])
@pytest.mark.parametrize("prim", PRIMITIVES)
@pytest.mark.parametrize("case", GATHER_CASES)
def test_equal_to_per_tensor_all_gather(world_results, case, prim, strided):
    world, per_rank = world_results
    for rank, results in enumerate(per_rank):
        entry = results[(case, prim, strided)]
        assert all(entry["equal"]), (world, rank, entry)


@pytest.mark.parametrize("prim", ["auto", "flat", "coalesced"])
def test_one_collective_per_bucket(world_results, prim):
    _, per_rank = world_results
    for key, entry in per_rank[0].items():
        if key[1] == prim:
            # observed: the collectives torch received, besides the argument check
            assert entry["collectives"] == len(entry["buckets"]) == entry["reported"], (key, entry)
            assert all(b[2] == 1 for b in entry["buckets"])


def test_bucket_cap_bounds_the_gathered_buffer(world_results):
    world, per_rank = world_results
    entry = per_rank[0][("large", "auto", False)]
    fp32 = [b for b in entry["buckets"] if b[3] == "torch.float32"]
    # bucket_bytes = 64 * world: the gathered fp32 buffer holds 16 * world elements, 16 per rank.
    assert max(b[1] for b in fp32) == 16 and len(fp32) == math.ceil(105 / 16)
