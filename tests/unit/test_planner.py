"""The planner without any process group: properties over random inputs, and named examples."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.backends.base import INT32_MAX, UNLIMITED
from collgrad.backends.ops import Op, Primitive
from collgrad.core.plan import BucketRule, Segment, TensorSpec
from collgrad.core.planner import bucket_capacity, plan_buckets, split_stream, split_whole
from collgrad.errors import CollgradError

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
DEVICES = ["cpu", "cuda:0"]

specs = st.lists(
    st.builds(TensorSpec, st.integers(0, 300), st.sampled_from(DTYPES), st.sampled_from(DEVICES)), max_size=25
)
primitives = st.sampled_from(list(Primitive))


def _rules(tensors, capacity, primitive):
    return {(t.device, t.dtype): BucketRule(primitive, "gloo", t.dtype, capacity) for t in tensors}


@settings(max_examples=150, deadline=None)
@given(specs, st.integers(1, 200), primitives, st.sampled_from(list(Op)), st.integers(1, 8))
def test_every_element_lands_exactly_once_and_no_bucket_exceeds_its_cap(tensors, capacity, prim, op, world):
    plan = plan_buckets(op, tensors, _rules(tensors, capacity, prim), world)
    plan.validate()  # tiling, order, one (device, dtype) per bucket
    seen = [[0] * t.numel for t in tensors]
    for bucket in plan.buckets:
        assert bucket.numel <= capacity
        for seg in bucket.segments:
            for k in range(seg.tensor_offset, seg.tensor_offset + seg.numel):
                seen[seg.tensor][k] += 1
    assert all(count == 1 for row in seen for count in row)


@settings(max_examples=150, deadline=None)
@given(specs, st.integers(1, 200), primitives)
def test_plan_is_deterministic_and_rank_free(tensors, capacity, prim):
    rules = _rules(tensors, capacity, prim)
    first = plan_buckets(Op.ALL_REDUCE, tensors, rules, 3)
    again = plan_buckets(Op.ALL_REDUCE, list(tensors), dict(reversed(list(rules.items()))), 3)
    assert first == again


@settings(max_examples=150, deadline=None)
@given(specs, st.integers(1, 200))
def test_bucket_count_is_minimal_per_device_and_dtype(tensors, capacity):
    plan = plan_buckets(Op.ALL_REDUCE, tensors, _rules(tensors, capacity, Primitive.FLAT), 2)
    totals: dict = {}
    for t in tensors:
        totals[(t.device, t.dtype)] = totals.get((t.device, t.dtype), 0) + t.numel
    expected = sum(-(-n // capacity) for n in totals.values())
    assert len(plan.buckets) == expected


def test_split_stream_cuts_inside_tensors():
    assert split_stream([(0, 5), (1, 3), (2, 9)], 8) == [
        (8, (Segment(0, 0, 0, 5), Segment(1, 0, 5, 3))),
        (8, (Segment(2, 0, 0, 8),)),
        (1, (Segment(2, 8, 0, 1),)),
    ]


def test_groups_in_order_of_first_appearance_and_skips_empty_tensors():
    tensors = [
        TensorSpec(2, torch.bfloat16, "cpu"),
        TensorSpec(0, torch.float32, "cpu"),
        TensorSpec(3, torch.float32, "cpu"),
        TensorSpec(4, torch.bfloat16, "cpu"),
    ]
    plan = plan_buckets(Op.ALL_REDUCE, tensors, _rules(tensors, 100, Primitive.FLAT), 2)
    assert [(b.dtype, [s.tensor for s in b.segments]) for b in plan.buckets] == [
        (torch.bfloat16, [0, 3]),
        (torch.float32, [2]),
    ]


def test_bucket_capacity():
    mib = 1 << 20
    assert bucket_capacity(Op.ALL_REDUCE, 4 * mib, torch.float32, 8, UNLIMITED) == mib
    assert bucket_capacity(Op.ALL_GATHER, 4 * mib, torch.float32, 8, UNLIMITED) == mib // 8
    assert bucket_capacity(Op.ALL_REDUCE, 16 << 30, torch.int8, 2, INT32_MAX) == INT32_MAX  # MPI int counts
    assert bucket_capacity(Op.ALL_REDUCE, 1, torch.float64, 2, UNLIMITED) == 1  # always progresses
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_capacity(Op.ALL_REDUCE, 0, torch.float32, 2, UNLIMITED)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=25), st.integers(1, 200))
def test_split_whole_never_cuts_a_tensor_and_fills_buckets_in_order(sizes, capacity):
    buckets = split_whole(list(enumerate(sizes)), capacity)
    segments = [seg for _, segs in buckets for seg in segs]
    assert [(s.tensor, s.numel) for s in segments] == list(enumerate(sizes))  # each whole, in order
    assert all(s.tensor_offset == 0 for s in segments)
    for numel, segs in buckets:
        assert numel == sum(s.numel for s in segs) and [s.bucket_offset for s in segs] == [
            sum(x.numel for x in segs[:i]) for i in range(len(segs))
        ]
        assert numel <= capacity or len(segs) == 1  # over capacity only alone
    for (n1, _), (_, nxt) in zip(buckets, buckets[1:]):
        assert n1 + nxt[0].numel > capacity  # a bucket closes only where the next tensor would not fit


def test_a_whole_tensor_over_its_bucket_passes_validation_alone_and_only_in_whole_plans():
    rule = BucketRule(Primitive.COALESCED, "gloo", torch.float32, 8)
    specs = [
        TensorSpec(15, torch.float32, "cpu"),
        TensorSpec(5, torch.float32, "cpu"),
        TensorSpec(5, torch.float32, "cpu"),
    ]
    plan = plan_buckets(Op.ALL_GATHER, specs, {("cpu", torch.float32): rule}, 2, whole=True)
    plan.validate()
    assert [[s.tensor for s in b.segments] for b in plan.buckets] == [[0], [1], [2]]
    cut = plan_buckets(Op.ALL_GATHER, specs, {("cpu", torch.float32): rule}, 2)
    assert all(b.numel <= 8 for b in cut.buckets)
    with pytest.raises(CollgradError, match="holds 15 elements"):
        replace(plan, whole=False).validate()
