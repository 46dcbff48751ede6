"""The coalesced API fails together: one rank with a different bucket_bytes, op, tensor count or dtype
(or an invalid argument) makes every rank raise at once, naming the ranks and the difference, long
before the 120 s timeout. Collectives are counted as torch receives them (tests/counting.py)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import attempt, run_ranks

pytestmark = pytest.mark.guarantees  # the README's Guarantees section

TIMEOUT = 120.0


def _cases(rank, world):
    import torch.distributed as dist

    import collgrad
    from tests.counting import count_collectives

    dispatcher = collgrad.Dispatcher(timeout=TIMEOUT)
    last = rank == world - 1

    def tensors(n=4, dtype=torch.float32):
        return [torch.full((100 + i,), float(rank), dtype=dtype) for i in range(n)]

    out = {}
    dispatcher.all_reduce(tensors())  # the capability agreement, together, before the cases
    reduce, gather = dispatcher.all_reduce, dispatcher.all_gather
    cases = {
        "bucket_bytes": lambda: reduce(tensors(), bucket_bytes=1024 if last else 4096),
        "op": lambda: reduce(tensors(), op=dist.ReduceOp.MAX if last else dist.ReduceOp.SUM),
        "tensor_count": lambda: reduce(tensors(5 if last else 4)),
        "dtype": lambda: reduce(tensors(dtype=torch.float64 if last else torch.float32)),
        "shapes": lambda: reduce([t[:50] for t in tensors()] if last else tensors()),
        "gather_count": lambda: gather(
            [torch.empty(world * t.numel()) for t in tensors(3 if last else 4)], tensors(3 if last else 4)
        ),
        "invalid_on_one_rank": lambda: reduce(tensors(), bucket_bytes=-1 if last else None),
        "avg_of_ints_on_one_rank": lambda: reduce(
            tensors(dtype=torch.int64 if last else torch.float32), op=dist.ReduceOp.AVG
        ),
    }
    for name, fn in cases.items():
        out[name] = attempt(fn)
    # After all that the group still works, and a good call is one check plus one collective per bucket.
    with count_collectives() as calls:
        record = dispatcher.all_reduce(tensors(), bucket_bytes=1024)
    out["after"] = {
        "buckets": len(record.buckets),
        "calls": dict(calls),
        "agreements": calls.agreements,
        "total": calls.total,
    }
    with count_collectives() as calls:
        dispatcher.all_reduce(tensors(), bucket_bytes=1024, check=False)
    out["unchecked"] = {"total": calls.total, "agreements": calls.agreements}
    return out


MISMATCH = {
    "bucket_bytes": "bucket_bytes: rank(s) [0",
    "op": "reduce op differ",
    "tensor_count": "number of tensors: rank(s) [0",
    "dtype": "dtypes and devices differ",
    "shapes": "shapes differ",
    "gather_count": "number of tensors: rank(s) [0",
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_cases, request.param, timeout=240)


@pytest.mark.parametrize("case", list(MISMATCH))
def test_a_different_argument_on_one_rank_makes_every_rank_raise_at_once(results, case):
    world, per_rank = results
    messages = set()
    for rank, res in enumerate(per_rank):
        entry = res[case]
        assert entry["error"] == "ArgumentMismatchError", (rank, entry)
        assert MISMATCH[case] in entry["message"], entry["message"]
        assert f"[{world - 1}]" in entry["message"]  # the odd rank is named
        assert entry["seconds"] < 5, entry  # not the 120 s timeout
        messages.add(entry["message"].split(" [seen by")[0])
    assert len(messages) == 1  # the same error on every rank


@pytest.mark.parametrize("case", ["invalid_on_one_rank", "avg_of_ints_on_one_rank"])
def test_an_invalid_argument_on_one_rank_makes_every_rank_raise(results, case):
    world, per_rank = results
    *others, last = [res[case] for res in per_rank]
    assert last["error"] == "InvalidArgumentError" and {"ValueError", "TypeError"} <= set(last["is_a"]), last
    for entry in others:
        assert entry["error"] == "ArgumentMismatchError", entry
        assert f"rank(s) [{world - 1}] passed invalid arguments to all_reduce_coalesced" in entry["message"]
        assert entry["seconds"] < 5


def test_after_failed_calls_the_group_works_with_one_check_and_one_collective_per_bucket(results):
    _, per_rank = results
    for res in per_rank:
        after = res["after"]
        assert after["buckets"] > 1
        assert after["calls"] == {"allgather": 1, "allreduce": after["buckets"]}, after  # as torch saw them
        assert after["agreements"] == 1  # the argument check: one small all-gather
        assert res["unchecked"] == {"total": after["buckets"], "agreements": 0}  # check=False: buckets only
