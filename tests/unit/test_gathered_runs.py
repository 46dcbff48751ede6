"""Gathering partitions as they lie in memory: for any layout and any order in which each rank's
pieces lie in its storage, the runs ``gathered_runs`` gives rebuild every parameter exactly."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.layout import LayoutGroup, ParamSlot, Partitioning, gathered_runs, owned_fragments


def _group(sizes, world):
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        slots.append(ParamSlot(f"p{i}", (n,), n, offset, n))
        offset += n
    partition = -(-offset // world)
    return LayoutGroup(
        0, Partitioning.PARTITIONED_FLAT, tuple(range(world)), partition, torch.float32, torch.float32, tuple(slots)
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.integers(1, 4), st.integers(0, 2**31))
def test_runs_rebuild_every_parameter_whatever_the_order_pieces_lie_in(sizes, world, seed):
    rnd = random.Random(seed)
    group = _group(sizes, world)
    logical = torch.arange(world * group.partition_numel, dtype=torch.float64)  # the flat group, in order
    gathered, placements = [], []
    for r in range(world):
        # this rank's pieces: its fragments, cut further at random, laid out in storage in a random order
        cuts = sorted({0, group.partition_numel} | {f.local_offset for f in owned_fragments(group, r)})
        cuts = sorted(set(cuts) | {rnd.randrange(group.partition_numel + 1) for _ in range(2)})
        pieces = [(lo, hi - lo) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
        order = list(range(len(pieces)))
        rnd.shuffle(order)
        sent, at = {}, 0
        span = torch.empty(group.partition_numel, dtype=torch.float64)
        for j in order:
            lo, n = pieces[j]
            span[at : at + n] = logical[r * group.partition_numel + lo : r * group.partition_numel + lo + n]
            sent[j] = at
            at += n
        gathered.append(span)
        placements.append([(lo, sent[j], n) for j, (lo, n) in enumerate(pieces)])
    full = torch.cat(gathered)
    where = gathered_runs(group, placements)
    for k, slot in enumerate(group.params):
        rebuilt = torch.cat([full[at : at + n] for at, n in where[k]])
        assert torch.equal(rebuilt, logical[slot.offset : slot.offset + slot.numel]), (k, where[k])


def test_an_empty_piece_where_a_real_one_starts_is_passed_over():
    # a zero-size parameter's fragment (DeepSpeed's get_flat_partition makes them) lies at the start of the
    # next parameter's, and is sent after the main run: the runs come from the real piece
    group = _group([4, 4], 1)
    pieces = [(0, 0, 4), (4, 4, 4), (4, 8, 0)]
    assert gathered_runs(group, [pieces]) == [[(0, 4)], [(4, 4)]]
