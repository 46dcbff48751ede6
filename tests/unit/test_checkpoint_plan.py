"""The checkpoint plan (collgrad/checkpoint/plan.py) without any process group: across all ranks every
byte of every file written exactly once; each rank's reads exactly what it holds, a slice along
dimension 1 (a tensor-parallel shard) included; and those strided items moved through storage.py on
real files, against ``torch.narrow`` and the safetensors library."""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.checkpoint import commit, storage
from collgrad.checkpoint.match import io_costs
from collgrad.checkpoint.plan import (
    LOCAL_CALL_SECONDS,
    STATUS,
    WHOLE,
    Held,
    Holding,
    IoCosts,
    Ranges,
    SmallSlices,
    exchanged_reads,
    exchanged_writes,
    holdings,
    in_turn,
    in_whole,
    lay_out,
    read_items,
    shared_reads,
    small_slices,
    split_reads,
    turn_runs,
    write_items,
)
from collgrad.checkpoint.safetensors import Entry, Stored, parse_header, read_header
from collgrad.state.layout import LayoutGroup, ParamSlot, Partitioning, Split, StateLayout
from tests.groups import flat_group, sliced_group

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _flat_group(index: int, shapes: list[tuple[int, ...]], world: int) -> LayoutGroup:
    return flat_group(shapes, world, index, prefix=f"g{index}.")


def _replicated_group(index: int, shapes: list[tuple[int, ...]], world: int) -> LayoutGroup:
    slots = tuple(ParamSlot(f"g{index}.p{i}", s, math.prod(s), 0, math.prod(s)) for i, s in enumerate(shapes))
    return LayoutGroup(index, Partitioning.REPLICATED, tuple(range(world)), 0, torch.float32, torch.float32, slots)


def _sliced_group(index: int, shapes: list[tuple[int, ...]], world: int) -> LayoutGroup:
    group = sliced_group([math.prod(s) for s in shapes], world)
    slots = tuple(
        ParamSlot(f"g{index}.p{i}", s, p.numel, p.offset, p.slice_numel)
        for i, (s, p) in enumerate(zip(shapes, group.params))
    )
    return LayoutGroup(index, group.kind, group.group_ranks, group.partition_numel, torch.float32, torch.float32, slots)


GROUPS = {"flat": _flat_group, "sliced": _sliced_group, "replicated": _replicated_group}
shapes = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=6)


def _layout(kinds: list[str], shape_lists: list[list[tuple[int, ...]]], world: int) -> StateLayout:
    groups = tuple(GROUPS[k](i, s, world) for i, (k, s) in enumerate(zip(kinds, shape_lists)))
    return StateLayout("test", groups, tuple(p.name for g in groups for p in g.params))


