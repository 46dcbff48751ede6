"""The gradient plan without any process group: every requested parameter in exactly one step, steps
within their budget, the same plan whatever the rank, and the choice rule at its boundary."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.layout import LayoutGroup, ParamSlot, Partitioning, StateLayout
from collgrad.state.plan import (
    GATHER_MIN_SHARE,
    PLANS,
    GradCall,
    PlanKind,
    batch_params,
    choose_kind,
    needs_capabilities,
    plan_grads,
)


def _group(index, kind, sizes, world, pad_to=1):
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        per_rank = -(-n // world) if kind is Partitioning.SLICED else n
        slots.append(ParamSlot(f"g{index}.p{i}", (n,), n, offset, per_rank))
        offset += per_rank
    if kind is Partitioning.PARTITIONED_FLAT:
        total = -(-offset // (pad_to * world)) * (pad_to * world)
        partition = total // world
    else:
        partition = offset
    return LayoutGroup(index, kind, tuple(range(world)), partition, torch.float32, torch.float32, tuple(slots))


groups = st.builds(
    _group,
    st.just(0),
    st.sampled_from(list(Partitioning)),
    st.lists(st.integers(1, 400), min_size=0, max_size=15),
    st.integers(1, 4),
    st.integers(1, 8),
)
calls = st.builds(GradCall, st.sampled_from(PLANS), st.integers(4, 4096), st.booleans())


def _layout(gs):
    gs = tuple(
        LayoutGroup(i, g.kind, g.group_ranks, g.partition_numel, g.wire_dtype, g.out_dtype, g.params)
        for i, g in enumerate(gs)
    )
    return StateLayout("test", gs, tuple(p.name for g in gs for p in g.params))


@settings(max_examples=150, deadline=None)
@given(st.lists(groups, min_size=1, max_size=4), calls, st.lists(st.booleans(), min_size=4, max_size=4), st.booleans())
def test_every_parameter_in_exactly_one_step_within_the_budget(gs, call, gather_ok, per_param):
    layout = _layout(gs)
    plan = plan_grads(layout, call, dict(enumerate(gather_ok)), per_param)
    assert [g.group for g in plan.groups] == list(range(len(layout.groups)))
    for gplan, group in zip(plan.groups, layout.groups):
        flat = [k for batch in gplan.batches for k in batch]
        assert flat == list(range(len(group.params)))  # each once, in layout order
        assert all(batch for batch in gplan.batches)  # no empty step
        if gplan.budget is not None:
            gathered = gplan.kind is PlanKind.ALL_GATHER and group.kind is Partitioning.SLICED
            for batch in gplan.batches:
                numel = sum(
                    group.params[k].slice_numel * group.world if gathered else group.params[k].numel for k in batch
                )
                assert len(batch) == 1 or numel * 4 <= gplan.budget  # one parameter may exceed it alone
        if per_param:
            assert gplan.kind is PlanKind.ACCESSOR and all(len(b) == 1 for b in gplan.batches)


@settings(max_examples=150, deadline=None)
@given(st.lists(groups, min_size=1, max_size=3), calls, st.lists(st.booleans(), min_size=3, max_size=3))
def test_the_same_plan_on_every_rank(gs, call, gather_ok):
    # Nothing rank-specific goes in: equal layouts built separately (as each rank builds its own) and
    # equal agreed capabilities give equal plans.
    one = plan_grads(_layout(gs), call, dict(enumerate(gather_ok)))
    two = plan_grads(_layout(copy.deepcopy(gs)), call, dict(enumerate(gather_ok)))
    assert one == two


def test_auto_gathers_a_flat_group_from_half_of_it_and_reduces_below():
    world = 2
    # 100 elements per rank, 200 gathered; the call reads exactly half, then one element less.
    half = _group(0, Partitioning.PARTITIONED_FLAT, [60, 40], world, pad_to=100)
    assert half.world * half.partition_numel == 200 and GATHER_MIN_SHARE == 0.5
    call = GradCall("auto", 1 << 20, False)
    assert choose_kind(half, call, gather_ok=True) is PlanKind.ALL_GATHER
    less = LayoutGroup(
        0,
        half.kind,
        half.group_ranks,
        half.partition_numel,
        half.wire_dtype,
        half.out_dtype,
        (half.params[0], ParamSlot("g0.p1", (39,), 39, 60, 39)),
    )
    assert choose_kind(less, call, gather_ok=True) is PlanKind.ALL_REDUCE


def test_the_choice_rule():
    call = GradCall("auto", 1 << 20, False)
    flat = _group(0, Partitioning.PARTITIONED_FLAT, [50, 50], 2)
    sliced = _group(0, Partitioning.SLICED, [50, 50], 2)
    assert choose_kind(flat, call, gather_ok=False) is PlanKind.ALL_REDUCE  # no bucket gather primitive
    assert choose_kind(sliced, call, gather_ok=True) is PlanKind.ALL_GATHER
    streaming = GradCall("auto", 1 << 20, True)
    assert choose_kind(flat, streaming, gather_ok=True) is PlanKind.ALL_REDUCE  # whole parameters per bucket
    assert choose_kind(sliced, streaming, gather_ok=True) is PlanKind.ALL_GATHER
    assert choose_kind(_group(0, Partitioning.REPLICATED, [5], 2), call, True) is PlanKind.LOCAL
    assert choose_kind(_group(0, Partitioning.SLICED, [5], 1), call, True) is PlanKind.LOCAL  # a group of one rank
    forced = GradCall("all_gather", 1 << 20, True)
    assert choose_kind(flat, forced, gather_ok=False) is PlanKind.ALL_GATHER  # plan= wins over auto's rule
    # Capabilities are asked for exactly where the rule reads them (asking is collective the first time).
    for group in (flat, sliced, _group(0, Partitioning.REPLICATED, [5], 2), _group(0, Partitioning.SLICED, [5], 1)):
        for c in (call, streaming, forced):
            reads = choose_kind(group, c, True) != choose_kind(group, c, False)
            assert not reads or needs_capabilities(group, c)


def test_zero3_gathers_go_by_buckets_of_gathered_bytes_and_half_when_streaming():
    group = _group(0, Partitioning.SLICED, [100] * 10, 2)  # 100 gathered elements each, 400 bytes
    plan = plan_grads(_layout([group]), GradCall("auto", 1200, False), {0: True})
    assert plan.groups[0].batches == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9,))
    plan = plan_grads(_layout([group]), GradCall("auto", 1200, True), {0: True})
    assert plan.groups[0].budget == 600 and plan.groups[0].batches == tuple((k,) for k in range(10))


def test_streamed_local_reads_go_bucket_by_bucket():
    # BF16_Optimizer / stage 0 hold full gradients: streaming copies them a bucket at a time, not all at once
    group = _group(0, Partitioning.REPLICATED, [100] * 8, 1)
    streamed, budget = batch_params(group, PlanKind.LOCAL, GradCall("auto", 4 * 250, True))
    assert budget == 1000 and streamed == ((0, 1), (2, 3), (4, 5), (6, 7))
    whole, _ = batch_params(group, PlanKind.LOCAL, GradCall("auto", 4 * 250, False))
    assert whole == (tuple(range(8)),)
