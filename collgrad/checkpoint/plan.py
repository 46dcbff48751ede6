"""The plan of a save or a load, as data: which byte ranges of which file this rank writes or reads,
and where in its memory they come from or go, before any byte moves. Pure: no process group, no file,
no tensor's memory (items name memory by index: ``Held``; storage.py resolves them when bytes move).

    layout (state/layout.py) + this rank's index in each group     headers (safetensors.py)
        |                                                               |
    holdings(): what this rank holds, per tensor, as element Ranges  Files: every tensor's place
        \\_____________________________   _____________________________/
                                      \\ /
              write_items(): WriteItem (file, byte offset, dtype, kind, tensor, ranges, held)
              read_items():  ReadItem  (the same fields, read into ``held``)

A tensor's elements are addressed row-major, flat. ``Ranges`` is a strided set of runs of them: a
ZeRO partition's fragment is one run; a slice along another dimension than 0 (a tensor-parallel
shard, columns [lo, hi) of every row) is ``rows`` runs ``stride`` elements apart:

    tensor 4 x 6, columns [2, 4) (dim 1):      . . x x . .      Ranges(start=2, length=2,
                                               . . x x . .             rows=4, stride=6)
                                               . . x x . .
                                               . . x x . .

Across the ranks of a group every byte of every file is written exactly once (fragments by their
holder; what every rank holds whole, ``replica``, by one rank in turn, as ``turns`` gives them; each
header by one rank); each rank's reads cover exactly what it holds. tests/unit/test_checkpoint_plan.py
shows both with hypothesis, no process group. A later step that moves small pieces between ranks
before they reach the disk is one more item kind between holdings and writes.
"""

from __future__ import annotations

import array
import bisect
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, NamedTuple, Sequence, TypeVar

import torch

from collgrad._compat import maker, uncollected
from collgrad.checkpoint.safetensors import Entry, Shard, Stored, cut_shards, shard_name
from collgrad.state.layout import LayoutGroup, Partitioning, Split, StateLayout, owned_fragments

__all__ = [
    "Ranges",
    "Held",
    "WHOLE",
    "SETTER",
    "Holding",
    "EVERY_RANK",
    "holdings",
    "in_whole",
    "Placed",
    "Files",
    "lay_out",
    "WriteItem",
    "write_items",
    "ReadItem",
    "read_items",
    "turns",
    "SharedRead",
    "STATUS",
    "WINDOW_BYTES",
    "Turns",
    "shared_reads",
    "turn_runs",
    "in_turn",
    "SplitReads",
    "split_reads",
    "Exchange",
    "IoCosts",
    "LOCAL_CALL_SECONDS",
    "EXCHANGE_RANK_BYTES",
    "exchanged_writes",
    "ReadExchange",
    "exchanged_reads",
    "SmallSlices",
    "small_slices",
]


class Ranges(NamedTuple):
    """Elements of a tensor (flat, row-major): ``rows`` runs of ``length`` elements, the first from
    ``start``, each next ``stride`` elements after the one before (``rows`` 1: one run)."""

    start: int
    length: int
    rows: int = 1
    stride: int = 0

    @property
    def numel(self) -> int:
        return self.length * self.rows

    def runs(self) -> Iterator[tuple[int, int]]:
        """Each run as (its first element in the tensor, its first among these ranges' elements)."""
        for k in range(self.rows):
            yield self.start + k * self.stride, k * self.length

    @staticmethod
    def slice(shape: Sequence[int], dim: int, lo: int, hi: int) -> Ranges:
        """Indexes ``[lo, hi)`` along dimension ``dim`` of a tensor of ``shape`` (``tensor.narrow``)."""
        inner, outer = math.prod(shape[dim + 1 :]), math.prod(shape[:dim])
        if hi - lo == shape[dim]:  # every index of ``dim``: the whole tensor
            return Ranges(0, outer * shape[dim] * inner)
        if outer == 1:  # dimension 0, or only ones before it: one run
            return Ranges(lo * inner, (hi - lo) * inner)
        return Ranges(lo * inner, (hi - lo) * inner, outer, shape[dim] * inner)


#: ``Held.group`` of a tensor held whole outside the layout's groups (persistent buffers, ZeRO-3's
#: persistent parameters): the ``param``-th of the source's whole tensors.
WHOLE = -1
#: ``Held.group`` of a parameter this rank reaches only through the source's setter (DeepSpeed's
#: accessors, for a layout collgrad does not read): the ``param``-th of the layout's parameters, whole.
SETTER = -2


class Held(NamedTuple):
    """Where this rank keeps elements, by index, no memory: source ``source``'s layout group ``group``,
    at element ``offset`` of its flat local buffer (``param`` -1: a fragment of a partition) or of its
    ``param``-th tensor, held whole (a replicated group; ``group`` WHOLE: the source's whole tensors)."""

    source: int
    group: int
    param: int
    offset: int = 0


#: ``Holding.among`` of what every rank of the group holds alike.
EVERY_RANK = ""


class Holding(NamedTuple):
    """Elements ``ranges`` of tensor ``tensor`` of kind ``kind`` (a file stem: ``model``, ``fp32``,
    ``optimizer-0``), kept at ``held``; ``replica``: the ranks of the set ``among`` (EVERY_RANK: all of
    the group; another name: a set ``write_items`` is told of, such as the ranks that hold one
    tensor-parallel shard) hold them alike (one of them writes)."""

    kind: str
    tensor: str
    ranges: Ranges
    held: Held
    replica: bool = False
    among: str = EVERY_RANK


@uncollected
def holdings(
    kind: str,
    source: int,
    layout: StateLayout,
    ranks: Sequence[int],
    whole: Sequence[tuple[str, tuple[int, ...]]] = (),
    setter: bool = False,
) -> list[Holding]:
    """What this rank holds of ``layout`` (its index in group g: ``ranks[g]``): its fragments of every
    partitioned tensor, every tensor of a replicated group whole (``setter``: every parameter whole,
    through the source's setter); then ``whole`` (name, shape), held whole outside the layout. Pure."""
    out: list[Holding] = []
    if setter:
        slots = [slot for group in layout.groups for slot in group.params]
        out.extend(Holding(kind, s.name, Ranges(0, s.numel), Held(source, SETTER, k)) for k, s in enumerate(slots))
    else:
        for group, rank in zip(layout.groups, ranks):
            out.extend(_group_holdings(kind, source, group, rank))
    for k, (name, shape) in enumerate(whole):
        out.append(Holding(kind, name, Ranges(0, math.prod(shape)), Held(source, WHOLE, k), replica=True))
    return out


_ranges, _held, _holding = maker(Ranges), maker(Held), maker(Holding)


