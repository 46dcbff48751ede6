"""The steps of a gradient plan without any process group: views cover the gathered buffer, every element
lands exactly once, chunks cover the span in order, runs are equal-sized and contiguous, copy plans
place each fragment where the reduce step says, and the plan cache stays within its bound."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.cache import MAX_SHAPES, PlanCache
from collgrad.state.layout import Fragment, LayoutGroup, ParamSlot, Partitioning, gathered_runs, owned_fragments
from collgrad.state.plan import GradCall
from collgrad.state.steps import (
    MIN_CHUNK_BYTES,
    PIPELINE_CHUNKS,
    Sent,
    chunk_slots,
    copy_plan,
    flat_chunks,
    flat_views,
    reduce_step,
    sent_pieces,
    slices_step,
    view_runs,
)
from tests.groups import sliced_group


def _flat(sizes: list[int], world: int) -> LayoutGroup:
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        slots.append(ParamSlot(f"p{i}", (n,), n, offset, n))
        offset += n
    partition = max(1, -(-offset // world))
    return LayoutGroup(
        0, Partitioning.PARTITIONED_FLAT, tuple(range(world)), partition, torch.float32, torch.float32, tuple(slots)
    )


def _batch(n: int, data: st.DataObject) -> tuple[int, ...]:
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    return tuple(range(lo, hi))


sizes = st.lists(st.integers(0, 60), min_size=1, max_size=12)
worlds = st.integers(1, 4)


@settings(max_examples=150, deadline=None)
@given(sizes, worlds, st.data())
def test_reduce_step_fills_every_element_once(sizes, world, data):
    group = _flat(sizes, world) if data.draw(st.booleans()) else sliced_group(sizes, world)
    batch = _batch(len(sizes), data)
    starts, at = {}, 0
    for k in batch:
        starts[k] = at
        at += group.params[k].numel
    filled = Counter()
    every_rank = Counter()
    for rank in range(world):
        step = reduce_step(group, batch, rank)
        assert step.total == at
        mine = Counter()
        for f, dst in step.mine:
            assert dst == starts[f.param] + f.param_offset  # where the parameter's element goes
            mine.update(range(dst, dst + f.numel))
        for lo, n in step.gaps:
            mine.update(range(lo, lo + n))
        assert all(v == 1 for v in mine.values()) and set(mine) == set(range(at))  # fragments + gaps tile it
        every_rank.update(e for f, dst in step.mine for e in range(dst, dst + f.numel))
        filled.update(mine)
    assert set(every_rank) == set(range(at)) and all(v == 1 for v in every_rank.values())  # each element once


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=20), st.data())
def test_copy_plan_places_each_fragment_where_the_step_says(frags, data):
    # fragments of a few repeated sizes, lying with gaps in the span, going to distinct bucket places
    mine, spans, src, dst = [], [], 0, 0
    for k, (numel, gap, kind) in enumerate(frags):
        src += gap
        mine.append((Fragment(k, 0, src, numel), dst))
        spans.append(None if kind == 0 and data.draw(st.booleans()) else src)
        src += numel
        dst += numel + data.draw(st.sampled_from([0, 0, 2]))
    if data.draw(st.booleans()):  # back to front, as DeepSpeed's ZeRO-1/2 fragments lie
        top = dst
        mine = [(f, top - at - f.numel) for f, at in mine]
    plan = copy_plan(mine, spans)
    placed = Counter()
    wanted = {f.param: (span, at) for (f, at), span in zip(mine, spans)}
    for run in plan.runs:
        assert run.count > 1 and abs(run.dst_stride) >= run.numel and run.src_stride >= run.numel
        for i in range(run.count):
            hits = [k for k, (span, at) in wanted.items() if span == run.src + i * run.src_stride]
            assert hits, "a row that is no fragment"
            k = hits[0]
            assert wanted[k][1] == run.dst + i * run.dst_stride
            placed[k] += 1
    for f, at in plan.single:
        assert wanted[f.param][1] == at
        placed[f.param] += 1
    assert placed == Counter({f.param: 1 for f, _ in mine})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 2000), min_size=1, max_size=12), worlds, st.data())
def test_slices_step_chunks_cover_the_span_and_runs_are_equal_and_contiguous(sizes, world, data):
    group = sliced_group(sizes, world)
    batch = _batch(len(sizes), data)
    element = data.draw(st.sampled_from([1, 2, 4, 1 << 18]))  # large elements: several chunks
    step = slices_step(group, batch, element)
    slots = [group.params[k] for k in batch]
    assert step.lo == slots[0].offset and step.span == sum(s.slice_numel for s in slots)
    assert sum(step.gathered) == world * step.span
    assert 1 <= len(step.chunks) <= PIPELINE_CHUNKS
    if step.span * element < 2 * MIN_CHUNK_BYTES:
        assert len(step.chunks) == 1  # small steps stay one collective
    at = 0
    for chunk in step.chunks:  # back to back, in order, at parameter edges; its runs cover it once
        assert chunk.lo == at and chunk.span > 0
        assert _covered(chunk.runs) == set(range(chunk.lo, chunk.lo + chunk.span))
        at += chunk.span
    assert at == step.span
    assert _covered(step.strided) == set(range(step.span))
    starts = [sum(step.gathered[:k]) for k in range(len(slots))]
    assert all(gathered >= slot.numel for slot, gathered in zip(slots, step.gathered))
    assert _view_starts(step.views, len(slots)) == [(at, s.shape) for at, s in zip(starts, slots)]


def _view_starts(runs, count: int) -> list:
    """Where each position's view starts and its shape, from view runs; each position at most once."""
    out: list = [None] * count
    for run in runs:
        for i, k in enumerate(run.positions):
            assert out[k] is None
            out[k] = (run.start + i * run.stride, run.shape)
    return out


