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

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, NamedTuple, Sequence, TypeVar

import torch

from collgrad._compat import uncollected
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


def _group_holdings(kind: str, source: int, group: LayoutGroup, rank: int) -> Iterator[Holding]:
    if group.kind is Partitioning.REPLICATED:
        for k, slot in enumerate(group.params):
            yield Holding(kind, slot.name, Ranges(0, slot.numel), Held(source, group.index, k), replica=True)
        return
    for fragment in owned_fragments(group, rank):
        if fragment.numel:
            name = group.params[fragment.param].name
            held = Held(source, group.index, -1, fragment.local_offset)
            yield Holding(kind, name, Ranges(fragment.param_offset, fragment.numel), held)


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
        for file, shard in named:
            for entry, offset in zip(shard.entries, shard.offsets):
                placed[(kind, entry.name)] = Placed(file, shard.size, offset, entry)
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
    for holding in held:
        place = files.placed[(holding.kind, holding.tensor)]
        item = _item(place, holding)
        if holding.replica:
            alike[holding.among].append((order[place.file], place.offset, item))
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


def _item(place: Placed, holding: Holding) -> WriteItem:
    entry = place.entry
    offset = place.offset + holding.ranges.start * entry.dtype.itemsize
    return WriteItem(
        place.file, place.size, offset, entry.dtype, holding.kind, entry.name, holding.ranges, holding.held
    )


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


