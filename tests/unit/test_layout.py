"""The ZeRO layout rules without any process group."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.layout import Fragment, fragment_of, owned_fragments
from tests.groups import flat_group, sliced_group


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 5), st.sampled_from(["flat", "per_param"]))
def test_every_element_is_owned_by_exactly_one_rank(sizes, world, kind):
    group = (flat_group if kind == "flat" else sliced_group)(sizes, world)
    seen = [[0] * n for n in sizes]
    for rank in range(world):
        for frag in owned_fragments(group, rank):
            assert 0 <= frag.local_offset and frag.local_offset + frag.numel <= group.partition_numel
            for k in range(frag.param_offset, frag.param_offset + frag.numel):
                seen[frag.param][k] += 1
    assert all(c == 1 for row in seen for c in row)


def test_a_parameter_owned_entirely_by_another_rank_has_no_fragment_here():
    group = flat_group([35, 7, 21, 3, 3, 3, 27, 9, 9, 1], 2)  # DeepSpeed's test model: 118 -> 120, P = 60
    rank0 = {f.param for f in owned_fragments(group, 0)}
    rank1 = {f.param for f in owned_fragments(group, 1)}
    assert rank0 == {0, 1, 2} and 0 not in rank1 and 2 in rank1  # l1.weight straddles the edge
    straddling = [f for f in owned_fragments(group, 1) if f.param == 2]
    assert straddling[0].param_offset == 18 and straddling[0].local_offset == 0  # DeepSpeed's first_offset


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 6), st.randoms(use_true_random=False))
def test_a_partitions_fragments_found_by_bisection_are_a_scan_of_every_parameter(sizes, world, rnd):
    """The bisection over the flat buffer's offsets finds what a scan of every parameter finds, in
    parameter order, whatever order the parameters lie in and with empty ones among them."""
    laid = flat_group(sizes, world)
    slots = list(laid.params)
    rnd.shuffle(slots)  # parameter order need not be flat-buffer order
    group = dataclasses.replace(laid, params=tuple(slots))
    for rank in range(world):
        lo, hi = rank * group.partition_numel, (rank + 1) * group.partition_numel
        scanned = []
        for k, p in enumerate(group.params):
            start, end = max(p.offset, lo), min(p.offset + p.numel, hi)
            if start < end:
                scanned.append(Fragment(k, start - p.offset, start - lo, end - start))
        assert owned_fragments(group, rank) == tuple(scanned)
        assert [fragment_of(group, k, rank) for k in range(len(sizes))] == [
            next((f for f in scanned if f.param == k), None) for k in range(len(sizes))
        ]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 6))
def test_a_sliced_groups_fragments_are_each_parameters_own(sizes, world):
    """A sliced group's fragments, made in one sweep, are what ``fragment_of`` finds for each parameter,
    empty parameters and ranks past the last slice holding none."""
    group = sliced_group(sizes, world)
    for rank in range(world):
        each = [fragment_of(group, k, rank) for k in range(len(sizes))]
        assert owned_fragments(group, rank) == tuple(f for f in each if f is not None)