def _entries(layout: StateLayout, buffers: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> list[Entry]:
    return [Entry(p.name, p.shape, dtype) for g in layout.groups for p in g.params] + [
        Entry(n, s, torch.float32) for n, s in buffers
    ]


def _bytes_written(files, items) -> dict[str, list[int]]:
    """How many times each byte of each file is written by ``items``."""
    counts = {file: [0] * shard.size for named in files.shards.values() for file, shard in named}
    for item in items:
        size = item.dtype.itemsize
        for first, _ in item.ranges.runs():
            at = item.offset + (first - item.ranges.start) * size
            for b in range(at, at + item.ranges.length * size):
                counts[item.file][b] += 1
    return counts


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(sorted(GROUPS)), shapes), min_size=1, max_size=3),
    st.integers(1, 4),
    st.lists(st.lists(st.integers(1, 5), max_size=2).map(tuple), max_size=3),
    st.sampled_from(DTYPES),
    st.integers(1, 400),
    st.booleans(),
)
def test_across_the_ranks_every_byte_of_every_file_is_written_once(groups, world, buffer_shapes, dtype, shard, by_file):
    layout = _layout([k for k, _ in groups], [s for _, s in groups], world)
    buffers = [(f"b{i}", s) for i, s in enumerate(buffer_shapes)]
    files = lay_out({"model": _entries(layout, buffers, dtype)}, shard)
    writers = [k % world for k in range(len(files.names()))] if by_file else None
    items = []
    for rank in range(world):
        held = holdings("model", 0, layout, [rank] * len(layout.groups), buffers)
        mine = write_items(files, held, rank, world, writers)
        assert all(item.held is None or item.held.source == 0 for item in mine)
        items += mine
    counts = _bytes_written(files, items)
    assert all(c == 1 for per_file in counts.values() for c in per_file), {f: set(c) for f, c in counts.items()}


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from(DTYPES),
    st.integers(1, 300),
    st.data(),
)
def test_tensor_parallel_slices_written_by_their_holders_every_byte_once(matrices, tp, dp, dtype, shard, data):
    """tp x dp ranks (the tensor-parallel rank inner, as AutoTP's): each matrix split along dimension 0 or
    1 (2: not split, held by every rank) in uneven slices over the tensor-parallel ranks, a slice held
    alike by the data-parallel ranks of its shard: across the ranks every byte of every file once."""
    entries, cuts = [], []
    for i, (rows, cols, dim) in enumerate(matrices):
        shape = (rows * tp, cols) if dim == 0 else (rows, cols * tp)
        entries.append(Entry(f"w{i}", shape, dtype))
        if dim < 2:
            inner = sorted(data.draw(st.lists(st.integers(0, shape[dim]), min_size=tp - 1, max_size=tp - 1)))
            cuts.append((dim, [0, *inner, shape[dim]]))
        else:
            cuts.append(None)
    files = lay_out({"model": entries}, shard)
    items = []
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        held = []
        for k, (entry, cut) in enumerate(zip(entries, cuts)):
            if cut is None:
                held.append(Holding("model", entry.name, Ranges(0, entry.numel), Held(0, WHOLE, k), True))
            elif cut[1][t] < cut[1][t + 1]:
                ranges = Ranges.slice(entry.shape, cut[0], cut[1][t], cut[1][t + 1])
                held.append(Holding("model", entry.name, ranges, Held(0, WHOLE, k), True, "shard"))
        items += write_items(files, held, rank, tp * dp, among={"shard": (d, dp)})
    counts = _bytes_written(files, items)
    assert all(c == 1 for per_file in counts.values() for c in per_file), {f: set(c) for f, c in counts.items()}