def test_view_runs_group_equal_shapes_at_a_constant_distance():
    items = [(0, (4, 4)), (16, (4,)), (20, (4, 4)), (36, (4,)), (40, (4, 4)), None, (60, (2, 8))]
    runs = view_runs(items)
    assert _view_starts(runs, len(items)) == items
    assert len(runs) == 3  # the three 4x4 at 20 apart, the two 4-vectors, the 2x8
    empty = [(0, (0,)), (0, (0,)), (0, (3,))]  # two empty parameters of one shape at one place
    assert _view_starts(view_runs(empty), 3) == empty


def _covered(runs) -> set[int]:
    """The elements ``runs`` (strided runs of equal slices) cover, each checked to be covered once."""
    covered = Counter()
    for run in runs:
        assert run.count >= 1 and (run.count == 1 or run.stride >= run.numel)
        for i in range(run.count):
            covered.update(range(run.start + i * run.stride, run.start + i * run.stride + run.numel))
    assert all(v == 1 for v in covered.values())
    return set(covered)


@settings(deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 5))
def test_chunks_cover_the_slots_in_order(sizes, count):
    group = sliced_group([max(1, n) for n in sizes], 2)
    slots = list(group.params)
    chunks = chunk_slots(slots, 0, count)
    assert [j for _, _, members in chunks for j in members] == list(range(len(slots)))
    assert sum(span for _, span, _ in chunks) == group.partition_numel


def test_a_mixed_model_s_slices_go_in_a_few_strided_runs():
    # four layers of (weight 8, bias 2, norm 2): three runs across the layers, not one per slice
    group = sliced_group([16, 4, 4] * 4, 2)
    step = slices_step(group, tuple(range(12)), 4)
    assert len(step.strided) == 3 and {r.count for r in step.strided} == {4}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.data())
def test_sent_pieces_put_the_main_run_first_then_the_rest_in_order(numels, data):
    starts = [sum(numels[:k]) for k in range(len(numels))]
    run = tuple(data.draw(st.permutations(range(len(numels))))[: data.draw(st.integers(0, len(numels)))])
    sent = sent_pieces(starts, numels, run)
    assert isinstance(sent, Sent) and sent.head == sum(numels[k] for k in run)
    assert [p[0] for p in sent.pieces] == starts and [p[2] for p in sent.pieces] == numels
    at = 0
    for k in run:  # the run, in its order
        assert sent.pieces[k][1] == at
        at += numels[k]
    for k in range(len(numels)):  # then the others, in the partition's order
        if k not in run:
            assert sent.pieces[k][1] == at
            at += numels[k]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 500), st.integers(0, 600), st.integers(1, 200), st.integers(0, 100))
