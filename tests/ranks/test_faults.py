"""Faults injected for real, through the dispatcher's test hook (no mock of torch.distributed): a
primitive that raises before any data moves, on every rank or on one rank only."""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_ranks
from tests.ranks import cases

pytestmark = pytest.mark.guarantees  # the README's Guarantees section


def _inject(rank, world, op, who):
    import collgrad

    dispatcher = collgrad.Dispatcher(timeout=20)

    def hook(point):
        if point.bucket == 1 and (who == "all" or point.rank == world - 1):
            raise RuntimeError("injected: the backend refused the bucket")

    dispatcher.fault_hook = hook
    inputs = cases.make("large", rank)  # several buckets with LARGE_BUCKET_BYTES
    if op == "all_reduce":
        expected = cases.reduce_reference(cases.make("large", rank))
        outputs = inputs
        run = lambda: dispatcher.all_reduce(inputs, bucket_bytes=cases.LARGE_BUCKET_BYTES)  # noqa: E731
    else:
        expected = cases.gather_reference(inputs, world)
        outputs = [torch.full((world * t.numel(),), -7, dtype=t.dtype) for t in inputs]
        run = lambda: dispatcher.all_gather(outputs, inputs, bucket_bytes=cases.LARGE_BUCKET_BYTES * world)  # noqa: E731
    before = [t.clone() for t in outputs]
    start = time.monotonic()
    try:
        record = run()
    except collgrad.CollgradError as exc:
        return {
            "error": str(exc),
            "seconds": time.monotonic() - start,
            "untouched": all(torch.equal(a, b) for a, b in zip(outputs, before)),
        }
    return {
        "equal": all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(outputs, expected)),
        "buckets": [(b.index, b.primitive, b.fallback_reason) for b in record.buckets],
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_primitive_raising_on_every_rank_falls_back_with_identical_results(world, op):
    for res in run_ranks(_inject, world, op, "all", timeout=120):
        assert res.get("equal"), res
        fell_back = [b for b in res["buckets"] if b[2]]
        assert [b[:2] for b in fell_back] == [(1, "per_tensor")]
        assert "raised on every rank" in fell_back[0][2] and "injected" in fell_back[0][2]
        assert all(b[1] == "flat" for b in res["buckets"] if b[0] != 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_primitive_raising_on_one_rank_makes_every_rank_raise_and_write_nothing(world, op):
    results = run_ranks(_inject, world, op, "one", timeout=120)
    for rank, res in enumerate(results):
        assert "error" in res, (rank, res)
        assert res["seconds"] < 5, res["seconds"]  # well below the 20 s bound: told through the store
        assert res["untouched"], rank  # either the full result or an error: nothing half-written
        if rank == world - 1:
            assert "could not be sent" in res["error"] and "injected" in res["error"]
        else:
            assert f"it failed on rank(s) [{world - 1}]" in res["error"]


def _fallback_then_other_dispatcher(rank, world):
    import collgrad

    big = torch.full((20_000_000,), float(rank + 1))  # its per-tensor fallback outlasts a 50 ms wait slice
    first = collgrad.Dispatcher(timeout=30)
    first.fault_hook = lambda point: (_ for _ in ()).throw(RuntimeError("injected on every rank"))
    record = first.all_reduce([big])
    ok_first = bool((big == world * (world + 1) / 2).all())
    second = collgrad.Dispatcher(timeout=30)  # a new dispatcher on the same group: fresh store keys
    small = torch.full((10,), float(rank + 1))
    second.all_reduce([small])
    return ok_first, record.buckets[0].fallback_reason != "", bool((small == world * (world + 1) / 2).all())


def test_a_long_fallback_and_a_later_dispatcher_on_the_same_group_complete():
    assert run_ranks(_fallback_then_other_dispatcher, 2, timeout=120) == [(True, True, True)] * 2
