"""Every rank of a group takes the same decision, even when ranks find different things.

Overrides set on one rank only (through its environment) stand for a backend missing on that rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.harness import run_ranks


def _reduce_and_report(rank, world):
    import collgrad
    from collgrad import CollgradError

    tensors = [torch.full((4,), float(rank + 1)), torch.full((3,), float(rank + 1), dtype=torch.bfloat16)]
    try:
        record = collgrad.all_reduce_coalesced(tensors)
    except CollgradError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    expected = float(world * (world + 1) // 2)
    return {
        "ok": all(torch.equal(t, torch.full_like(t, expected)) for t in tensors),
        "decisions": [(str(d.dtype), d.primitive, d.why) for d in record.decisions],
        "primitives": sorted({b.primitive for b in record.buckets}),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_rank_without_flat_makes_the_group_choose_a_common_primitive(world):
    last = world - 1
    results = run_ranks(_reduce_and_report, world, rank_env={last: {"COLLGRAD_FORBID": "flat"}})
    for res in results:
        assert res["ok"], res
        assert res["primitives"] == ["coalesced"]
        assert res["decisions"] == results[0]["decisions"]  # identical on every rank
        why = res["decisions"][0][2]
        assert "flat: forbidden by the override" in why and f"(rank {last})" in why, why


def test_ranks_with_different_overrides_agree_on_what_both_allow():
    results = run_ranks(
        _reduce_and_report,
        2,
        rank_env={0: {"COLLGRAD_FORCE": "per_tensor,coalesced"}, 1: {"COLLGRAD_FORBID": "coalesced"}},
    )
    for res in results:
        assert res["ok"] and res["primitives"] == ["per_tensor"], res


def test_forcing_what_one_rank_lacks_raises_on_every_rank():
    # mpi4py cannot run outside an MPI launcher: rank 1 allows nothing else, so no primitive is common.
    results = run_ranks(_reduce_and_report, 2, rank_env={1: {"COLLGRAD_FORCE": "mpi4py"}})
    for res in results:
        assert res.get("error") == "NoPrimitiveError", res
        assert "another backend/primitive is forced" in res["message"] and "rank 1" in res["message"]


@pytest.mark.parametrize("world", [2, 3])
def test_invalid_override_on_one_rank_raises_on_every_rank(world):
    results = run_ranks(_reduce_and_report, world, rank_env={1: {"COLLGRAD_FORBID": "glooo"}})
    for rank, res in enumerate(results):
        assert res.get("error") == "PolicyError", res
        if rank == 1:
            assert "glooo" in res["message"]
        else:
            assert "rank(s) [1] of group" in res["message"]


def _capabilities_twice(rank, world):
    import torch.distributed as dist

    import collgrad

    first = collgrad.capabilities("cpu")
    second = collgrad.capabilities("cpu")
    sub = dist.new_group([0, 2])
    sub_caps = collgrad.capabilities("cpu", group=sub) if rank in (0, 2) else None
    return first is second, first, sub_caps


def test_capabilities_are_cached_immutable_and_per_group():
    results = run_ranks(_capabilities_twice, 3)
    for same, caps, _sub in [r for r in results]:
        assert same
        assert caps == results[0][1]
        assert caps.group_ranks == (0, 1, 2) and caps.backend == "gloo"
    assert results[0][2].group_ranks == (0, 2) and results[1][2] is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        results[0][1].backend = "nccl"


def _env_override_then_same_call_policy(rank, world):
    import collgrad
    from collgrad import Policy

    dispatcher = collgrad.Dispatcher(timeout=10)
    t = torch.full((8,), float(rank + 1))
    dispatcher.all_reduce([t])  # rank 0 has COLLGRAD_FORCE=flat in its environment, rank 1 not
    record = dispatcher.all_reduce([t], policy=Policy(force="flat"))  # the same call policy on both
    return record.collectives, t.tolist()


def test_ranks_with_different_environments_reuse_agreements_alike():
    # Cached agreements are keyed on the call's policy (the same on every rank), not on the merged one.
    results = run_ranks(_env_override_then_same_call_policy, 2, rank_env={0: {"COLLGRAD_FORCE": "flat"}})
    assert [r[0] for r in results] == [1, 1]
    assert results[0][1] == results[1][1] == [6.0] * 8  # 1 + 2 = 3, then 3 + 3


def _plain_module_changes(rank, world):
    import collgrad

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    model(torch.ones(4, 3)).sum().backward()
    first = collgrad.safe_get_full_model_grads(model)
    model[0].requires_grad_(True)
    model.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    second = collgrad.safe_get_full_model_grads(model)
    return list(first), first.record.plan_cached, list(second), second.record.plan_cached


def test_a_plain_module_whose_trainable_parameters_change_is_planned_anew():
    for first, cached1, second, cached2 in run_ranks(_plain_module_changes, 2):
        assert first == ["1.weight", "1.bias"] and not cached1
        assert second == ["0.weight", "0.bias", "1.weight", "1.bias"] and not cached2