def test_flat_chunks_cover_the_partition_and_keep_the_head_apart_unless_a_collective_is_saved(
    partition, head, capacity, budget
):
    chunks = flat_chunks(partition, head, capacity, budget)
    head = min(head, partition)
    assert chunks[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
    assert sum(n for _, n in chunks) == partition and all(0 < n <= capacity for _, n in chunks)
    apart = -(-head // capacity) + -(-(partition - head) // capacity)
    if any(lo < head < lo + n for lo, n in chunks):  # one chunk holds the head's end: fewer collectives
        assert len(chunks) == -(-partition // capacity) < apart
        first_copied = next(lo for lo, n in chunks if lo + n > head)
        assert partition - first_copied <= partition - head + budget
    else:
        assert len(chunks) == apart


def test_the_default_bench_partition_goes_in_two_collectives_not_three():
    # ZeRO-2, 2 ranks, a 25 MiB bucket: the partition just over a bucket, 2277 elements not in the head
    partition, capacity = 3_294_372, 25 * 2**20 // (2 * 4)
    chunks = flat_chunks(partition, 3_292_095, capacity, (1 << 20) // 4)
    assert chunks == ((0, capacity), (capacity, partition - capacity))
    assert flat_chunks(partition, 3_292_095, capacity) == ((0, capacity), (capacity, 15_295), (3_292_095, 2_277))


@settings(max_examples=150, deadline=None)
@given(sizes, st.integers(2, 4), st.data())
def test_flat_views_give_each_parameter_lying_in_one_run_its_place_and_shape(sizes, world, data):
    group = _flat([max(1, n) for n in sizes], world)
    placements = []
    for _ in range(world):  # each rank's partition as one piece, or two pieces sent back to front
        p = group.partition_numel
        if p > 1 and data.draw(st.booleans()):
            cut = data.draw(st.integers(1, p - 1))
            placements.append(list(sent_pieces([0, cut], [cut, p - cut], (1, 0)).pieces))
        else:
            placements.append(list(sent_pieces([0], [p], (0,)).pieces))
    where = gathered_runs(group, placements)
    batch = _batch(len(group.params), data)
    shapes = [p.shape for p in group.params]
    numel = world * group.partition_numel
    for k in range(len(group.params)):  # every element of every parameter once, within the buffer
        assert sum(n for _, n in where[k]) == group.params[k].numel
        assert all(0 <= at and at + n <= numel for at, n in where[k])
        held = sum(f.numel for r in range(world) for f in owned_fragments(group, r) if f.param == k)
        assert held == group.params[k].numel
    got = _view_starts(flat_views(where, batch, shapes), len(batch))
    assert got == [(where[k][0][0], shapes[k]) if len(where[k]) == 1 else None for k in batch]


def test_the_plan_cache_keeps_at_most_its_bound_of_call_shapes():
    cache = PlanCache()
    first = cache.shape(GradCall("auto", 1, False), None)
    assert cache.shape(GradCall("auto", 1, False), None) is first
    for cap in range(2, 2 + 3 * MAX_SHAPES):  # a caller sweeping bucket_bytes
        cache.shape(GradCall("auto", cap, False), None)
        assert cache.shapes <= MAX_SHAPES
    assert cache.shape(GradCall("auto", 1, False), None) is not first  # dropped, rebuilt on a miss


def test_what_a_rank_tells_of_its_pieces_in_the_readiness_check():
    from collgrad.core.buffers import Pieces
    from collgrad.state.cache import Placements
    from collgrad.state.layout import StateLayout
    from collgrad.state.placements import CHANGED, piece_count, placed, placement_print

    group = _flat([3, 5], 2)
    layout = StateLayout("test", (group,), ("p0", "p1"))
    storage = torch.zeros(group.partition_numel)
    buffer = Pieces([storage[2:], storage[:2]])  # two pieces lying back to front in one storage
    plans = PlanCache()
    assert piece_count(layout, [buffer]) == 2
    assert placed(buffer) == Sent(4, ((0, 2, 2), (2, 0, 2)))  # tiled: sent as they lie, one run
    assert placement_print(layout, plans, [buffer]) == CHANGED  # nothing cached: exchange
    plans.placements[group.index] = Placements(placed(buffer), [], 4)
    told = placement_print(layout, plans, [buffer])
    assert told != CHANGED and told == placement_print(layout, plans, [buffer])
    plans.placements[group.index] = Placements(Sent(4, ((0, 0, 4),)), [], 4)  # cached for pieces that lay elsewhere
    assert placement_print(layout, plans, [buffer]) == CHANGED
