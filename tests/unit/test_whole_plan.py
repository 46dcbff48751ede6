"""The plan of ``model_parallel="whole"`` (collgrad/state/whole.py) without any process group: the
buckets every rank of a tensor- or expert-parallel group computes are the same whatever its own shard,
each rank's run of a bucket holds each of its shards once, back to back, within the bucket's width; the
unsharded model's order of a MoE layer's experts; whole values narrowed to each rank's slice."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.adapters.base import TENSOR_PARALLEL, Source
from collgrad.state.layout import Expert, LayoutGroup, ParamSlot, Partitioning, Split, StateLayout
from collgrad.state.whole import join_plan, narrowed, whole_order

DTYPES = (torch.float32, torch.bfloat16)


@st.composite
def _models(draw):
    """A tensor-parallel degree, an expert-parallel one, and parameters: (name, whole shape, dtype, how
    split: None, a dimension and every rank's bounds along it, or an expert)."""
    tp, ep = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    params = []
    for k in range(draw(st.integers(1, 12))):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        how = draw(st.sampled_from(["whole", "split", "expert"]))
        dtype = draw(st.sampled_from(DTYPES))
        if how == "split":
            dim = draw(st.integers(0, len(shape) - 1))
            n = shape[dim] + draw(st.integers(0, 6))  # room for tp ranks, uneven
            shape = shape[:dim] + (max(n, tp),) + shape[dim + 1 :]
            cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=tp - 1, max_size=tp - 1)))
            params.append((f"p{k}", shape, dtype, (dim, (0, *cuts, shape[dim]))))
        else:
            params.append((f"p{k}", shape, dtype, how))
    return tp, ep, params


def _view(params, tp_rank: int, ep_rank: int, ep: int):
    """What one rank sees: its names, shapes and dtypes, its splits and experts."""
    named, splits, experts = [], {}, {}
    for name, shape, dtype, how in params:
        if isinstance(how, tuple):
            dim, bounds = how
            split = Split(dim, shape, bounds[tp_rank], bounds[tp_rank + 1], bounds)
            splits[name] = split
            named.append((name, split.shard_shape(), dtype))
        else:
            if how == "expert":
                experts[name] = Expert(tuple(f"{name}@{e}" for e in range(ep)), ep_rank, (ep_rank,), "ep")
            named.append((name, shape, dtype))
    return named, splits, experts


@settings(max_examples=80, deadline=None)
@given(_models(), st.integers(1, 512))
def test_every_rank_of_a_group_plans_the_same_collectives_and_each_run_holds_its_shards_once(model, cap):
    tp, ep, params = model
    plans = [join_plan(*_view(params, t, e, ep), cap) for t in range(tp) for e in range(ep)]
    assert all(p == plans[0] for p in plans)  # the same collectives, in the same order, on every rank
    plan = plans[0]
    split_or_expert = [n for n, _, _, how in params if how != "whole"]
    assert [m for b in plan for m in b.members] == split_or_expert  # each once, in order
    shapes = {n: (s, how) for n, s, _, how in params}
    for bucket in plan:
        assert bucket.group in (TENSOR_PARALLEL, "ep")
        ranks = len(bucket.counts[0])
        for r in range(ranks):
            at = 0
            for name, counts, offsets in zip(bucket.members, bucket.counts, bucket.offsets):
                whole, how = shapes[name]
                if isinstance(how, tuple):
                    dim, bounds = how
                    assert counts[r] == math.prod(whole) // whole[dim] * (bounds[r + 1] - bounds[r])
                else:
                    assert counts[r] == math.prod(whole)
                assert offsets[r] == at  # back to back in rank r's run
                at += counts[r]
            assert at <= bucket.width
        assert bucket.width == max(sum(c[r] for c in bucket.counts) for r in range(ranks))
        total = sum(sum(c) for c in bucket.counts) * bucket.dtype.itemsize
        assert total <= cap or len(bucket.members) == 1


def _source(experts: dict[str, Expert], splits: dict[str, Split] | None = None) -> Source:
    """A source with these experts and splits over a replicated layout of ``names`` (nothing read)."""
    source = Source()
    names = ["a", *experts, *(splits or {}), "z"]
    slots = tuple(ParamSlot(n, (2, 3), 6, 0, 6) for n in names)
    source.layout = StateLayout(
        "test", (LayoutGroup(0, Partitioning.REPLICATED, (0,), 0, torch.float32, torch.float32, slots),), tuple(names)
    )
    source.experts, source.splits = experts, splits or {}
    source.params = {n: torch.nn.Parameter(torch.zeros(2, 3)) for n in names}
    return source