@uncollected
def read_items(stored: Mapping[tuple[str, str], Stored], held: Sequence[Holding]) -> list[ReadItem]:
    """What this rank reads for ``held``: each holding of a tensor the checkpoint holds (``stored``, by
    (kind, name)) from where its elements lie; holdings of tensors it does not hold are not read. Pure."""
    out = []
    for holding in held:
        found = stored.get((holding.kind, holding.tensor))
        if found is not None:
            offset = found.byte_offset(holding.ranges.start)
            kind, name, ranges = holding.kind, holding.tensor, holding.ranges
            out.append(ReadItem(found.file, offset, found.dtype, kind, name, ranges, holding.held, found.shape))
    return out


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
    about ``window_bytes``. Pure."""
    ordered = sorted(items, key=lambda item: (item.file, item.offset))
    sizes = [item.nbytes for item in ordered]
    turns = Turns.of(sum(sizes), world, window_bytes)
    windows: list[tuple[list[ReadItem], list[int], list[int]]] = [([], [], []) for _ in range(turns.windows)]
    pos = 0
    total, cap = max(turns.total, 1), turns.cap
    first_byte = [turns.start(r) for r in range(world + 1)]  # Turns' arithmetic inline: a piece a turn and window
    for item, nbytes in zip(ordered, sizes):
        size, done = item.dtype.itemsize, 0
        while done < nbytes:  # cut where a turn or a window ends (at an element)
            at = pos + done
            owner = min(world - 1, at * world // total)
            w, within = divmod(at - first_byte[owner], cap)
            end = min(first_byte[owner + 1], at - within + cap)
            n = max(size, (min(nbytes - done, end - at) // size) * size)
            piece = item if n == nbytes else _cut(item, done // size, n // size)
            into = windows[w]
            into[0].append(piece)
            into[1].append(owner)
            into[2].append(STATUS + within)
            done += n
        pos += nbytes
    out = []
    for pieces, whose, starts in windows:
        # every rank's part as wide as the fullest (a piece may end an element past its window's cap)
        ends = [a + i.nbytes for i, a in zip(pieces, starts)]
        part = -(-max(ends, default=STATUS) // 8) * 8
        out.append(SharedRead(tuple(pieces), tuple(whose), tuple(starts), part))
    return out


def _cut(item: ReadItem, first: int, numel: int) -> ReadItem:
    """Elements ``[first, first + numel)`` of a contiguous item (one run: ``ranges.rows == 1``), as an item
    of their own: read from where they lie, put where they go."""
    held = item.held  # built directly, not by _replace: a 4,096-rank gather's windows cut ~300,000 of them
    return ReadItem(
        item.file,
        item.offset + first * item.dtype.itemsize,
        item.dtype,
        item.kind,
        item.tensor,
        Ranges(item.ranges.start + first, numel),
        Held(held.source, held.group, held.param, held.offset + first),
        item.shape,
    )


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

    def shares(self, world: int) -> bool:
        """Whether ``world`` ranks that each need the same bytes read them once between them and gather
        them: each reads B / world and receives the rest, where every rank reading B itself shares the
        file system's bandwidth with the others (B * world / fs against B / fs + B / network): from
        ``1 + fs / network`` ranks on (11 with these defaults; on one host two ranks read faster from
        the page cache than Gloo moves the bytes)."""
        return world > 1 + self.file_system_bytes_per_second / max(self.network_bytes_per_second, 1e-9)

    @property
    def small_below(self) -> int:
        """Pieces of fewer bytes than this are exchanged, larger ones written (or read) where they lie."""
        return int(max(0.0, self.call_seconds - self.piece_seconds) * self.network_bytes_per_second)


class _Slices(NamedTuple):
    """The tensors whose slices are exchanged, one after another in the files' byte order (each its
    holders' slices back to back, as the file holds it): the keys that take each (every kind stored
    in the same bytes with the same slices: a load's weights and masters), where each lies in the file,
    its element's bytes, elements and slice, and where each starts among all of them."""

    keys: list[list[tuple[str, str]]]
    file: list[str]
    offset: list[int]
    itemsize: list[int]
    numel: list[int]
    per: list[int]
    starts: list[int]
    turns: Turns

    @staticmethod
    def of(
        places: Mapping[tuple[str, str], tuple[str, int, int, int]],
        small: Mapping[tuple[str, str], int],
        order: Callable[[str], int],
        world: int,
        window_bytes: int,
    ) -> _Slices:
        """``places[key]``: (file, byte offset, element's bytes, elements) of each tensor of ``small``."""
        by_place: dict[tuple[str, int, int], list[tuple[str, str]]] = {}
        for key, per in small.items():  # in the same order on every rank: the keys' order among a place's
            found = places.get(key)
            if found is not None:
                by_place.setdefault((found[0], found[1], per), []).append(key)
        laid = sorted(by_place, key=lambda p: (order(p[0]), p[1], p[2]))
        keys = [by_place[p] for p in laid]
        first = [places[k[0]] for k in keys]
        starts, at = [], 0
        for _, _, size, numel in first:
            starts.append(at)
            at += size * numel
        out = _Slices(
            keys,
            [f[0] for f in first],
            [f[1] for f in first],
            [f[2] for f in first],
            [f[3] for f in first],
            [p[2] for p in laid],
            starts,
            Turns.of(at, world, window_bytes),
        )
        return out

    def owned(self, rank: int) -> Iterator[tuple[int, int, int, int]]:
        """The slices whose first byte is in ``rank``'s turn, in order: (tensor, holder, start, bytes).
        (``holders`` and ``piece`` worked out inline: a rank's turn is every tensor's slices at 1,024
        ranks.)"""
        turns = self.turns
        lo, hi = turns.start(rank), turns.start(rank + 1) if rank + 1 < turns.world else turns.total
        starts, itemsize, pers, numels = self.starts, self.itemsize, self.per, self.numel
        t = max(0, bisect.bisect_right(starts, lo) - 1)
        while t < len(starts) and starts[t] < hi:
            size, per, numel, first_byte = itemsize[t], pers[t], numels[t], starts[t]
            if per:
                step = per * size
                for holder in range(max(0, -(-(lo - first_byte) // step)), min(turns.world, -(-numel // per))):
                    start = first_byte + holder * step
                    if start >= hi:
                        break
                    yield t, holder, start, min(per, numel - holder * per) * size
            t += 1

    def held(self, rank: int) -> Iterator[tuple[int, int, int]]:
        """Rank ``rank``'s slice of every tensor it holds one of, in order: (tensor, start, bytes)."""
        starts, itemsize, pers, numels = self.starts, self.itemsize, self.per, self.numel
        for t in range(len(starts)):
            per, numel = pers[t], numels[t]
            lo = rank * per
            if per and lo < numel:
                yield t, starts[t] + lo * itemsize[t], min(per, numel - lo) * itemsize[t]


#: The most bytes of small pieces one rank sends, and receives, in one window of an exchange (a window
#: moves up to ``world`` times this over the group): each rank's memory for it bounded whatever the
#: world, and few windows (the 62 GB of a 3.9B-parameter training state's slices at 1,024 ranks: one).
#: A gather's windows are bounded in all (``WINDOW_BYTES``): every rank receives the whole of each.
EXCHANGE_RANK_BYTES = 64 * 2**20


_Item = TypeVar("_Item", WriteItem, ReadItem)


def _is_slice(held: Held | None) -> bool:
    """``held`` is a fragment of a partitioned group's local buffer (a slice), not a tensor held whole."""
    return held is not None and held.group >= 0 and held.param == -1


def _moved(
    items: Sequence[_Item], small: Mapping[tuple[str, str], int]
) -> tuple[dict[tuple[str, str], _Item], list[_Item]]:
    """``items`` split into this rank's slices of the tensors ``small`` names (by key; one a tensor) and
    the rest (what it holds whole besides, a ZeRO-3 persistent parameter, goes as it is)."""
    mine: dict[tuple[str, str], _Item] = {}
    rest: list[_Item] = []
    for item in items:
        key = (item.kind, item.tensor)
        if _is_slice(item.held) and key in small:
            assert key not in mine, "one slice a tensor and rank"
            mine[key] = item
        else:
            rest.append(item)
    return mine, rest


@uncollected
def exchanged_writes(
    files: Files,
    items: Sequence[WriteItem],
    small: Mapping[tuple[str, str], int],
    index: int,
    world: int,
    window_bytes: int | None = None,
) -> tuple[list[WriteItem], list[Exchange]]:
    """``items`` (rank ``index``'s writes, ``write_items``) with the slices of the tensors ``small`` names
    moved to the ranks that write them: ``small[(kind, name)]`` is the slice each rank of the group
    holds of that tensor (elements ``[r * slice, (r + 1) * slice)`` by rank r: ZeRO-3's and FSDP2's
    slices), the same on every rank. Those tensors' bytes, in the files' order, shared between the
    ranks by position (``Turns``: a slice goes to the rank whose turn its first byte is), in windows
    (``window_bytes`` over the group; ``EXCHANGE_RANK_BYTES`` a rank where None); each rank writes its
    turn as a few runs. Returns the items still written where they lie and the
    windows. Over all ranks every byte of every file is written once. Pure."""
    if world == 1 or not small:
        return list(items), []
    order = {file: k for k, file in enumerate(files.names())}
    places = {
        key: (p.file, p.offset, p.entry.dtype.itemsize, p.entry.numel)
        for key in small
        for p in [files.placed.get(key)]
        if p is not None
    }
    window = EXCHANGE_RANK_BYTES * world if window_bytes is None else window_bytes
    sliced = _Slices.of(places, small, order.__getitem__, world, window)
    mine, direct = _moved(items, small)
    turns = sliced.turns
    count = turns.windows
    sends: list[list[list[WriteItem]]] = [[[] for _ in range(world)] for _ in range(count)]
    for t, start, _ in sliced.held(index):
        owner = turns.owner(start)
        to = sends[(start - turns.start(owner)) // turns.cap][owner]
        to.extend(item for key in sliced.keys[t] if (item := mine.get(key)) is not None)
    # what this rank writes: its turn's slices, back to back as the files hold them, from every holder
    pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in range(count)]
    turn = turns.start(index)
    for t, holder, start, nbytes in sliced.owned(index):
        pieces[(start - turn) // turns.cap].append((t, holder, start, nbytes))  # turns.window(start)
    out = []
    for w in range(count):
        runs: list[tuple[str, int, int, int]] = []
        incoming: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # per holder: (offset in runs, bytes)
        filled = 0
        for t, holder, start, nbytes in pieces[w]:
            offset = sliced.offset[t] + start - sliced.starts[t]
            size = files.placed[sliced.keys[t][0]].size
            if runs and runs[-1][0] == sliced.file[t] and runs[-1][2] + runs[-1][3] == offset:
                runs[-1] = (runs[-1][0], size, runs[-1][2], runs[-1][3] + nbytes)
            else:
                runs.append((sliced.file[t], size, offset, nbytes))
            incoming[holder].append((filled, nbytes))
            filled += nbytes
        placed, received = _segments(incoming)
        moves = tuple((at, dst, n) for dst, at, n in placed)
        _, sent = _segments([[(i, i.nbytes) for i in to] for to in sends[w]])
        flat = tuple(i for to in sends[w] for i in to)
        out.append(Exchange(flat, sent, received, moves, tuple(runs)))
    return direct, out


_Piece = TypeVar("_Piece")


def _segments(by_rank: Sequence[Sequence[tuple[_Piece, int]]]) -> tuple[list[tuple[_Piece, int, int]], tuple[int, ...]]:
    """What one rank sends every rank, or receives from every rank, in an all-to-all: each rank's pieces
    (what, bytes) back to back in rank order, each rank's segment after its status (``STATUS`` bytes).
    Returns every piece with where it starts, ``(what, offset, bytes)``, and each segment's bytes. Pure."""
    placed: list[tuple[_Piece, int, int]] = []
    lengths, at = [], 0
    for pieces in by_rank:
        first, at = at, at + STATUS
        for what, n in pieces:
            placed.append((what, at, n))
            at += n
        lengths.append(at - first)
    return placed, tuple(lengths)


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
    stored: Mapping[tuple[str, str], Stored],
    items: Sequence[ReadItem],
    small: Mapping[tuple[str, str], int],
    index: int,
    world: int,
    window_bytes: int | None = None,
) -> tuple[list[ReadItem], list[ReadExchange]]:
    """``items`` (rank ``index``'s own reads) with the slices of the tensors ``small`` names read by the
    ranks whose turn their bytes are and sent to their holders (``exchanged_writes`` the other way
    round; each stored tensor read and sent once, put into every kind that takes it with the same
    slices; windows as there). The same windows on every rank. Returns the items still read where they
    lie and the windows. Each rank ends with exactly its holdings. Pure."""
    if world == 1 or not small:
        return list(items), []
    places = {key: (s.file, s.start, s.dtype.itemsize, s.numel) for key in small for s in [stored.get(key)] if s}
    files = {file: k for k, file in enumerate(sorted({p[0] for p in places.values()}))}
    window = EXCHANGE_RANK_BYTES * world if window_bytes is None else window_bytes
    sliced = _Slices.of(places, small, files.__getitem__, world, window)
    mine, direct = _moved(items, small)
    turns = sliced.turns
    count = turns.windows
    # this rank's reads: its turn's slices, then each sent to its holder
    runs: list[list[tuple[str, int, int]]] = [[] for _ in range(count)]
    outgoing: list[list[list[tuple[int, int]]]] = [[[] for _ in range(world)] for _ in range(count)]
    filled = [0] * count
    turn = turns.start(index)
    for t, holder, start, nbytes in sliced.owned(index):
        w = (start - turn) // turns.cap  # turns.window(start): the start lies in this rank's turn
        file, offset = sliced.file[t], sliced.offset[t] + start - sliced.starts[t]
        listed = runs[w]
        if listed and listed[-1][0] == file and listed[-1][1] + listed[-1][2] == offset:
            listed[-1] = (file, listed[-1][1], listed[-1][2] + nbytes)
        else:
            listed.append((file, offset, nbytes))
        outgoing[w][holder].append((filled[w], nbytes))  # sent once, whatever kinds take them
        filled[w] += nbytes
    # what this rank receives: its slice of each tensor, from the rank whose turn it is, put into the
    # item of every kind that takes it
    incoming: list[list[list[tuple[list[ReadItem], int]]]] = [[[] for _ in range(world)] for _ in range(count)]
    for t, start, nbytes in sliced.held(index):
        taking = [mine[key] for key in sliced.keys[t] if key in mine]
        assert not taking or taking[0].nbytes == nbytes, "a holder's slice"
        owner = turns.owner(start)
        incoming[(start - turns.start(owner)) // turns.cap][owner].append((taking, nbytes))
    out = []
    for w in range(count):
        moves, sent = _segments(outgoing[w])  # (offset in its buffer, offset in what it sends, bytes)
        placed, received = _segments(incoming[w])
        takes = tuple((item, at) for taking, at, _ in placed for item in taking)
        out.append(ReadExchange(tuple(runs[w]), tuple(moves), sent, received, takes, turns.total))
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
    small: Mapping[tuple[str, str], int],
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
    left = read_items(stored, [h for h in held if id(h) not in chosen])
    # a tensor this rank reads whole anyway (a ZeRO-3 persistent parameter's weights, whose fp32 masters
    # are slices; persistent on every rank alike) is not exchanged: its slices come from the same read
    whole = {(i.file, i.offset) for i in left if i.ranges.numel == math.prod(i.shape) and not _is_slice(i.held)}
    small = {
        key: n for key, n in small.items() if key not in stored or (stored[key].file, stored[key].start) not in whole
    }
    own, exchanged = exchanged_reads(stored, left, small, index, world)
    windows = shared_reads(shared, world) if shared else []
    own, from_turn = in_turn(own, windows, index)
    return SplitReads(own, windows, from_turn, exchanged)


@uncollected
def small_slices(
    kinds: Iterable[tuple[str, StateLayout]],
    itemsize: Callable[[tuple[str, str]], int | None],
    costs: IoCosts,
    world: int,
) -> dict[tuple[str, str], int]:
    """The tensors of ``kinds`` (stem, layout; by (stem, name)) whose every rank's slice is small enough to
    be moved to or from the rank that writes or reads it rather than written or read where it lies
    (below ``costs.small_below`` bytes in the file's dtype: ``itemsize``, None for a tensor the file
    lacks), with the slice's elements: the sliced groups (ZeRO-3, FSDP2) of the ``world`` ranks the
    exchange runs over (not HSDP's shard groups, whose replicas hold the same slices). The same on
    every rank. Pure."""
    out: dict[tuple[str, str], int] = {}
    below = costs.small_below
    for stem, layout in kinds:
        for group in layout.groups:
            if group.kind is not Partitioning.SLICED or group.world == 1 or group.world != world:
                continue
            for slot in group.params:
                size = itemsize((stem, slot.name))
                if size is not None and slot.slice_numel * size < below:
                    out[(stem, slot.name)] = slot.slice_numel
    return out
