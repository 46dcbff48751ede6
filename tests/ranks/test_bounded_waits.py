"""A rank that never joins a collective makes the others raise within collgrad's bound, naming the
operation, the bucket and the group: never a wait for the process group's 30-minute timeout."""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.guarantees  # the README's Guarantees section

BOUND = 3.0


def _one_rank_skips(rank, world, stage):
    import collgrad

    dispatcher = collgrad.Dispatcher(timeout=BOUND)
    tensors = [torch.ones(1000), torch.ones(10, dtype=torch.bfloat16)]
    if stage == "data":
        dispatcher.all_reduce(tensors)  # agreement done together; the next call is the one skipped
    if rank == world - 1:
        time.sleep(BOUND + 2)  # never calls
        return None
    start = time.monotonic()
    try:
        # At "data" the ranks agreed on this very call already (the one above): skip the argument check,
        # so that the wait that runs out is the bucket's own.
        dispatcher.all_reduce(tensors, bucket_bytes=1024 if stage == "agreement" else None, check=stage == "agreement")
    except collgrad.CollgradTimeoutError as exc:
        return {"seconds": time.monotonic() - start, "message": str(exc)}
    return {"seconds": time.monotonic() - start, "message": None}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", ["agreement", "data"])
def test_other_ranks_raise_within_the_bound(world, stage):
    results = run_ranks(_one_rank_skips, world, stage, timeout=60)
    for rank, res in enumerate(results[:-1]):
        assert res["message"] is not None, f"rank {rank} did not raise"
        assert BOUND - 0.5 <= res["seconds"] < BOUND + 5, res["seconds"]
        assert f"group {list(range(world))}" in res["message"] and f"within {BOUND:g} s" in res["message"]
        if stage == "data":
            assert "all_reduce of bucket 0" in res["message"] and "flat over gloo" in res["message"]
        else:
            # the first collective of a call: the argument check every rank joins before any data moves
            assert "argument check of all_reduce_coalesced" in res["message"]


def test_timeout_comes_from_the_environment(monkeypatch):
    from collgrad.backends.waits import DEFAULT_TIMEOUT_S, timeout_from_env

    assert timeout_from_env(None, {}) == DEFAULT_TIMEOUT_S
    assert timeout_from_env(None, {"COLLGRAD_TIMEOUT": "7.5"}) == 7.5
    assert timeout_from_env(2, {"COLLGRAD_TIMEOUT": "7.5"}) == 2
    with pytest.raises(ValueError):
        timeout_from_env(0)