def _group_holdings(kind: str, source: int, group: LayoutGroup, rank: int) -> list[Holding]:
    params, index = group.params, group.index
    if group.kind is Partitioning.REPLICATED:
        return [
            Holding(kind, slot.name, Ranges(0, slot.numel), Held(source, index, k), replica=True)
            for k, slot in enumerate(params)
        ]
    return [  # made in C (maker): a tensor a kind, 160,000 a 3.9B-parameter training state's
        _holding(
            (kind, params[param].name, _ranges((at, numel, 1, 0)), _held((source, index, -1, local)), False, EVERY_RANK)
        )
        for param, at, local, numel in owned_fragments(group, rank)
        if numel
    ]


def in_whole(holding: Holding, split: Split) -> list[Holding]:
    """``holding`` of a tensor-parallel shard (its ranges: one run of the shard's own elements, flat) as
    elements of the whole tensor the shard is ``split`` of: the run cut where it crosses a block of the
    dimensions before the split's (each block of the shard is ``hi - lo`` indexes of the split's
    dimension, a run of the whole tensor ``whole[dim] * inner`` elements after the last): a partial
    block, the whole blocks as one strided ``Ranges``, a partial block. Each piece held where its first
    element is (``held.offset`` moved on by the elements before it). Pure."""
    ranges = holding.ranges
    assert ranges.rows == 1, "a holding of a shard's own elements is one run"
    inner = math.prod(split.whole[split.dim + 1 :])
    block, stride = (split.hi - split.lo) * inner, split.whole[split.dim] * inner
    out: list[Holding] = []
    at, end = ranges.start, ranges.start + ranges.length
    while at < end:
        row, within = divmod(at, block)
        if within == 0 and end - at >= block:  # whole blocks: one strided set
            rows = (end - at) // block
            piece = Ranges(row * stride + split.lo * inner, block, rows, stride)
        else:
            piece = Ranges(row * stride + split.lo * inner + within, min(block - within, end - at))
        held = holding.held._replace(offset=holding.held.offset + at - ranges.start)
        out.append(holding._replace(ranges=piece if piece.rows > 1 else Ranges(piece.start, piece.length), held=held))
        at += piece.numel
    return out


class Placed(NamedTuple):
    """Where a tensor lies in a checkpoint being written: its file (relative to the checkpoint's
    directory) and the file's size, the offset of its first byte, its entry. A tuple: a save places
    every tensor of every kind (made at C speed)."""

    file: str
    size: int
    offset: int
    entry: Entry


@dataclass(frozen=True)
class Files:
    """A save's files, laid out before any byte moves: by kind (file stem), its shards and the name of
    each (relative to the checkpoint's directory); where each tensor lies, by (kind, name)."""

    shards: Mapping[str, tuple[tuple[str, Shard], ...]]
    placed: Mapping[tuple[str, str], Placed]

    def mapped(self, kind: str) -> dict[str, str]:
        """The file each tensor of ``kind`` is in, by name (as an index's ``weight_map``)."""
        return {e.name: file for file, shard in self.shards.get(kind, ()) for e in shard.entries}

    def data_bytes(self, kind: str | None = None) -> int:
        """The bytes of tensor data of ``kind``'s files (None: of every file)."""
        kinds = self.shards if kind is None else {kind: self.shards.get(kind, ())}
        return sum(shard.data_bytes for named in kinds.values() for _, shard in named)

    def names(self) -> tuple[str, ...]:
        """Every file, in order."""
        return tuple(file for named in self.shards.values() for file, _ in named)

    def headers(self) -> dict[str, bytes]:
        """Every file's header (its length and JSON, padded), by file."""
        return {file: shard.header for named in self.shards.values() for file, shard in named}


_placed = maker(Placed)


@uncollected
def lay_out(
    entries: Mapping[str, Sequence[Entry]],
    max_shard_bytes: int,
    name: Mapping[str, str] | None = None,
    memo: dict[Hashable, Any] | None = None,
) -> Files:
    """Every file of a save and the place of every tensor in it, from each kind's tensors in order,
    each kind cut into shards of at most ``max_shard_bytes``: the same on every rank. ``name[kind]``:
    the format of its files' names, given ``{k}`` (1-based) and ``{n}`` (how many), default
    ``save_pretrained``'s (``model.safetensors`` alone, else ``model-00001-of-00002.safetensors``).
    ``memo``: where the shards cut for the same tensors are kept between saves (a model's scratch: their
    headers' JSON is most of the work). Pure but for ``memo``."""
    shards: dict[str, tuple[tuple[str, Shard], ...]] = {}
    placed: dict[tuple[str, str], Placed] = {}
    # kinds of the same tensors (the fp32 masters and Adam's two states) cut once
    kept: dict[tuple[tuple[Entry, ...], int], tuple[Shard, ...]] = {}
    if memo is not None:
        kept = memo.setdefault("cut shards", {})
    for kind, listed in entries.items():
        if not listed:
            continue
        key = (tuple(listed), max_shard_bytes)
        cut = kept.get(key)
        if cut is None:
            cut = cut_shards(*key)
            if len(kept) >= 8:  # a few kinds of state, each its own tensors
                kept.pop(next(iter(kept)))
            kept[key] = cut
        pattern = (name or {}).get(kind)
        count = len(cut)
        named = tuple(
            (pattern.format(k=k + 1, n=count) if pattern else shard_name(k, count), s) for k, s in enumerate(cut)
        )
        shards[kind] = named
        for file, shard in named:  # made in C's loops (zip, map): 160,000 tensors a 3.9B-parameter training state
            names = zip(itertools.repeat(kind), map(operator.itemgetter(0), shard.entries))  # (kind, entry.name)
            at = zip(itertools.repeat(file), itertools.repeat(shard.size), shard.offsets, shard.entries)
            placed.update(zip(names, map(_placed, at)))
    return Files(shards, placed)


class WriteItem(NamedTuple):
    """Elements ``ranges`` of tensor ``tensor`` of ``kind``, written from ``held`` at byte ``offset`` of
    ``file`` (where element ``ranges.start`` goes; each next run ``stride`` elements on) in ``dtype``;
    ``size``: the file's. A header: ``held`` None, ``ranges`` its bytes (dtype uint8)."""

    file: str
    size: int
    offset: int
    dtype: torch.dtype
    kind: str
    tensor: str
    ranges: Ranges
    held: Held | None

    @property
    def nbytes(self) -> int:
        """Its elements' bytes in the file."""
        return self.ranges.numel * self.dtype.itemsize


_write_item = maker(WriteItem)


def turns(sizes: Sequence[int], index: int, world: int) -> list[int]:
    """Of items of ``sizes`` bytes one after another that every rank holds, those rank ``index`` of
    ``world`` writes: item k by the rank whose turn its first byte falls in, counting through the bytes
    in order (a contiguous run per rank, about 1/world of the bytes each). Pure."""
    return [k for k, owner in enumerate(owners(sizes, world)) if owner == index]