def test_a_moe_layers_experts_take_the_order_they_have_at_expert_parallel_degree_1():
    # 2 local experts (weight, bias each) on expert-parallel rank 1 of 2: global experts 2 and 3
    local = [f"moe.experts.{i}.{p}" for i in range(2) for p in ("weight", "bias")]
    experts = {
        n: Expert(tuple(n.replace(f".{i}.", f".{e * 2 + i}.") for e in range(2)), 1, (1,), "ep_size_2")
        for n in local
        for i in [int(n.split(".")[2])]
    }
    order = whole_order(_source(experts), ["a", *local, "z"])
    at_ep_1 = ["a", *[f"moe.experts.{g}.{p}" for g in range(4) for p in ("weight", "bias")], "z"]
    assert order == at_ep_1
    # two MoE layers one after the other: each layer's run apart
    two = {
        n.replace("moe.", f"{layer}."): e._replace(
            names=tuple(x.replace("moe.", f"{layer}.") for x in e.names), layer=layer
        )
        for layer in ("l1", "l2")
        for n, e in experts.items()
    }
    order = whole_order(_source(two), ["a", *two, "z"])
    assert order == ["a", *[x.replace("moe.", f"{layer}.") for layer in ("l1", "l2") for x in at_ep_1[1:-1]], "z"]


def test_whole_values_are_narrowed_to_this_ranks_slice_and_its_own_experts():
    expert = Expert(("e.0.w", "e.1.w"), 1, (1,), "ep")
    split = Split(1, (2, 6), 2, 5, (0, 2, 5, 6))
    source = _source({"e.0.w": expert}, {"s": split})
    whole = torch.arange(12.0).view(2, 6)
    values = {"a": whole[:, :3], "e.0.w": whole[:, :3] + 1, "e.1.w": whole[:, :3] + 2, "s": whole, "?": whole}
    mine = narrowed(source, values)
    assert set(mine) == {"a", "e.0.w", "s", "?"}  # another rank's expert is theirs; "?" left for the check
    assert torch.equal(mine["e.0.w"], whole[:, :3] + 2)  # this rank's expert: global index 1
    assert torch.equal(mine["s"], whole[:, 2:5]) and mine["a"] is values["a"]


class _Mesh:
    """A device mesh's answers about this rank (its coordinate, each dimension's size and group)."""

    def __init__(self, coordinate: list[int], sizes: list[int]) -> None:
        self.coordinate, self.sizes = coordinate, sizes

    def get_coordinate(self) -> list[int]:
        return self.coordinate

    def size(self, dim: int) -> int:
        return self.sizes[dim]

    def get_group(self, dim: int) -> str:
        return f"group {dim}"


class _Spec:
    def __init__(self, placements, shape, mesh) -> None:
        self.placements, self.shape, self.mesh = placements, torch.Size(shape), mesh


def test_a_dtensor_shard_is_placed_only_where_it_is_one_slice_of_one_dimension():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from collgrad.state.adapters.fsdp2 import _tensor_parallel_split

    # Shard(1) over a tensor-parallel dimension of 3 (torch.chunk: 4, 4, 2 of 10 columns), rank 2
    found = _tensor_parallel_split(_Spec([Replicate(), Shard(1)], (6, 10), _Mesh([0, 2], [2, 3])), (6, 2))
    assert found == (Split(1, (6, 10), 8, 10, (0, 4, 8, 10)), 2, "group 1")
    assert _tensor_parallel_split(_Spec([Shard(0)], (6, 10), _Mesh([1], [2])), (6, 10)) is None  # not that shape
    two = _Spec([Shard(0), Shard(1)], (6, 10), _Mesh([1, 1], [2, 2]))  # sharded along two dimensions
    assert _tensor_parallel_split(two, (3, 5)) is None
    strided = _Spec([_StridedShard(0, split_factor=2)], (6, 10), _Mesh([1], [2]))
    assert _tensor_parallel_split(strided, (3, 10)) is None
