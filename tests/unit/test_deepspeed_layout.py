"""Where DeepSpeed's checkpoints keep each element (collgrad.checkpoint.deepspeed_checkpoint's pure layout
functions), without DeepSpeed or a process group: every element of every parameter in exactly one place,
in order, where ZeRO-1/2's flat partitions and ZeRO-3's per-parameter parts put it."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.checkpoint.deepspeed_checkpoint import flat_sizes_zero3, placements_zero3, placements_zero12

shapes = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=3), st.integers(1, 5), st.data())
def test_zero12_places_every_element_once_at_its_flat_offset(groups, world, data):
    named = [[(f"g{g}.p{j}", s) for j, s in enumerate(group)] for g, group in enumerate(groups)]
    paddings = [[data.draw(st.integers(0, 3)) for _ in group] for group in named]
    totals = [sum(math.prod(s) + pad for (_, s), pad in zip(group, pads)) for group, pads in zip(named, paddings)]
    partition = [max(1, -(-total // world)) + data.draw(st.integers(0, 2)) for total in totals]
    placed = placements_zero12(named, paddings, partition)
    assert [p.name for p in placed] == [n for group in named for n, _ in group]
    for g, group in enumerate(named):
        at, seen = 0, set()
        for (name, shape), pad in zip(group, paddings[g]):
            place = next(p for p in placed if p.name == name)
            assert place.group == g and place.shape == shape
            flat = [piece.rank * partition[g] + piece.start + k for piece in place.pieces for k in range(piece.numel)]
            assert flat == list(range(at, at + math.prod(shape)))  # in order, where the flat group has it
            assert all(0 <= p.start and p.start + p.numel <= partition[g] and p.numel > 0 for p in place.pieces)
            assert all(p.rank < world for p in place.pieces) and not seen & set(flat)
            seen |= set(flat)
            at += math.prod(shape) + pad


@settings(max_examples=150, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=3), st.integers(1, 5))
def test_zero3_cuts_each_parameter_into_world_parts_back_to_back_on_every_rank(groups, world):
    named = [[(f"g{g}.p{j}", s) for j, s in enumerate(group)] for g, group in enumerate(groups)]
    placed = placements_zero3(named, world)
    sizes = flat_sizes_zero3(named, world)
    for k, group in enumerate(named):
        at, used = 0, {r: set() for r in range(world)}
        for name, shape in group:
            place = next(p for p in placed if p.name == name)
            numel, part = math.prod(shape), -(-math.prod(shape) // world)
            assert place.group == k and sum(p.numel for p in place.pieces) == numel
            for index, piece in enumerate(place.pieces):
                assert piece.rank == index and piece.start == at  # part r at the same offset of rank r's flat
                assert 0 < piece.numel <= part and piece.start + piece.numel <= sizes[k]
                elements = set(range(piece.start, piece.start + piece.numel))
                assert not used[piece.rank] & elements
                used[piece.rank] |= elements
            at += part
        assert at == sizes[k]
