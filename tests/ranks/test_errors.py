"""Every error a user can get from a public call is a CollgradError (README, Errors): before any process
group exists, for a bad timeout, and for a bucket that one rank cannot send."""

from __future__ import annotations

import pytest
import torch

import collgrad
from tests.harness import attempt, run_ranks


def test_a_collective_before_init_process_group_is_a_collgrad_error():
    assert not torch.distributed.is_initialized()
    for call in (
        lambda: collgrad.all_reduce_coalesced([torch.ones(3)]),
        lambda: collgrad.all_gather_coalesced([torch.ones(6)], [torch.ones(3)]),
        lambda: collgrad.capabilities("cpu"),
    ):
        with pytest.raises(collgrad.NotInitializedError, match="init_process_group"):
            call()


@pytest.mark.parametrize("timeout", [0, -1.0, "soon", float("nan"), True])
def test_a_bad_timeout_is_an_invalid_argument(timeout, monkeypatch):
    with pytest.raises(collgrad.InvalidArgumentError, match="timeout"):
        collgrad.Dispatcher(timeout=timeout)
    monkeypatch.setenv("COLLGRAD_TIMEOUT", str(timeout))
    with pytest.raises(collgrad.InvalidArgumentError, match="COLLGRAD_TIMEOUT"):
        collgrad.Dispatcher()


def _one_rank_cannot_send(rank, world):
    dispatcher = collgrad.Dispatcher(timeout=20)

    def hook(point):
        if point.rank == world - 1:
            raise RuntimeError("injected: the backend refused the bucket")

    dispatcher.fault_hook = hook
    return attempt(lambda: dispatcher.all_reduce([torch.ones(10)]))


def test_a_bucket_one_rank_cannot_send_is_a_collgrad_error_on_every_rank():
    world = 2
    results = run_ranks(_one_rank_cannot_send, world, timeout=120)
    *others, failing = results
    assert "CollgradError" in failing["is_a"] and "could not be sent" in failing["message"], failing
    for res in others:  # they learn it from the store while waiting: the rank that failed is named
        assert res["error"] == "RankFailedError" and "CollgradError" in res["is_a"], res
        assert f"it failed on rank(s) [{world - 1}]" in res["message"], res