def _elements(ranges: Ranges) -> list[int]:
    """The tensor's elements ``ranges`` covers, in their order."""
    return [first + i for first, _ in ranges.runs() for i in range(ranges.length)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_a_slice_along_any_dimension_is_the_ranges_narrow_gives(shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    lo = data.draw(st.integers(0, shape[dim] - 1))
    hi = data.draw(st.integers(lo + 1, shape[dim]))
    ranges = Ranges.slice(shape, dim, lo, hi)
    expected = torch.arange(math.prod(shape)).reshape(shape).narrow(dim, lo, hi - lo).flatten().tolist()
    assert _elements(ranges) == expected and ranges.numel == len(expected)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_a_run_of_a_shards_elements_is_the_whole_tensors_elements_narrow_gives(whole, data):
    """A tensor-parallel shard (``narrow`` along any dimension) and a run of its flat elements (a ZeRO
    fragment of it): ``in_whole``'s pieces are those elements of the whole tensor, in order, each held
    where its first element is."""
    dim = data.draw(st.integers(0, len(whole) - 1))
    lo = data.draw(st.integers(0, whole[dim] - 1))
    hi = data.draw(st.integers(lo + 1, whole[dim]))
    shard = torch.arange(math.prod(whole)).reshape(whole).narrow(dim, lo, hi - lo).flatten().tolist()
    start = data.draw(st.integers(0, len(shard) - 1))
    length = data.draw(st.integers(1, len(shard) - start))
    holding = Holding("model", "w", Ranges(start, length), Held(0, 0, -1, 100))
    pieces = in_whole(holding, Split(dim, tuple(whole), lo, hi))
    assert [e for p in pieces for e in _elements(p.ranges)] == shard[start : start + length]
    offsets = [p.held.offset for p in pieces]
    assert offsets == [100 + sum(p.ranges.numel for p in pieces[:k]) for k in range(len(pieces))]
    assert len(pieces) <= 3 and all(
        p._replace(ranges=None, held=None) == holding._replace(ranges=None, held=None) for p in pieces
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(1, 8)), min_size=1, max_size=4),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from(DTYPES),
    st.integers(1, 300),
)
def test_each_ranks_reads_are_exactly_what_it_holds_tensor_parallel_shards_included(matrices, tp, dp, dtype, shard):
    """Tensor-parallel shards (columns: dimension 1) of each matrix, and a data-parallel ZeRO partition of
    a flat group: every rank's read items cover its holdings, each element once, at the file offset where
    the checkpoint's header places that element."""
    shapes_ = [(rows, cols * tp) for rows, cols in matrices]
    layout = _layout(["flat"], [[(5, 3), (7,)]], dp)
    entries = [Entry(f"w{i}", s, dtype) for i, s in enumerate(shapes_)] + _entries(layout, [], dtype)
    files = lay_out({"model": entries}, shard)
    stored = {
        ("model", e.name): Stored(place.file, e.dtype, e.shape, place.offset)
        for (_, _), place in files.placed.items()
        for e in [place.entry]
    }
    for t in range(tp):
        for d in range(dp):
            held = [
                Holding("model", f"w{i}", Ranges.slice(s, 1, t * s[1] // tp, (t + 1) * s[1] // tp), Held(1, -1, i))
                for i, s in enumerate(shapes_)
            ]
            held += holdings("model", 0, layout, [d])
            items = read_items(stored, held)
            assert [(i.tensor, i.ranges) for i in items] == [(h.tensor, h.ranges) for h in held]
            for item in items:
                found = stored[("model", item.tensor)]
                size = item.dtype.itemsize
                for first, _ in item.ranges.runs():  # where each run starts is where the header puts it
                    at = item.offset + (first - item.ranges.start) * size
                    assert (at - found.start) // size == first and (at - found.start) % size == 0
                elements = _elements(item.ranges)
                assert len(set(elements)) == len(elements) and max(elements) < math.prod(found.shape)


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_shards_written_and_read_back_through_storage(tmp_path, tp):
    """``tp`` holders of column shards write one file together (each its items, one of them the header),
    which the safetensors library reads whole; then each reads its own shard back through its items."""
    safetensors = pytest.importorskip("safetensors.torch")
    whole = {"w0": torch.randn(4, 3 * tp), "w1": torch.randn(2, 5 * tp).to(torch.bfloat16)}
    entries = [Entry(n, tuple(t.shape), t.dtype) for n, t in whole.items()]
    files = lay_out({"model": entries}, 10**6)
    headers = {file: shard.header for file, shard in files.shards["model"]}

    def shards(t: int) -> tuple[list[Holding], list[storage.Memory]]:
        held, local = [], []
        for k, (name, tensor) in enumerate(whole.items()):
            cols = tensor.shape[1] // tp
            held.append(Holding("model", name, Ranges.slice(tensor.shape, 1, t * cols, (t + 1) * cols), Held(k, -1, 0)))
            local.append(storage.Memory(whole=[tensor[:, t * cols : (t + 1) * cols].contiguous()]))
        return held, local

    writer = storage.Writer()
    for t in range(tp):
        held, memory = shards(t)
        items = write_items(files, held, t, tp)
        storage.write(writer, items, storage.in_memory(memory), headers, lambda f: os.path.join(tmp_path, f))
    writer.finish()
    assert writer.error is None
    path = os.path.join(tmp_path, "model.safetensors")
    loaded = safetensors.load_file(path)
    assert all(torch.equal(loaded[n], t) for n, t in whole.items())
    tensors, _ = read_header(path)
    stored = {("model", n): s for n, s in tensors.items()}
    for t in range(tp):
        held, memory = shards(t)
        into = [storage.Memory(whole=[torch.zeros_like(m.whole[0])]) for m in memory]
        items = read_items(stored, held)
        _, error = storage.read(storage.load_plan(into, lambda items=items: items))
        assert error is None
        assert all(torch.equal(a.whole[0], b.whole[0]) for a, b in zip(into, memory))


def test_a_temporary_is_no_file_a_loader_of_the_directory_reads(tmp_path):
    name = commit.temporary(str(tmp_path / "model-00001-of-00002.safetensors"))
    assert os.path.basename(name).startswith(".") and not name.endswith(".safetensors")


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(sorted(GROUPS)), shapes), min_size=1, max_size=3),
    st.integers(1, 5),
    st.sampled_from(DTYPES),
    st.integers(1, 400),
    st.integers(1, 300),
)
def test_what_the_ranks_hold_alike_is_read_once_between_them_and_each_ends_with_its_holdings(
    groups, world, dtype, shard, window
):
    """``shared_reads`` and ``in_turn``, no process group, as a ZeRO-1/2 load has them (the weights, which
    every rank holds whole, and its own partitions of the same tensors, from the same files): every byte
    of what the ranks hold alike is read by exactly one rank, about 1/world of them by each; a window's
    pieces (tensors cut at elements where a turn or a window ends) lie after their part's status, apart
    (every part as wide, on 8 bytes); and each rank ends with exactly its holdings: every own item
    either read by itself or taken from its part where its turn holds its bytes."""
    layout = _layout([k for k, _ in groups], [s for _, s in groups], world)
    params = [p for g in layout.groups for p in g.params]
    whole = LayoutGroup(
        0,
        Partitioning.REPLICATED,
        tuple(range(world)),
        0,
        dtype,
        dtype,
        tuple(ParamSlot(p.name, p.shape, p.numel, 0, p.numel) for p in params),
    )
    weights = StateLayout("weights", (whole,), layout.order)
    files = lay_out({"model": _entries(layout, [], dtype)}, shard)
    stored = {("model", n): s for n, s in _stored(files).items()}
    first = None
    read_bytes: dict[tuple[str, int], int] = {}
    for rank in range(world):
        alike = read_items(stored, holdings("model", 0, weights, [rank]))
        mine = holdings("model", 1, layout, [rank] * len(layout.groups))
        own = read_items(stored, [h for h in mine if not h.replica])
        windows = shared_reads(alike, world, window)
        first = windows if first is None else first
        assert windows == first  # the same windows on every rank
        # the pieces cover every tensor's bytes exactly once, cut at elements
        pieces = sorted((i.file, i.offset, i.ranges.numel * i.dtype.itemsize) for w in windows for i in w.items)
        assert {(f, b) for f, o, n in pieces for b in range(o, o + n)} == {
            (i.file, b) for i in alike for b in _bytes_of(i)
        } and sum(n for *_, n in pieces) == sum(len(_bytes_of(i)) for i in alike)
        turn = 0
        for w in windows:
            assert w.part_bytes % 8 == 0
            used = []
            for item, owner, start in zip(w.items, w.owner, w.at):  # after the status, no two overlap
                if owner == rank:
                    assert start >= STATUS and start + item.ranges.numel * item.dtype.itemsize <= w.part_bytes
                    used.append((start, start + item.ranges.numel * item.dtype.itemsize))
            used.sort()
            assert all(a[1] <= b[0] for a, b in zip(used, used[1:]))
            for file, offset, _, nbytes in turn_runs(w, rank):
                turn += nbytes
                for b in range(offset, offset + nbytes):
                    read_bytes[(file, b)] = read_bytes.get((file, b), 0) + 1
        total = sum(len(_bytes_of(i)) for i in alike)
        assert turn <= -(-total // world) + 8 * len(windows)  # its 1/world, give or take an element a window
        left, taken = in_turn(own, windows, rank)
        # each element of each own item once, into the same place: read, or taken from its part
        assert _placed_elements(left + [item for per in taken for item, _ in per]) == _placed_elements(own)
        assert all(c == 1 for c in _placed_elements(own).values())
        if len(windows) == 1 and all(i.ranges.rows == 1 for i in own):  # nothing of its turn read again
            turned = {(f, b) for f, o, _, n in turn_runs(windows[0], rank) for b in range(o, o + n)}
            assert not {(i.file, b) for i in left for b in _bytes_of(i)} & turned
        for w, per in zip(windows, taken):
            runs = turn_runs(w, rank)
            for item, at in per:  # its bytes are where its part holds them
                run = next(r for r in runs if r[0] == item.file and r[1] <= item.offset < r[1] + r[3])
                assert at == run[2] + item.offset - run[1]
                assert item.offset + item.ranges.numel * item.dtype.itemsize <= run[1] + run[3]
    expected = {(i.file, b) for w in first or () for i in w.items for b in _bytes_of(i)}
    assert set(read_bytes) == expected and all(c == 1 for c in read_bytes.values())


def _placed_elements(items) -> Counter:
    """Every element each item reads (kind, tensor, element) and where it goes (source, group, param, and
    its place there where the item is one run), counted."""
    out: Counter = Counter()
    for i in items:
        for first, _ in i.ranges.runs():
            for e in range(first, first + i.ranges.length):
                place = i.held.offset + e - i.ranges.start if i.ranges.rows == 1 else None
                out[(i.kind, i.tensor, e, i.held.source, i.held.group, i.held.param, place)] += 1
    return out


def _bytes_of(item) -> range:
    return range(item.offset, item.offset + item.ranges.numel * item.dtype.itemsize)


def _stored(files) -> dict[str, Stored]:
    """Every tensor's place as a load reads it from ``files``' headers (no file: parse_header)."""
    out: dict[str, Stored] = {}
    for named in files.shards.values():
        for file, shard in named:
            out.update(parse_header(file, shard.header[8:], shard.size)[0])
    return out


def test_a_zero2_ranks_partition_in_its_turn_is_taken_from_its_part_not_read_again():
    """Two ranks, four tensors of 8 fp32 elements in one file: each rank's turn of the weights is two
    tensors, which its flat partition holds: both come from its part, nothing is read twice."""
    group = _flat_group(0, [(8,)] * 4, 2)
    layout = StateLayout("zero2", (group,), tuple(p.name for p in group.params))
    whole = LayoutGroup(
        0,
        Partitioning.REPLICATED,
        (0, 1),
        0,
        torch.float32,
        torch.float32,
        tuple(ParamSlot(p.name, p.shape, p.numel, 0, p.numel) for p in group.params),
    )
    files = lay_out({"model": _entries(layout, [], torch.float32)}, 10**6)
    stored = {("model", n): s for n, s in _stored(files).items()}
    for rank in range(2):
        alike = read_items(stored, holdings("model", 0, StateLayout("w", (whole,), layout.order), [rank]))
        own = read_items(stored, holdings("model", 1, layout, [rank]))
        windows = shared_reads(alike, 2)
        left, taken = in_turn(own, windows, rank)
        assert left == [] and [item.tensor for item, _ in taken[0]] == [f"g0.p{2 * rank}", f"g0.p{2 * rank + 1}"]


#: An exchange's cases: groups (sliced or flat) of tensors of a few elements, the world, the dtype, the
#: shard size, the window's bytes and the threshold below which a slice is small.
EXCHANGED = (
    st.lists(st.tuples(st.sampled_from(["sliced", "flat"]), shapes), min_size=1, max_size=3),
    st.integers(2, 5),
    st.sampled_from(DTYPES),
    st.integers(1, 400),
    st.integers(1, 200),
    st.integers(0, 80),
)


def _below(threshold: int) -> IoCosts:
    """Costs under which a slice of fewer than ``threshold`` bytes is small (``IoCosts.small_below``)."""
    return IoCosts(call_seconds=float(threshold), network_bytes_per_second=1.0, piece_seconds=0.0)


def _segmented(lengths, values: list[bytes]) -> bytes:
    """What a rank sends in an exchange: per destination, its status (``STATUS`` zero bytes) and then the
    values of its items for that destination (``values``, in order, filling each segment in turn)."""
    out, values = b"", list(values)
    for n in lengths:
        segment = bytes(STATUS)
        while len(segment) < n:
            segment += values.pop(0)
        assert len(segment) == n
        out += segment
    assert not values
    return out


def _values(name: str, lo: int, n: int, dtype: torch.dtype) -> bytes:
    """Elements ``[lo, lo + n)`` of the tensor ``name`` (its elements numbered from a number of its name),
    as ``dtype``'s bytes."""
    base = sum(map(ord, name)) * 64
    return torch.arange(base + lo, base + lo + n, dtype=torch.float64).to(dtype).view(torch.uint8).numpy().tobytes()


@settings(max_examples=80, deadline=None)
@given(*EXCHANGED)
def test_small_pieces_exchanged_every_byte_written_once_with_its_holders_values(
    groups, world, dtype, shard, window, threshold
):
    """``exchanged_writes``, no process group: the tensors whose slices are small are moved to the ranks
    that write them (an all-to-all emulated here: what rank s sends rank d is the ``sent[d]`` bytes of
    its sends from their start), then written as runs: over all ranks every byte of every file written
    exactly once, each with the value its holder holds; every run a contiguous range of one file."""
    layout = _layout([k for k, _ in groups], [s for _, s in groups], world)
    files = lay_out({"model": _entries(layout, [], dtype)}, shard)
    small = small_slices([("model", layout)], files.placed, _below(threshold), world)
    assert set(small.keys) == {
        ("model", p.name)
        for g in layout.groups
        if g.kind is Partitioning.SLICED
        for p in g.params
        if p.slice_numel * dtype.itemsize < threshold
    }
    planned = []
    for rank in range(world):
        held = holdings("model", 0, layout, [rank] * len(layout.groups))
        planned.append(exchanged_writes(files, write_items(files, held, rank, world), small, rank, world, window))
    written = {file: bytearray(shard.size) for named in files.shards.values() for file, shard in named}
    counts = {file: [0] * shard.size for named in files.shards.values() for file, shard in named}

    def put(file: str, offset: int, data: bytes) -> None:
        written[file][offset : offset + len(data)] = data
        for b in range(offset, offset + len(data)):
            counts[file][b] += 1

    for direct, _ in planned:
        for item in direct:
            if item.held is None:
                put(item.file, 0, files.headers()[item.file])
            else:
                assert (item.kind, item.tensor) not in small.keys
                put(item.file, item.offset, _values(item.tensor, item.ranges.start, item.ranges.numel, dtype))
    for w in range(len(planned[0][1])):
        windows = [exchanges[w] for _, exchanges in planned]
        sent = [
            _segmented(ex.sent, [_values(i.tensor, i.ranges.start, i.ranges.numel, dtype) for i in ex.sends])
            for ex in windows
        ]
        for d, ex in enumerate(windows):
            got = b""
            for s, other in enumerate(windows):
                start = sum(other.sent[:d])
                got += sent[s][start : start + other.sent[d]]
            assert len(got) == sum(ex.received)
            runs = bytearray(sum(n for *_, n in ex.runs))
            for src, dst, n in ex.moves:
                runs[dst : dst + n] = got[src : src + n]
            at = 0
            for file, file_size, offset, n in ex.runs:
                assert file_size == len(written[file]) and offset + n <= file_size
                put(file, offset, bytes(runs[at : at + n]))
                at += n
    assert all(c == 1 for per_file in counts.values() for c in per_file), {f: set(c) for f, c in counts.items()}
    for file, data in written.items():  # every tensor's bytes are its values
        for (_, name), place in files.placed.items():
            if place.file == file:
                expected = _values(name, 0, place.entry.numel, dtype)
                assert bytes(data[place.offset : place.offset + len(expected)]) == expected, name


@settings(max_examples=80, deadline=None)
@given(*EXCHANGED)
def test_small_pieces_read_by_one_rank_each_reach_exactly_their_holders(groups, world, dtype, shard, window, threshold):
    """``exchanged_reads``, no process group: the tensors whose slices are small are read whole by one rank
    each (runs of the files) and their slices sent to their holders (an all-to-all emulated here), for
    two kinds read from the same tensors (a load's weights and masters): each rank ends with exactly
    its holdings, every item either read where it lies or taken once, with the file's values; every
    byte of those tensors read by exactly one rank, once."""
    layout = _layout([k for k, _ in groups], [s for _, s in groups], world)
    files = lay_out({"model": _entries(layout, [], dtype)}, shard)
    stored = {(kind, n): s for n, s in _stored(files).items() for kind in ("model", "fp32")}
    content = {f: bytearray(shard.size) for named in files.shards.values() for f, shard in named}
    for (_, name), place in files.placed.items():
        data = _values(name, 0, place.entry.numel, dtype)
        content[place.file][place.offset : place.offset + len(data)] = data
    small = small_slices([("model", layout), ("fp32", layout)], stored, _below(threshold), world)
    own, planned = [], []
    for rank in range(world):
        ranks = [rank] * len(layout.groups)
        items = read_items(stored, holdings("model", 0, layout, ranks) + holdings("fp32", 1, layout, ranks))
        own.append(items)
        planned.append(exchanged_reads(items, small, rank, world, window))
    read_count: dict[tuple[str, int], int] = {}
    taken: list[list] = [[] for _ in range(world)]
    for w in range(len(planned[0][1])):
        windows = [exchanges[w] for _, exchanges in planned]
        sent = []
        for ex in windows:
            buffer = b""
            for file, offset, n in ex.runs:
                buffer += bytes(content[file][offset : offset + n])
                for b in range(offset, offset + n):
                    read_count[(file, b)] = read_count.get((file, b), 0) + 1
            out = bytearray(sum(ex.sent))
            for src, dst, n in ex.moves:
                out[dst : dst + n] = buffer[src : src + n]
            # each byte read sent once (to its one holder), however many kinds take it
            assert len(out) == world * STATUS + len(buffer)
            sent.append(bytes(out))
        for d, ex in enumerate(windows):
            got = b"".join(sent[s][sum(o.sent[:d]) : sum(o.sent[:d]) + o.sent[d]] for s, o in enumerate(windows))
            assert len(got) == sum(ex.received)
            for item, at in ex.takes:
                n = item.ranges.numel * dtype.itemsize
                assert got[at : at + n] == _values(item.tensor, item.ranges.start, item.ranges.numel, dtype)
                taken[d].append(item)
    for rank, (direct, _) in enumerate(planned):
        assert sorted(direct + taken[rank]) == sorted(own[rank])  # exactly its holdings, each once
        assert not any((i.kind, i.tensor) in small.keys for i in direct)
    expected = {(s.file, b) for t, s in stored.items() if t in small.keys for b in range(s.start, s.start + s.nbytes)}
    assert set(read_count) == expected and all(c == 1 for c in read_count.values())


def test_a_tensor_a_rank_reads_whole_anyway_is_not_exchanged_for_its_slices():
    """ZeRO-3's persistent parameters: every rank holds the weights whole and their fp32 masters as slices
    (a few bytes: small). The slices come from the rank's own read of the whole tensor, nothing is
    exchanged; a tensor held only as slices still is."""
    world, shapes = 2, [(4,), (6,)]
    sliced = _sliced_group(0, shapes, world)
    masters = StateLayout("fp32", (sliced,), tuple(p.name for p in sliced.params))
    weights = StateLayout("w", (_replicated_group(0, shapes[:1], world),), ("g0.p0",))
    files = lay_out({"model": _entries(masters, [], torch.float32)}, 10**6)
    stored = {(kind, n): s for n, s in _stored(files).items() for kind in ("model", "fp32")}
    small = small_slices([("fp32", masters)], stored, IoCosts(), world)  # every slice: a few bytes
    assert small.keys == [("fp32", p.name) for p in sliced.params]
    for rank in range(world):
        held = holdings("model", 0, weights, [rank]) + holdings("fp32", 1, masters, [rank])
        split = split_reads(stored, held, rank, world, False, 0, small)
        exchanged = {(i.kind, i.tensor) for w in split.exchanged for i, _ in w.takes}
        assert {(i.kind, i.tensor) for i in split.own} >= {("model", "g0.p0"), ("fp32", "g0.p0")}
        assert exchanged == {("fp32", "g0.p1")}, (rank, exchanged)
        assert [r[0] for w in split.exchanged for r in w.runs] in ([], [files.placed[("model", "g0.p1")].file])


@pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="Linux's mount table")
def test_the_costs_of_a_directory_follow_its_file_system(tmp_path, monkeypatch):
    """``io_costs``: a directory on a file system of this machine weighs a local call, no dearer than an
    exchange's handling of a piece (nothing exchanged); one elsewhere (``/proc`` stands in: no list
    names it) or none (the simulation) a network's (slices below ~1 MB exchanged); the environment
    wins. The type is the mount table's, as findmnt tells."""
    import shutil
    import subprocess

    for name in ("COLLGRAD_IO_CALL_SECONDS", "COLLGRAD_NETWORK_BYTES_PER_SECOND"):
        monkeypatch.delenv(name, raising=False)
    kind = storage.file_system(str(tmp_path))
    if shutil.which("findmnt"):
        told = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(tmp_path)], capture_output=True, text=True)
        assert kind == told.stdout.strip()
    assert storage.file_system(str(tmp_path / "not" / "there yet")) == kind
    assert storage.file_system("/proc/self") == "proc"
    local = kind in storage.LOCAL_FILE_SYSTEMS
    assert io_costs(str(tmp_path)).call_seconds == (LOCAL_CALL_SECONDS if local else IoCosts().call_seconds)
    assert io_costs(str(tmp_path)).small_below == (0 if local else io_costs().small_below)
    assert io_costs("/proc").small_below == io_costs().small_below == 995_000
    monkeypatch.setenv("COLLGRAD_IO_CALL_SECONDS", "0.002")
    assert io_costs(str(tmp_path)).small_below == 1_995_000


