"""all_reduce_coalesced on real Gloo ranks (world sizes 2 and 3) against per-tensor dist.all_reduce.

One spawn per world size runs every (case, op, primitive) combination; the tests below read its
results, so each assertion is reported on its own.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_ranks
from tests.ranks import cases

PRIMITIVES = ["auto", "flat", "coalesced", "per_tensor"]
OPS = ["SUM", "AVG", "MAX"]


def _worker(rank, world):
    import torch.distributed as dist

    import collgrad
    from collgrad import Policy
    from tests.counting import count_collectives
    from tests.tolerance import reordered_sum

    results = {}
    for case in [*cases.EXACT_CASES, "random_fp32"]:
        for op_name in OPS:
            if case == "int64" and op_name == "AVG":
                continue
            op = getattr(dist.ReduceOp, op_name)
            reference = cases.reduce_reference(cases.make(case, rank), op)
            for prim in PRIMITIVES:
                policy = None if prim == "auto" else Policy(force=prim)
                tensors = cases.make(case, rank)
                keep = case == "noncontiguous" and tensors[0]._base.clone()
                bucket_bytes = cases.LARGE_BUCKET_BYTES if case == "large" else None
                with count_collectives() as seen:
                    record = collgrad.all_reduce_coalesced(tensors, op=op, bucket_bytes=bucket_bytes, policy=policy)
                # Arbitrary values (random_fp32): the bucket and the reference may sum the `world` terms of
                # each element in different orders, so they differ by at most reordered_sum(world) times
                # the sum of the terms' magnitudes (tests/tolerance.py; a mean divides both by world).
                # MAX is exact in any order: there, and for the exact cases, `close` is equality.
                magnitude = [
                    sum(t[i].double().abs() for t in (cases.make(case, r) for r in range(world)))
                    / (world if op_name == "AVG" else 1)
                    for i in range(len(tensors))
                ]
                slack = 0.0 if op_name == "MAX" else reordered_sum(world, torch.float32)
                entry = {
                    "equal": [torch.equal(a, b) for a, b in zip(tensors, reference)],
                    "close": [
                        bool(((a.double() - b.double()).abs() <= slack * m).all())
                        for a, b, m in zip(tensors, reference, magnitude)
                    ],
                    "buckets": [(b.primitive, b.numel, b.collectives, str(b.dtype)) for b in record.buckets],
                    "collectives": seen.data,  # as torch received them
                    "reported": record.collectives,
                    "decisions": [(str(d.dtype), d.primitive, d.why) for d in record.decisions],
                }
                if keep is not False:
                    # Columns 1, 3, 5, 7 of the base lie outside the strided view and must be untouched.
                    entry["outside_untouched"] = torch.equal(tensors[0]._base[:, 1::2], keep[:, 1::2])
                results[(case, op_name, prim)] = entry
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world_results(request):
    return request.param, run_ranks(_worker, request.param)


@pytest.mark.parametrize("prim", PRIMITIVES)
@pytest.mark.parametrize("case", cases.EXACT_CASES)
def test_bitwise_equal_to_per_tensor_all_reduce(world_results, case, prim):
    world, per_rank = world_results
    for rank, results in enumerate(per_rank):
        for op_name in OPS:
            if (case, op_name, prim) not in results:
                continue
            entry = results[(case, op_name, prim)]
            assert all(entry["equal"]), (world, rank, case, op_name, prim, entry)


@pytest.mark.parametrize("prim", PRIMITIVES)
def test_random_values_close_to_per_tensor(world_results, prim):
    world, per_rank = world_results
    for results in per_rank:
        for op_name in OPS:
            assert all(results[("random_fp32", op_name, prim)]["close"])


def test_strided_view_reduced_without_touching_memory_outside_it(world_results):
    _, per_rank = world_results
    for results in per_rank:
        for prim in PRIMITIVES:
            assert results[("noncontiguous", "SUM", prim)]["outside_untouched"], prim


@pytest.mark.parametrize("prim", ["auto", "flat", "coalesced"])
def test_one_collective_per_bucket(world_results, prim):
    _, per_rank = world_results
    for results in per_rank:
        for key, entry in results.items():
            if key[2] != prim:
                continue
            assert all(b[2] == 1 for b in entry["buckets"]), (key, entry["buckets"])
            # observed: the collectives torch received, besides the argument check
            assert entry["collectives"] == len(entry["buckets"]) == entry["reported"], (key, entry)


def test_per_tensor_fallback_issues_one_collective_per_tensor(world_results):
    _, per_rank = world_results
    entry = per_rank[0][("fp32", "SUM", "per_tensor")]
    assert entry["collectives"] == len(cases.SHAPES)
    assert entry["decisions"][0][1] == "per_tensor"


def test_mixed_dtypes_one_bucket_per_dtype(world_results):
    _, per_rank = world_results
    entry = per_rank[0][("mixed", "SUM", "auto")]
    assert sorted(b[3] for b in entry["buckets"]) == sorted(
        ["torch.float32", "torch.bfloat16", "torch.float64", "torch.float16"]
    )
    assert entry["collectives"] == 4


def test_tensor_larger_than_bucket_is_split(world_results):
    _, per_rank = world_results
    entry = per_rank[0][("large", "SUM", "auto")]
    fp32 = [b for b in entry["buckets"] if b[3] == "torch.float32"]
    fp64 = [b for b in entry["buckets"] if b[3] == "torch.float64"]
    assert len(fp32) == math.ceil(105 / 16) and max(b[1] for b in fp32) == 16
    assert len(fp64) == math.ceil(30 / 8) and max(b[1] for b in fp64) == 8


def test_empty_tensors_take_no_collective(world_results):
    _, per_rank = world_results
    assert per_rank[0][("only_empty", "SUM", "auto")]["collectives"] == 0
    assert per_rank[0][("empty", "SUM", "auto")]["collectives"] == 1


def test_auto_prefers_flat_over_gloo_without_mpi(world_results):
    _, per_rank = world_results
    for _dtype, prim, why in per_rank[0][("mixed", "SUM", "auto")]["decisions"]:
        assert prim == "flat"
        assert "mpi4py" in why and "MPI launcher" in why