def owners(sizes: Sequence[int], world: int) -> list[int]:
    """Whose turn each of items of ``sizes`` bytes one after another is (``turns``), in one pass. Pure."""
    total = sum(sizes) or 1
    out, at = [], 0
    for size in sizes:
        out.append(min(world - 1, at * world // total))
        at += size
    return out


@uncollected
def write_items(
    files: Files,
    held: Sequence[Holding],
    index: int,
    world: int,
    writers: Sequence[int] | None = None,
    among: Mapping[str, tuple[int, int]] | None = None,
) -> list[WriteItem]:
    """What rank ``index`` of ``world`` writes of ``files`` holding ``held``: every fragment it holds, and
    its turn of what each set of ranks has alike (the ``replica`` holdings of each set in the files'
    byte order, a contiguous run of their bytes per rank of the set: this rank's index in the set and
    the set's size are ``among[name]``, in EVERY_RANK ``index`` and ``world``; each header with its
    file's first bytes of what every rank has). ``writers``: the index of the one rank that writes each
    file (in ``files.names()`` order) instead: that rank its file's header and every replica in it (every
    replica then held by every rank). Headers first. Over all ranks, every byte of every file once,
    where the ranks that hold a set's replicas all compute theirs from the same holdings. Pure."""
    order = {file: k for k, file in enumerate(files.names())}
    sets: dict[str, tuple[int, int]] = {**(among or {}), EVERY_RANK: (index, world)}
    # (file, offset, item) of what each set of ranks has alike
    alike: dict[str, list[tuple[int, int, WriteItem]]] = {name: [] for name in sets}
    for kind, named in files.shards.items():
        for file, shard in named:
            header = Ranges(0, len(shard.header))
            item = WriteItem(file, shard.size, 0, torch.uint8, kind, "", header, None)
            alike[EVERY_RANK].append((order[file], 0, item))
    fragments: list[WriteItem] = []
    placed = files.placed
    for kind, name, ranges, at, replica, among_ in held:  # unpacked: 160,000 a 3.9B-parameter training state's
        file, size, offset, entry = placed[(kind, name)]
        dtype = entry.dtype
        item = _write_item((file, size, offset + ranges.start * dtype.itemsize, dtype, kind, name, ranges, at))
        if replica:
            alike[among_].append((order[file], offset, item))
        else:
            fragments.append(item)
    mine: list[WriteItem] = []
    for name, listed in alike.items():
        if writers is not None:
            assert name == EVERY_RANK or not listed, "a file's one writer holds what every rank holds only"
            mine += [item for f, _, item in listed if writers[f] == index]
            continue
        listed.sort(key=lambda a: (a[0], a[1]))
        # turns by the replicas' bytes: a header (counted as none) goes with the first bytes of its file
        sizes = [0 if a[2].held is None else a[2].nbytes for a in listed]
        mine += [listed[k][2] for k in turns(sizes, *sets[name])]
    return [item for item in mine if item.held is None] + fragments + [item for item in mine if item.held is not None]


class ReadItem(NamedTuple):
    """Elements ``ranges`` of tensor ``tensor`` of ``kind``, read from byte ``offset`` of ``file`` (where
    element ``ranges.start`` lies; each next run ``stride`` elements on) as stored in ``dtype``, into
    ``held`` (converted to its dtype); ``shape``: the whole tensor's, as stored."""

    file: str
    offset: int
    dtype: torch.dtype
    kind: str
    tensor: str
    ranges: Ranges
    held: Held
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Its elements' bytes in the file."""
        return self.ranges.numel * self.dtype.itemsize


_read_item = maker(ReadItem)


@uncollected
def read_items(stored: Mapping[tuple[str, str], Stored], held: Sequence[Holding]) -> list[ReadItem]:
    """What this rank reads for ``held``: each holding of a tensor the checkpoint holds (``stored``, by
    (kind, name)) from where its elements lie; holdings of tensors it does not hold are not read. Pure."""
    # unpacked (file, dtype, shape, start): a 3.9B-parameter training state's are 160,000
    return [
        _read_item((s[0], s[3] + ranges.start * s[1].itemsize, s[1], kind, name, ranges, held_at, s[2]))
        for kind, name, ranges, held_at, *_ in held
        if (s := stored.get((kind, name))) is not None
    ]


class SharedRead(NamedTuple):
    """One window of what every rank of a group holds alike and reads once between them (a ZeRO-1/2
    model's weights, the buffers): pieces of it (``items``, a tensor cut where a turn or a window ends),
    each read by one rank (``owner``) into its part at byte ``at`` (after the part's status, ``STATUS``
    bytes); then every rank's part (``part_bytes`` each) is all-gathered and every rank puts each piece
    in place from its owner's part, where that part says its reads went well."""

    items: tuple[ReadItem, ...]
    owner: tuple[int, ...]
    at: tuple[int, ...]
    part_bytes: int


#: The bytes before each rank's part of a gather, and before what it sends each rank in an exchange: 0
#: where its reads (or the copy of its values) went well, so that another rank's failure never puts
#: unread bytes in place (the call's agreement then raises on every rank).
STATUS = 8

#: The most bytes one window of a gather or an exchange moves in all (each rank holds about
#: ``world`` parts of 1/world of it: the window once).
WINDOW_BYTES = 256 * 2**20


class Turns(NamedTuple):
    """Bytes one after another (``total`` of them) shared between ``world`` ranks by position: the byte at
    ``pos`` is rank ``owner(pos)``'s turn (a contiguous run of about 1/world of them a rank, as ``owners``
    gives), and each turn cut into windows of ``cap`` bytes: ``window(pos)``. Every window takes about
    ``cap`` bytes of every rank's turn, so each rank reads or writes its 1/world in every window, and
    no rank more: each rank's work independent of the world size. Pure."""

    total: int
    world: int
    cap: int

    @staticmethod
    def of(total: int, world: int, window_bytes: int) -> Turns:
        return Turns(total, world, max(8, -(-max(1, window_bytes // world) // 8) * 8))

    def owner(self, pos: int) -> int:
        return min(self.world - 1, pos * self.world // max(self.total, 1))

    def start(self, rank: int) -> int:
        """The first byte of rank ``rank``'s turn."""
        return -(-rank * self.total // self.world)

    def window(self, pos: int) -> int:
        return (pos - self.start(self.owner(pos))) // self.cap

    @property
    def windows(self) -> int:
        """How many windows: the longest turn's."""
        longest = max((self.start(r + 1) - self.start(r) for r in range(self.world)), default=0)
        return -(-longest // self.cap)


@uncollected
def shared_reads(items: Sequence[ReadItem], world: int, window_bytes: int = WINDOW_BYTES) -> list[SharedRead]:
    """``items`` (what every rank of a group of ``world`` reads alike, whole tensors, the same on every rank)
    read once between the ranks: their bytes in the files' order, each rank its turn of them
    (``Turns``), every window of every turn at most ``cap`` bytes, a tensor cut where a turn or a window
    ends; so each rank reads about 1/world of the bytes in a few runs and every gather moves at most
    about ``window_bytes``. A cut within an element cuts out the element, whose first byte's turn and
    window take it (a piece may end an element past its window's cap). The cuts as columns (world x
    windows of them: 240,000 for a 3.9B-parameter model's masters at 4,096 ranks), a Python step a
    piece only to make it. Pure."""
    ordered = sorted(items, key=lambda item: (item.file, item.offset))
    nbytes = _column([item.nbytes for item in ordered])
    turns = Turns.of(int(nbytes.sum()), world, window_bytes)
    if not turns.total:
        return []
    itemsize = _column([item.dtype.itemsize for item in ordered])
    ends = torch.cumsum(nbytes, 0)
    starts = ends - nbytes
    # every window's first byte, of every turn (a turn's first is where the one before ends)
    first_byte = _ceil_div(torch.arange(world + 1) * turns.total, world)
    count = _ceil_div(first_byte[1:] - first_byte[:-1], turns.cap)
    turn = torch.repeat_interleave(count)
    bounds = first_byte[turn] + (torch.arange(turn.numel()) - (torch.cumsum(count, 0) - count)[turn]) * turns.cap
    # each cut at the elements on either side of it, within the tensor it falls in
    cut = torch.searchsorted(ends, bounds, right=True)
    inside = cut < len(ordered)
    bounds, cut = bounds[inside], cut[inside]
    rel, size = bounds - starts[cut], itemsize[cut]
    below, above = rel // size * size, _ceil_div(rel, size) * size
    at = torch.cat([starts[nbytes > 0], (starts[cut] + below)[below > 0], (starts[cut] + above)[above < nbytes[cut]]])
    at = torch.unique(at)  # sorted: each piece's first byte, in order
    piece = torch.searchsorted(ends, at, right=True)
    length = torch.cat([at[1:], ends[-1:]]) - at
    owner = (at * world // turns.total).clamp(max=world - 1)
    window = (at - first_byte[owner]) // turns.cap
    within = at - first_byte[owner] - window * turns.cap
    size = itemsize[piece]  # each piece made in the files' order (the items' memory in order: 1.5x faster)
    made = _cuts(ordered, piece.tolist(), ((at - starts[piece]) // size).tolist(), (length // size).tolist())
    laid = torch.sort(window, stable=True).indices  # by window, in order within each
    made = list(map(made.__getitem__, laid.tolist()))
    length, owner, window, within = (c[laid] for c in (length, owner, window, within))
    place = within + STATUS
    # every rank's part as wide as the fullest (a piece may end an element past its window's cap)
    part = torch.full((turns.windows,), STATUS, dtype=torch.int64).scatter_reduce_(0, window, place + length, "amax")
    part = _ceil_div(part, 8) * 8
    owners, places = _windowed(owner.tolist(), window, turns.windows), _windowed(place.tolist(), window, turns.windows)
    return [
        SharedRead(tuple(pieces), tuple(whose), tuple(starts_), width)
        for pieces, whose, starts_, width in zip(_windowed(made, window, turns.windows), owners, places, part.tolist())
    ]


def _cut(item: ReadItem, first: int, numel: int) -> ReadItem:
    """Elements ``[first, first + numel)`` of a contiguous item (one run: ``ranges.rows == 1``), as an item
    of their own: read from where they lie, put where they go."""
    return _cuts([item], [0], [first], [numel])[0]


def _cuts(items: Sequence[ReadItem], which: list[int], first: list[int], numel: list[int]) -> list[ReadItem]:
    """``_cut(items[which[k]], first[k], numel[k])`` for each k, made in C's loops (``maker``, ``map``): a
    4,096-rank gather's windows cut ~280,000 pieces of a 3.9B-parameter model's tensors."""
    # by position: ReadItem's (file, offset, dtype, kind, tensor, ranges, held, shape), Held's (source,
    # group, param, offset)
    cut = list(map(items.__getitem__, which))
    held = list(map(operator.itemgetter(6), cut))

    def field(of: list[Any], k: int) -> Iterator[Any]:
        return map(operator.itemgetter(k), of)

    size = map(operator.attrgetter("itemsize"), field(cut, 2))
    offset = map(operator.add, field(cut, 1), map(operator.mul, first, size))
    start = map(operator.add, map(operator.attrgetter("start"), field(cut, 5)), first)
    ranges = map(_ranges, zip(start, numel, itertools.repeat(1), itertools.repeat(0)))
    at = map(_held, zip(field(held, 0), field(held, 1), field(held, 2), map(operator.add, field(held, 3), first)))
    fields = (field(cut, 0), offset, field(cut, 2), field(cut, 3), field(cut, 4), ranges, at, field(cut, 7))
    return list(map(_read_item, zip(*fields)))


def turn_runs(window: SharedRead, index: int) -> list[tuple[str, int, int, int]]:
    """Rank ``index``'s turn of ``window`` as reads: (file, byte offset, offset in its part, bytes), pieces
    whose bytes follow on in one file and in the part joined. Pure."""
    runs: list[tuple[str, int, int, int]] = []
    for item, owner, at in zip(window.items, window.owner, window.at):
        if owner != index:
            continue
        nbytes = item.nbytes
        if (
            runs
            and runs[-1][0] == item.file
            and runs[-1][1] + runs[-1][3] == item.offset
            and runs[-1][2] + runs[-1][3] == at
        ):
            file, offset, first, length = runs[-1]
            runs[-1] = (file, offset, first, length + nbytes)
        else:
            runs.append((item.file, item.offset, at, nbytes))
    return runs


def in_turn(
    own: Sequence[ReadItem], windows: Sequence[SharedRead], index: int
) -> tuple[list[ReadItem], tuple[tuple[tuple[ReadItem, int], ...], ...]]:
    """``own`` (what rank ``index`` reads alone) less the bytes that lie in its turn of a window of
    ``windows`` (a ZeRO-1/2 rank's fp32 partition is about its turn of the masters its weights are
    read from; about: a partition is padded, a turn is not): the items, or the parts of them, that
    lie there, per window, with where their bytes start in its part, to be put in place from there;
    the rest of each still read. An item put through a setter (DeepSpeed's accessors), or of more
    than one run, is read as it is. Pure."""
    runs: dict[str, list[tuple[int, int, int, int]]] = {}  # by file: (offset, end, at, window)
    for w, window in enumerate(windows):
        for file, offset, at, nbytes in turn_runs(window, index):
            runs.setdefault(file, []).append((offset, offset + nbytes, at, w))
    if not runs:
        return list(own), ()
    for listed in runs.values():
        listed.sort()
    starts = {file: [r[0] for r in listed] for file, listed in runs.items()}
    left: list[ReadItem] = []
    taken: list[list[tuple[ReadItem, int]]] = [[] for _ in windows]
    for item in own:
        in_file = runs.get(item.file)
        if in_file is None or item.ranges.rows != 1 or item.held.group == SETTER:
            left.append(item)
            continue
        size, end = item.dtype.itemsize, item.offset + item.nbytes
        j = max(0, bisect.bisect_right(starts[item.file], item.offset) - 1)
        done = item.offset  # the bytes before are taken or left
        while j < len(in_file) and in_file[j][0] < end:
            offset, stop, at, w = in_file[j]
            lo, hi = max(done, offset), min(end, stop)  # turns cut tensors at elements: these are whole ones
            if lo < hi:
                if lo > done:
                    left.append(_cut(item, (done - item.offset) // size, (lo - done) // size))
                whole = lo == item.offset and hi == end
                part = item if whole else _cut(item, (lo - item.offset) // size, (hi - lo) // size)
                taken[w].append((part, at + lo - offset))
                done = hi
            j += 1
        if done < end:
            left.append(item if done == item.offset else _cut(item, (done - item.offset) // size, (end - done) // size))
    return left, tuple(tuple(t) for t in taken)


class Exchange(NamedTuple):
    """One window of small slices moved over the group to the ranks that write them, so that each rank
    writes a few contiguous runs of each file instead of a write per slice. This rank sends ``sends``
    (its items, by destination rank in rank order; ``sent[d]`` bytes to rank d, ``STATUS`` bytes first)
    and receives ``received[s]`` bytes from rank s, back to back in rank order; ``moves`` lay what it
    received out as the files hold it (offset in what it received, offset in its runs, bytes), and
    ``runs`` are written one after another from that: (file, file's size, byte offset, bytes)."""

    sends: tuple[WriteItem, ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]
    moves: tuple[tuple[int, int, int], ...]
    runs: tuple[tuple[str, int, int, int], ...]


#: One I/O call to a file system of this machine: a system call into its page cache (a 16 KiB pread
#: ~2 us, a pwrite ~10 us, measured on the 2-core machine of docs/benchmarks.md). No more than an
#: exchange's handling of the piece: on a local disk nothing is exchanged.
LOCAL_CALL_SECONDS = 5e-6


class IoCosts(NamedTuple):
    """What the planner weighs when it chooses how a piece reaches the disk: a call to the file system
    (a write or read of any size: a parallel file system's or object store's round trip) against moving
    the piece's bytes to another rank first. A piece goes straight to the disk where sending it costs
    no less than a call: its bytes over the network and its handling on both ranks (``piece_seconds``),
    at or above ``(call_seconds - piece_seconds) * network_bytes_per_second`` bytes. The exchange's
    collective (~0.2 ms on two local Gloo ranks) is one a window, whatever the pieces."""

    #: one I/O call (a Lustre or GPFS operation, an object store's request): ~1 ms; on a local file
    #: system, ``LOCAL_CALL_SECONDS``
    call_seconds: float = 1e-3
    #: the bytes per second a rank moves to another over the network (~1 GB/s a rank, conservative)
    network_bytes_per_second: float = 1e9
    #: the bytes per second the file system gives every rank of a job reading it together (a node's page
    #: cache or NVMe, a parallel file system's aggregate: ~10 GB/s)
    file_system_bytes_per_second: float = 1e10
    #: a piece's handling in an exchange: packed by its holder, put in place by the rank that takes it
    #: (~4 us each way, measured in a load's profile on the 2-core machine)
    piece_seconds: float = 5e-6
    #: the bytes per second a rank copies within its memory (~7 GB/s a core on the 2-core machine)
    memory_bytes_per_second: float = 5e9

    def shares(self, world: int) -> bool:
        """Whether ``world`` ranks that each need the same bytes read them once between them and gather
        them: each reads B / world and receives the rest, where every rank reading B itself shares the
        file system's bandwidth with the others (B * world / fs against B / fs + B / network): from
        ``1 + fs / network`` ranks on (11 with these defaults; on one host two ranks read faster from
        the page cache than Gloo moves the bytes)."""
        return world > 1 + self.file_system_bytes_per_second / max(self.network_bytes_per_second, 1e-9)

    @property
    def joined_below(self) -> int:
        """A write of fewer bytes is copied to be joined with the writes after it in the file: its handling
        (``piece_seconds``) and copy cost less than the call it saves (``storage.Writer``): on a network
        file system under ~5 MB; on a local one nothing (a 3 KB write joined cost more than its pwrite)."""
        return int(max(0.0, self.call_seconds - self.piece_seconds) * self.memory_bytes_per_second)

    @property
    def small_below(self) -> int:
        """Pieces of fewer bytes than this are exchanged, larger ones written (or read) where they lie."""
        return int(max(0.0, self.call_seconds - self.piece_seconds) * self.network_bytes_per_second)


class _Slices(NamedTuple):
    """The tensors whose slices are exchanged, one after another in the files' byte order (each its
    holders' slices back to back, as the file holds it): the tensor each key is (every kind stored in
    the same bytes with the same slices is one: a load's weights and masters; a tensor of no elements
    -1), how many keys each is, and as columns, a row a
    tensor (int64; so that a plan of 160,000 tensors' slices at 1,024 ranks, a 3.9B-parameter training
    state's, takes no Python step a slice): its file (an index into ``files``), where it lies in the
    file, its element's bytes, elements and slice, and where it starts among all of them."""

    position: dict[tuple[str, str], int]
    key_counts: torch.Tensor  # how many keys each tensor is
    files: list[str]
    file: torch.Tensor
    offset: torch.Tensor
    itemsize: torch.Tensor
    numel: torch.Tensor
    per: torch.Tensor
    starts: torch.Tensor
    turns: Turns

    @staticmethod
    def of(small: SmallSlices, order: Callable[[str], int], world: int, window_bytes: int) -> _Slices:
        """The tensors ``small`` names; ``order``: each file's place in the files' order."""
        if not small.keys:
            empty = _column([])
            return _Slices({}, empty, [], empty, empty, empty, empty, empty, empty, Turns.of(0, world, window_bytes))
        files = sorted(set(small.file), key=order)
        number = {file: k for k, file in enumerate(files)}
        columns = [_column(list(map(number.__getitem__, small.file))), *map(_column, small[2:])]
        # by file, offset and slice (stable: the keys of one place in their order), each place once; a
        # tensor of no elements has nothing to move (and may start where the next one does)
        laid = torch.sort(columns[2], stable=True).indices
        for column in (columns[1], columns[0]):
            laid = laid[torch.sort(column[laid], stable=True).indices]
        laid = laid[columns[4][laid] > 0]
        file, at, slice_ = (c[laid] for c in columns[:3])
        new = torch.ones(laid.numel(), dtype=torch.bool)
        new[1:] = (file[1:] != file[:-1]) | (at[1:] != at[:-1]) | (slice_[1:] != slice_[:-1])
        first = new.nonzero().squeeze(1)
        place = torch.cumsum(new, 0) - 1
        where = torch.full((len(small.keys),), -1, dtype=torch.int64)  # a tensor of no elements: none
        where[laid] = place
        itemsize_, numel_ = columns[3][laid][first], columns[4][laid][first]
        nbytes = itemsize_ * numel_
        return _Slices(
            dict(zip(small.keys, where.tolist())),
            torch.bincount(place, minlength=first.numel()),
            files,
            file[first],
            at[first],
            itemsize_,
            numel_,
            slice_[first],
            torch.cumsum(nbytes, 0) - nbytes,
            Turns.of(int(nbytes.sum()), world, window_bytes),
        )

    def owned(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slices whose first byte is in ``rank``'s turn, in order, as columns: tensor, holder, start
        (among all the tensors' bytes), bytes."""
        turns = self.turns
        lo, hi = turns.start(rank), turns.start(rank + 1) if rank + 1 < turns.world else turns.total
        bounds = torch.tensor([lo, hi], dtype=torch.int64)
        first = max(0, int(torch.searchsorted(self.starts, bounds[:1], right=True)) - 1)
        last = int(torch.searchsorted(self.starts, bounds[1:]))  # the tensors that start before ``hi``
        starts, per, numel, size = (c[first:last] for c in (self.starts, self.per, self.numel, self.itemsize))
        step = (per * size).clamp(min=1)
        low = _ceil_div(lo - starts, step).clamp(min=0)  # the first holder whose slice starts in the turn
        high = torch.minimum(_ceil_div(numel, per.clamp(min=1)), _ceil_div(hi - starts, step)).clamp(max=turns.world)
        count = torch.where(per > 0, (high - low).clamp(min=0), 0)
        row = torch.repeat_interleave(count)  # each piece's tensor, from ``first``
        holder = low[row] + torch.arange(row.numel()) - (torch.cumsum(count, 0) - count)[row]
        start = starts[row] + holder * step[row]
        nbytes = torch.minimum(per[row], numel[row] - holder * per[row]) * size[row]
        return row + first, holder, start, nbytes

    def held(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s slice of every tensor it holds one of, in order, as columns: tensor, start,
        bytes."""
        lo = rank * self.per
        t = ((self.per > 0) & (lo < self.numel)).nonzero().squeeze(1)
        size = self.itemsize[t]
        return t, self.starts[t] + lo[t] * size, torch.minimum(self.per[t], self.numel[t] - lo[t]) * size

    def whose(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of bytes at ``start`` (among all), whose turn each is and its window there (``Turns``'
        ``owner`` and ``window``, as columns)."""
        turns = self.turns
        owner = (start * turns.world // max(turns.total, 1)).clamp(max=turns.world - 1)
        return owner, (start - _ceil_div(owner * turns.total, turns.world)) // turns.cap


class _Turn(NamedTuple):
    """A rank's turn of the exchanged bytes, its pieces (each a holder's slice of a tensor) in order as
    columns: each window's runs of the files, read or written back to back in its buffer (file's index,
    offset, bytes); each piece's window, bytes, and where it starts among its window's runs (``filled``)
    and in its window's all-to-all buffer (``at``: each holder's segment after its status, in rank order;
    ``by_holder``: the pieces in that order); each window's segments' bytes, holder by holder."""

    runs: list[list[tuple[int, int, int]]]
    window: torch.Tensor
    nbytes: torch.Tensor
    filled: torch.Tensor
    at: torch.Tensor
    by_holder: torch.Tensor
    lengths: list[list[int]]

    @staticmethod
    def of(sliced: _Slices, index: int, count: int) -> _Turn:
        t, holder, start, nbytes = sliced.owned(index)
        window = (start - sliced.turns.start(index)) // sliced.turns.cap  # the start lies in this rank's turn
        offset = sliced.offset[t] + start - sliced.starts[t]
        runs, filled = _runs(window, sliced.file[t], offset, nbytes, count)
        at, by_holder, lengths = _segments(window, holder, nbytes, count, sliced.turns.world)
        return _Turn(runs, window, nbytes, filled, at, by_holder, lengths)

    def moves(self, into_runs: bool) -> list[tuple[tuple[int, int, int], ...]]:
        """Each window's moves between its all-to-all buffer and its runs, in the all-to-all's order: (from,
        to, bytes), from the all-to-all's into the runs' where ``into_runs`` (a save: received, then
        written), else from the runs' into the all-to-all's (a load: read, then sent)."""
        o = self.by_holder
        pair = (self.at[o], self.filled[o]) if into_runs else (self.filled[o], self.at[o])
        return _windows((*pair, self.nbytes[o]), self.window[o], len(self.runs))


def _column(values: Sequence[int]) -> torch.Tensor:
    """``values`` as an int64 tensor (through an array: four times faster than ``torch.tensor``'s look at
    each int)."""
    if not values:  # frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _ceil_div(a: torch.Tensor | int, b: torch.Tensor | int) -> torch.Tensor:
    return -torch.div(-torch.as_tensor(a), b, rounding_mode="floor")


def _runs(
    window: torch.Tensor, file: torch.Tensor, offset: torch.Tensor, nbytes: torch.Tensor, count: int
) -> tuple[list[list[tuple[int, int, int]]], torch.Tensor]:
    """Pieces in order (columns: window, file, byte offset, bytes; windows one after another) read or
    written back to back in each window's buffer: each window's runs (file, offset, bytes: pieces whose
    bytes follow on in one file joined), and where each piece starts in its window's buffer."""
    follows = torch.zeros(nbytes.numel(), dtype=torch.bool)
    follows[1:] = (window[1:] == window[:-1]) & (file[1:] == file[:-1]) & (offset[1:] == offset[:-1] + nbytes[:-1])
    first = (~follows).nonzero().squeeze(1)
    run = torch.cumsum(~follows, 0) - 1
    lengths = torch.zeros(first.numel(), dtype=torch.int64).index_add_(0, run, nbytes)
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
    for w, f, at, n in zip(*(c.tolist() for c in (window[first], file[first], offset[first], lengths))):
        runs[w].append((f, at, n))
    in_window = torch.zeros(count, dtype=torch.int64).index_add_(0, window, nbytes)
    return runs, torch.cumsum(nbytes, 0) - nbytes - (torch.cumsum(in_window, 0) - in_window)[window]


def _segments(
    window: torch.Tensor, peer: torch.Tensor, nbytes: torch.Tensor, count: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """What one rank sends every rank, or receives from every rank, in each window's all-to-all: pieces
    (columns: window, peer, bytes) laid out in their window's buffer by peer in rank order, each peer's
    in the pieces' order after its status (``STATUS`` bytes). Returns where each piece starts there, the
    pieces in that order (indexes), and each window's segments' bytes, peer by peer. Pure."""
    group = window * world + peer
    in_group = torch.zeros(count * world, dtype=torch.int64).index_add_(0, group, nbytes)
    lengths = (in_group + STATUS).view(count, world)
    segment = (torch.cumsum(lengths, 1) - lengths).view(-1)  # where each peer's segment starts in its window
    order = torch.sort(group, stable=True).indices
    ordered, groups = nbytes[order], group[order]
    before = torch.cumsum(ordered, 0) - ordered - (torch.cumsum(in_group, 0) - in_group)[groups]
    at = torch.empty_like(ordered)
    at[order] = segment[groups] + STATUS + before
    return at, order, lengths.tolist()


def _windows(
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor], window: torch.Tensor, count: int
) -> list[tuple[tuple[int, int, int], ...]]:
    """Three ``columns`` (a row a piece, in windows' order) cut into each window's rows, as tuples."""
    a, b, c = (column.tolist() for column in columns)
    return [tuple(rows) for rows in _windowed(list(zip(a, b, c)), window, count)]


_V = TypeVar("_V")


def _windowed(values: list[_V], window: torch.Tensor, count: int) -> list[list[_V]]:
    """``values`` (a piece each, in windows' order; ``window``: each piece's) cut into each window's."""
    ends = torch.bincount(window, minlength=count).cumsum(0).tolist()
    return [values[lo:hi] for lo, hi in zip([0, *ends], ends)]


#: The most bytes of small pieces one rank sends, and receives, in one window of an exchange (a window
#: moves up to ``world`` times this over the group): each rank's memory for it bounded whatever the
#: world, and few windows (the 62 GB of a 3.9B-parameter training state's slices at 1,024 ranks: one).
#: A gather's windows are bounded in all (``WINDOW_BYTES``): every rank receives the whole of each.
EXCHANGE_RANK_BYTES = 64 * 2**20


_Item = TypeVar("_Item", WriteItem, ReadItem)


def _is_slice(held: Held | None) -> bool:
    """``held`` is a fragment of a partitioned group's local buffer (a slice), not a tensor held whole."""
    return held is not None and held.group >= 0 and held.param == -1


def _moved(items: Sequence[_Item], sliced: _Slices) -> tuple[list[_Item], torch.Tensor, list[_Item]]:
    """``items`` split into this rank's slices of the tensors ``sliced`` exchanges, with the tensor each is
    (a column), and the rest (what it holds whole besides, a ZeRO-3 persistent parameter, goes as it is)."""
    moved: list[_Item] = []
    tensors: list[int] = []
    rest: list[_Item] = []
    position = sliced.position
    for item in items:
        held = item.held  # _is_slice, inline: 160,000 items a training state's at 1,024 ranks
        slice_ = held is not None and held.group >= 0 and held.param == -1
        t = position.get((item.kind, item.tensor), -1) if slice_ else -1
        if t < 0:
            rest.append(item)
        else:  # a rank's one slice of a tensor of a kind (one run of a sliced group's tensor)
            moved.append(item)
            tensors.append(t)
    return moved, _column(tensors), rest


def _held_rows(sliced: _Slices, tensors: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Each of ``tensors``' row among ``held`` (``_Slices.held``'s tensors): every slice moved is one this
    rank holds."""
    row = torch.full((sliced.per.numel(),), -1, dtype=torch.int64)
    row[held] = torch.arange(held.numel())
    rows = row[tensors]
    assert bool((rows >= 0).all()), "a slice moved is one this rank holds"
    moved = torch.bincount(tensors, minlength=row.numel())
    assert bool((moved <= sliced.key_counts).all()), "one slice a tensor and rank"
    return rows


def _by(window: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """The indexes that order rows by ``window``, then ``then`` (stable: ties in their order)."""
    order = torch.sort(then, stable=True).indices
    return order[torch.sort(window[order], stable=True).indices]


@uncollected
def exchanged_writes(
    files: Files,
    items: Sequence[WriteItem],
    small: SmallSlices,
    index: int,
    world: int,
    window_bytes: int | None = None,
) -> tuple[list[WriteItem], list[Exchange]]:
    """``items`` (rank ``index``'s writes, ``write_items``) with the slices of the tensors ``small`` names
    (``small_slices``: where each lies in ``files`` and the slice each rank of the group holds of it,
    ZeRO-3's and FSDP2's; the same on every rank) moved to the ranks that write them. Those tensors'
    bytes, in the files' order, shared between the ranks by position (``Turns``: a slice goes to the
    rank whose turn its first byte is), in windows (``window_bytes`` over the group;
    ``EXCHANGE_RANK_BYTES`` a rank where None); each rank writes its turn as a few runs. Returns the
    items still written where they lie and the windows. Over all ranks every byte of every file is
    written once. Pure."""
    if world == 1 or not small.keys:
        return list(items), []
    order = {file: k for k, file in enumerate(files.names())}
    window = EXCHANGE_RANK_BYTES * world if window_bytes is None else window_bytes
    sliced = _Slices.of(small, order.__getitem__, world, window)
    moved, tensors, direct = _moved(items, sliced)
    count = sliced.turns.windows
    # what this rank sends: its slice of each tensor to the rank whose turn it is (by window, then rank:
    # in the tensors' order), each its slice's bytes in the file
    held, start, slice_bytes = sliced.held(index)
    rows = _held_rows(sliced, tensors, held)
    owner, w = sliced.whose(start[rows])
    order_ = _by(w, tensors)
    _, _, sent = _segments(w, owner, slice_bytes[rows], count, world)
    sends = _windowed([moved[k] for k in order_.tolist()], w, count)
    # what this rank writes: its turn's slices, back to back as the files hold them, from every holder
    turn = _Turn.of(sliced, index, count)
    moves = turn.moves(into_runs=True)
    size = {file: shard.size for named in files.shards.values() for file, shard in named}
    out = []
    for k in range(count):
        laid = tuple((sliced.files[f], size[sliced.files[f]], at, n) for f, at, n in turn.runs[k])
        out.append(Exchange(tuple(sends[k]), tuple(sent[k]), tuple(turn.lengths[k]), moves[k], laid))
    return direct, out


class ReadExchange(NamedTuple):
    """One window of small slices read by the ranks whose turn their bytes are, then moved to the ranks
    that hold them, so that each rank reads a few contiguous runs of each file instead of a read per
    slice. This rank reads ``runs`` (file, byte offset, bytes) back to back into its buffer, sends
    ``sent[d]`` bytes to rank d (``STATUS`` bytes first; ``moves``: offset in its buffer, offset in
    what it sends, bytes), receives ``received[s]`` bytes from rank s (back to back in rank order) and
    puts ``takes`` (its own items, each with where its bytes start in what it received) in place.
    ``total``: the bytes of every exchanged tensor, all windows: the same on every rank (the load's
    check compares it: ranks that chose other tensors would not meet in the all-to-alls)."""

    runs: tuple[tuple[str, int, int], ...]
    moves: tuple[tuple[int, int, int], ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]
    takes: tuple[tuple[ReadItem, int], ...]
    total: int = 0


@uncollected
def exchanged_reads(
    items: Sequence[ReadItem],
    small: SmallSlices,
    index: int,
    world: int,
    window_bytes: int | None = None,
) -> tuple[list[ReadItem], list[ReadExchange]]:
    """``items`` (rank ``index``'s own reads) with the slices of the tensors ``small`` names (``small_slices``
    of the checkpoint's tensors: where each lies in its file) read by the ranks whose turn their bytes
    are and sent to their holders (``exchanged_writes`` the other way round; each stored tensor read and
    sent once, put into every kind that takes it with the same slices; windows as there). The same
    windows on every rank. Returns the items still read where they lie and the windows. Each rank ends
    with exactly its holdings. Pure."""
    if world == 1 or not small.keys:
        return list(items), []
    files = {file: k for k, file in enumerate(sorted(set(small.file)))}
    window = EXCHANGE_RANK_BYTES * world if window_bytes is None else window_bytes
    sliced = _Slices.of(small, files.__getitem__, world, window)
    moved, tensors, direct = _moved(items, sliced)
    count = sliced.turns.windows
    # this rank's reads: its turn's slices, then each sent to its holder (once, whatever kinds take it)
    turn = _Turn.of(sliced, index, count)
    moves = turn.moves(into_runs=False)
    # what this rank receives: its slice of each tensor, from the rank whose turn it is, put into the
    # item of every kind that takes it
    held, start, nbytes = sliced.held(index)
    owner, w = sliced.whose(start)
    at, _, received = _segments(w, owner, nbytes, count, world)
    rows = _held_rows(sliced, tensors, held)
    order_ = _by(w[rows], at[rows])
    takes = _windowed(list(zip(map(moved.__getitem__, order_.tolist()), at[rows][order_].tolist())), w[rows], count)
    out = []
    for k in range(count):
        laid = tuple((sliced.files[f], at, n) for f, at, n in turn.runs[k])
        sent = tuple(turn.lengths[k])
        out.append(ReadExchange(laid, moves[k], sent, tuple(received[k]), tuple(takes[k]), sliced.turns.total))
    return direct, out


class SplitReads(NamedTuple):
    """A load's read items on rank ``index`` of a group: its own (read alone), the windows of what the
    group's ranks hold alike (read once between them), per window its own items taken from its part
    (``in_turn``), and the windows of its small slices (``exchanged_reads``)."""

    own: list[ReadItem]
    shared: list[SharedRead]
    from_turn: tuple[tuple[tuple[ReadItem, int], ...], ...]
    exchanged: list[ReadExchange]


@uncollected
def split_reads(
    stored: Mapping[tuple[str, str], Stored],
    held: Sequence[Holding],
    index: int,
    world: int,
    sharing: bool,
    min_bytes: int,
    small: SmallSlices,
) -> SplitReads:
    """What rank ``index`` of a group of ``world`` reads of ``stored`` for ``held``: what every rank of the
    group holds alike (``replica`` among EVERY_RANK, one run, not through a setter; the caller passes
    only holdings whose replicas the whole group holds) read once between them where ``sharing`` and
    that is at least ``min_bytes`` (less is not worth the gather); the slices of the tensors ``small``
    names exchanged; the rest alone (what lies in this rank's turn of the shared bytes taken from
    there). The same windows on every rank. Pure."""
    alike: list[Holding] = []
    if sharing and world > 1:
        alike = [
            h for h in held if h.replica and h.among == EVERY_RANK and h.held.group != SETTER and h.ranges.rows == 1
        ]
    shared = read_items(stored, alike)
    if not shared or sum(item.nbytes for item in shared) < min_bytes:
        alike, shared = [], []
    chosen = set(map(id, alike))
    left = read_items(stored, [h for h in held if id(h) not in chosen] if chosen else held)
    # a tensor this rank reads whole anyway (a ZeRO-3 persistent parameter's weights, whose fp32 masters
    # are slices; persistent on every rank alike) is not exchanged: its slices come from the same read
    whole = {(i.file, i.offset) for i in left if not _is_slice(i.held) and i.ranges.numel == math.prod(i.shape)}
    if whole:
        small = small.without(whole)
    own, exchanged = exchanged_reads(left, small, index, world)
    windows = shared_reads(shared, world) if shared else []
    own, from_turn = in_turn(own, windows, index)
    return SplitReads(own, windows, from_turn, exchanged)


class SmallSlices(NamedTuple):
    """The tensors whose slices are exchanged (``small_slices``), as columns in the kinds' and groups'
    order: each one's key (kind, name), the file it lies in and where its bytes start there, the slice
    each rank of the group holds of it (elements ``[r * per, (r + 1) * per)`` by rank r), its element's
    bytes and its elements. The same on every rank. Columns: the exchange's plan takes them as they are
    (a 3.9B-parameter training state's at 1,024 ranks are 160,000)."""

    keys: list[tuple[str, str]]
    file: list[str]
    start: list[int]
    per: list[int]
    itemsize: list[int]
    numel: list[int]

    def without(self, places: set[tuple[str, int]]) -> SmallSlices:
        """These tensors but those whose bytes start at one of ``places`` (file, byte)."""
        kept = [k for k, at in enumerate(zip(self.file, self.start)) if at not in places]

        def of(column: list[_V]) -> list[_V]:
            return [column[k] for k in kept]

        return SmallSlices(
            of(self.keys), of(self.file), of(self.start), of(self.per), of(self.itemsize), of(self.numel)
        )


@uncollected
def small_slices(
    kinds: Iterable[tuple[str, StateLayout]],
    files: Mapping[tuple[str, str], Stored | Placed],
    costs: IoCosts,
    world: int,
) -> SmallSlices:
    """The tensors of ``kinds`` (stem, layout; by (stem, name)) whose every rank's slice is small enough to
    be moved to or from the rank that writes or reads it rather than written or read where it lies
    (below ``costs.small_below`` bytes in the file's dtype: ``files``' tensor, by (stem, name); one it
    lacks is not moved), with where each lies and the slice's elements: the sliced groups (ZeRO-3,
    FSDP2) of the ``world`` ranks the exchange runs over (not HSDP's shard groups, whose replicas hold
    the same slices). The same on every rank. Pure."""
    rows = []
    below = costs.small_below
    for stem, layout in kinds:
        for group in layout.groups:
            if group.kind is not Partitioning.SLICED or group.world == 1 or group.world != world:
                continue
            for slot in group.params:
                key, per = (stem, slot.name), slot.slice_numel
                found = files.get(key)
                if found is None:
                    continue
                if isinstance(found, Placed):  # unpacked: 160,000 a 3.9B-parameter training state's at 1,024 ranks
                    file, _, start, entry = found
                    shape, dtype = entry.shape, entry.dtype
                else:
                    file, dtype, shape, start = found
                if per * dtype.itemsize < below:
                    rows.append((key, file, start, per, dtype.itemsize, math.prod(shape)))
    if not rows:
        return SmallSlices([], [], [], [], [], [])
    keys, in_file, starts, slices, sizes, numel = zip(*rows)
    return SmallSlices(list(keys), list(in_file), list(starts), list(slices), list(sizes), list(numel))