def test_a_planner_runs_with_the_collector_paused_and_leaves_it_as_it_was():
    """``uncollected``: the cyclic collector paused inside a planner (and inside one it calls), running again
    after it returns or raises; left paused where the program paused it."""
    import gc

    from collgrad._compat import uncollected

    seen: list[bool] = []

    @uncollected
    def inner() -> None:
        seen.append(gc.isenabled())

    @uncollected
    def outer(fail: bool) -> None:
        inner()
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("refused")

    assert gc.isenabled()
    outer(False)
    with pytest.raises(ValueError):
        outer(True)
    assert seen == [False] * 4 and gc.isenabled()
    gc.disable()
    try:
        outer(False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_tensor_of_no_elements_where_the_next_one_starts_leaves_its_bytes_exchanged():
    """A tensor of no elements lies where the next one starts; given the same slice (as a kind sliced
    otherwise could give it), it must not stand for that place: the next tensor's slices are all
    written, each byte once, by the ranks whose turn they are."""
    world = 2
    layout = _layout(["sliced"], [[(0,), (8,), (3,)]], world)
    files = lay_out({"model": _entries(layout, [], torch.float32)}, 1 << 20)
    places = [(files.placed[("model", p.name)], p) for p in layout.groups[0].params]
    small = SmallSlices(  # the empty one given 4 elements a rank
        *map(list, zip(*((("model", p.name), at.file, at.offset, p.slice_numel or 4, 4, p.numel) for at, p in places)))
    )
    counts = {file: [0] * shard.size for named in files.shards.values() for file, shard in named}
    for rank in range(world):
        items = write_items(files, holdings("model", 0, layout, [rank]), rank, world)
        direct, windows = exchanged_writes(files, items, small, rank, world)
        for file, _, offset, n in (run for window in windows for run in window.runs):
            for b in range(offset, offset + n):
                counts[file][b] += 1
        for item in direct:  # the headers
            assert item.held is None
            for b in range(item.ranges.numel):
                counts[item.file][b] += 1
    assert all(c == 1 for per_file in counts.values() for c in per_file)
