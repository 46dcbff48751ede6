"""Small helpers on tensor memory shared by the dispatcher and the sources."""

from __future__ import annotations

import bisect
import itertools
import operator
import weakref
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "adjacent_view",
    "flat_alias",
    "joined_copies",
    "joined_runs",
    "joined_source",
    "cut_parts",
    "Pieces",
    "PiecesCache",
    "SameTensors",
    "StorageSpans",
    "main_run",
    "run_view",
]

#: A 1-D view of the storage span some pieces cover, and each piece's offset in it.
Placed = Tuple[torch.Tensor, Tuple[int, ...]]
#: A key of ``Pieces.memo``: a name, or a name and two piece indices.
MemoKey = Union[str, Tuple[str, int, int]]
#: ``Pieces.memo``: values of several types (an offset, a tuple of piece indices, a hash, what
#: collgrad.state works out from the placement), one type per key, each read back under an annotation
#: of that type; Any as the one type that holds them all and reads back as each.
Memo = Dict[MemoKey, Any]
#: Where pieces lie as plain data, without a tensor (see ``_known``): the pieces' starts, their numel,
#: each piece's offset in the span (None: they share no storage), the span's numel, whether they tile
#: it, and the memo.
Known = Tuple[List[int], int, Optional[Tuple[int, ...]], int, bool, Memo]
#: ``Pieces.storage_spans``: per storage, a 1-D view of the span its pieces cover; per piece, (its span,
#: its offset in it).
StorageSpans = Tuple[List[torch.Tensor], Tuple[Tuple[int, int], ...]]
#: How pieces group by storage, as plain data (kept in the memo): per span its lowest piece and its
#: numel, and per piece (its span, its offset in it).
_SpanLayout = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[Tuple[int, int], ...]]


def adjacent_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view covering ``parts`` if they are contiguous, of one dtype, and lie back to back in
    one storage in this order; else None. Lets a bucket of views into an existing flat buffer travel
    without a packing copy."""
    if not parts:
        return None
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.dtype != first.dtype
            or p.device != first.device
            or p.untyped_storage().data_ptr() != storage
            or p.data_ptr() != end
        ):
            return None
        end = p.data_ptr() + p.numel() * p.element_size()
    total = sum(p.numel() for p in parts)
    return _storage_view(first, int(first.storage_offset()), total)


def joined_copies(
    targets: list[torch.Tensor], sources: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The copies ``targets[i].copy_(sources[i])`` as fewer, longer ones: where target i + 1 follows
    target i in its storage and source i + 1 follows source i in theirs (asked of both in C loops), the
    run is one pair of 1-D views (a copy each of hundreds of small tensors costs ~30% more than one of
    their bytes). Where a plan knows how the targets lie, ``joined_runs`` asks only the sources. Local;
    nothing is copied."""
    if len(sources) < 2:
        return targets, sources
    joined = _follow(sources)
    if joined is not None:
        joined = list(map(operator.and_, joined, _follow(targets) or [False] * len(joined)))
    if joined is None or not any(joined):
        return targets, sources
    out_targets: list[torch.Tensor] = []
    out_sources: list[torch.Tensor] = []
    first = 0
    for i, last in enumerate(joined + [False]):
        if last:
            continue
        target, source = _run(targets[first : i + 1]), _run(sources[first : i + 1])
        if target is None or source is None:
            out_targets += targets[first : i + 1]
            out_sources += sources[first : i + 1]
        else:
            out_targets.append(target)
            out_sources.append(source)
        first = i + 1
    return out_targets, out_sources


def joined_runs(
    sources: list[torch.Tensor], los: Sequence[int], numels: Sequence[int], follows: Sequence[bool]
) -> list[tuple[int, int]] | None:
    """The copies of elements ``[los[i], los[i] + numels[i])`` of each of ``sources`` (flattened) as runs
    ``(first, end)`` of copies that can be one: where the target of copy i + 1 follows that of copy i
    (``follows[i]``, from a plan) and source i + 1's part begins where source i's ends. None if the
    sources are not all contiguous, of one dtype. Asked in C loops (a copy's addresses), nothing made:
    ``joined_source`` makes a run's source view."""
    assert len(follows) == len(sources) - 1 == len(los) - 1 == len(numels) - 1  # one per pair
    if len(set(map(_dtype, sources))) != 1 or not all(map(torch.Tensor.is_contiguous, sources)):
        return None
    size = sources[0].element_size()
    starts = list(map(torch.Tensor.data_ptr, sources))
    for k in itertools.compress(itertools.count(), los):  # the few parts that start inside their value
        starts[k] += los[k] * size
    ends = map(operator.add, starts, map(operator.mul, numels, itertools.repeat(size)))
    joined = map(operator.and_, follows, map(operator.eq, starts[1:], ends))
    cuts = list(itertools.compress(itertools.count(1), map(operator.not_, joined)))
    return list(zip([0, *cuts], [*cuts, len(sources)]))


def joined_source(first: torch.Tensor, lo: int, last: torch.Tensor, numel: int) -> torch.Tensor | None:
    """``numel`` elements from element ``lo`` of contiguous ``first`` on, as one 1-D view, where they end
    in ``last``'s storage (``joined_runs`` found them back to back: if ``first`` and ``last`` share a
    storage, so do all between); None if the two lie in different storages."""
    if first is not last and first.untyped_storage().data_ptr() != last.untyped_storage().data_ptr():
        return None
    return _storage_view(first, int(first.storage_offset()) + lo, numel)


def cut_parts(values: list[torch.Tensor], los: Sequence[int], numels: Sequence[int]) -> list[torch.Tensor]:
    """Elements ``[los[i], los[i] + numels[i])`` of each of ``values`` (flattened), as 1-D views: where
    values one after another view one buffer, contiguous, and their parts lie in order in it (collgrad's
    reads: a bucket; ZeRO-3 writes a slice of each), one ``split_with_sizes`` of the span they cover,
    gaps included, for the run (a view each costs ~3 us from Python: 400 of them, more than the copy's
    setup); the others one by one. Local."""
    bases = list(map(_base_of, values))
    contiguous = list(map(torch.Tensor.is_contiguous, values))
    starts = list(map(operator.add, map(torch.Tensor.storage_offset, values), los))
    out: list[torch.Tensor] = []
    at = 0
    for _, run in itertools.groupby(bases, key=id):
        end = at + len(list(run))
        if bases[at] is not None and end - at > 1 and all(contiguous[at:end]):
            ends = list(map(operator.add, starts[at:end], numels[at:end]))
            gaps = list(map(operator.sub, starts[at + 1 : end], ends))
            if (
                min(gaps) >= 0
                and len(set(map(_dtype, values[at:end]))) == 1
                and _within(values[at], values[end - 1], ends[-1])
            ):
                sizes = [0] * (2 * (end - at) - 1)
                sizes[0::2], sizes[1::2] = numels[at:end], gaps
                span = _storage_view(values[at], starts[at], ends[-1] - starts[at])
                out += span.split_with_sizes(sizes)[0::2]
                at = end
                continue
        for k in range(at, end):
            out.append(values[k].reshape(-1).narrow(0, los[k], numels[k]))
        at = end
    return out


_base_of = operator.attrgetter("_base")


def _within(first: torch.Tensor, last: torch.Tensor, end: int) -> bool:
    """Whether ``first`` and ``last`` lie in one storage that holds ``end`` elements of their dtype (a
    span cut from it is not bounds-checked: ``set_``)."""
    storage = first.untyped_storage()
    return storage.data_ptr() == last.untyped_storage().data_ptr() and end * first.element_size() <= storage.nbytes()


def _follow(tensors: list[torch.Tensor]) -> list[bool] | None:
    """Whether each tensor's bytes begin where the one before it ends (from the second on); None if they
    are not all contiguous, of one dtype. In C loops."""
    if len(set(map(_dtype, tensors))) != 1 or not all(map(torch.Tensor.is_contiguous, tensors)):
        return None
    starts = list(map(torch.Tensor.data_ptr, tensors))
    return list(map(operator.eq, starts[1:], map(operator.add, starts, map(_nbytes, tensors))))


_dtype = operator.attrgetter("dtype")
_nbytes = operator.attrgetter("nbytes")


def _run(run: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Tensors that lie back to back (their addresses say so) as one 1-D view, if the first and the last
    share a storage (so all do: a storage is one range of memory); None if not. One tensor: itself."""
    first, last = run[0], run[-1]
    if len(run) == 1:
        return first
    return joined_source(first, 0, last, (last.data_ptr() + last.nbytes - first.data_ptr()) // first.element_size())


def flat_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D alias of contiguous ``tensor``'s elements that holds its storage but not ``tensor`` itself
    (``view(-1)`` would keep ``tensor`` alive as its base), so a weak reference to ``tensor`` still
    tells when its owner lets go of it."""
    assert tensor.is_contiguous()
    return _storage_view(tensor, int(tensor.storage_offset()), tensor.numel())


def _storage_view(tensor: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """Elements ``[offset, offset + numel)`` of ``tensor``'s storage as a 1-D tensor of its dtype: a
    view of the storage, not of ``tensor`` (no base kept)."""
    return tensor.new_empty(0).set_(tensor.untyped_storage(), offset, (numel,), (1,))


def _flattened(piece: torch.Tensor) -> torch.Tensor:
    return piece if piece.dim() == 1 else piece.reshape(-1)  # a view where contiguous


class Pieces:
    """A rank's local gradient buffer held as pieces that are logically back to back (DeepSpeed's
    list of partition fragments), read by range without first concatenating everything."""

    def __init__(self, pieces: Sequence[torch.Tensor]) -> None:
        self.given = list(pieces)
        self._flat: list[torch.Tensor] | None = None
        sizes = [p.numel() for p in self.given]
        self.starts, self._numel = [0, *itertools.accumulate(sizes)][:-1], sum(sizes)
        # Computed on first use (or known from a PiecesCache: the same fragment tensors lie where they lay)
        self._placement: Placed | None | Literal[False] = False  # False: not worked out yet
        self._tiling: Placed | None | Literal[False] = False
        #: Values derived from where the pieces lie (plain data, no tensors), shared by the Pieces a
        #: PiecesCache builds for the same fragments: computed once while they stay.
        self.memo: Memo = {}

    @property
    def pieces(self) -> list[torch.Tensor]:
        """The pieces as 1-D tensors (views where contiguous), flattened on first use."""
        if self._flat is None:
            self._flat = [_flattened(p) for p in self.given]
        return self._flat

    def piece(self, k: int) -> torch.Tensor:
        """Piece ``k`` as a 1-D tensor, without flattening the others."""
        return self._flat[k] if self._flat is not None else _flattened(self.given[k])

    def numel(self) -> int:
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        return self.given[0].dtype

    @property
    def device(self) -> torch.device:
        return self.given[0].device

    def spans(self, offset: int, numel: int) -> Iterator[tuple[torch.Tensor, int]]:
        """The parts of the pieces that elements ``[offset, offset + numel)`` cover, in order, each as a
        view of its piece with its start relative to ``offset``."""
        end = offset + numel
        starts, pieces = self.starts, self.pieces
        # from the piece holding ``offset`` on, by index (slicing the lists made a write of n pieces O(n))
        for k in range(max(0, bisect.bisect_right(starts, offset) - 1), len(starts)):
            start = starts[k]
            if start >= end:
                break
            piece = pieces[k]
            stop = start + piece.numel()
            if stop > offset:
                lo = max(offset, start)
                yield piece[lo - start : min(end, stop) - start], lo - offset

    def write(self, offset: int, values: torch.Tensor) -> None:
        """Copy the 1-D ``values`` into elements ``[offset, offset + values.numel())``, in place in every
        piece they cover (converted to the pieces' dtype and device)."""
        for part, at in self.spans(offset, values.numel()):
            part.copy_(values[at : at + part.numel()])

    def placement(self) -> Placed | None:
        """Where the pieces lie when they share one storage (in any order, gaps allowed; DeepSpeed's
        ZeRO-1/2 fragments lie in reverse order, as backward fills its buffer): a 1-D view of the span
        of that storage they cover, and each piece's offset in it. None if they are not all contiguous
        views of one storage of one dtype."""
        if self._placement is not False:
            return self._placement
        self._placement = self._place()
        return self._placement

    def _place(self) -> Placed | None:
        spans = self.storage_spans()  # one storage: its span is the placement
        if spans is None or len(spans[0]) != 1:
            return None
        views, where = spans
        return views[0], tuple(offset for _, offset in where)

    def storage_spans(self) -> StorageSpans | None:
        """Where the pieces lie storage by storage: per storage they use (in the order of their first
        piece), a 1-D view of the span its pieces cover, and per piece (its span, its offset in it). One
        span where the pieces share a storage (``placement()``); more where they lie in several
        (DeepSpeed's last rank holds its tail padding in a tensor of its own). None if a piece is not
        contiguous or another dtype. How the pieces group is worked out once (kept in ``memo``, see
        PiecesCache); the views are made per call (a view kept would keep the storage alive after its
        owner frees it)."""
        layout: _SpanLayout | None | Literal[False] = self.memo.get("storage spans", False)
        if layout is False:
            layout = self.memo["storage spans"] = self._by_storage()
        if layout is None:
            return None
        firsts, numels, where = layout
        given = self.given
        views = [_storage_view(given[k], int(given[k].storage_offset()), n) for k, n in zip(firsts, numels)]
        return views, where

    def _by_storage(self) -> _SpanLayout | None:
        first = self.given[0]
        members: dict[int, list[int]] = {}  # storage -> its pieces
        for k, p in enumerate(self.given):
            if not p.is_contiguous() or p.dtype != first.dtype:
                return None
            members.setdefault(p.untyped_storage().data_ptr(), []).append(k)
        offsets = [int(p.storage_offset()) for p in self.given]
        firsts, numels, where = [], [], [(0, 0)] * len(self.given)
        for index, ks in enumerate(members.values()):
            lowest = min(ks, key=offsets.__getitem__)
            end = max(offsets[k] + self.given[k].numel() for k in ks)
            firsts.append(lowest)
            numels.append(end - offsets[lowest])
            for k in ks:
                where[k] = (index, offsets[k] - offsets[lowest])
        return tuple(firsts), tuple(numels), tuple(where)

    def _in_order(self, first: int, last: int) -> int | None:
        """Where piece ``first`` starts in ``placement()``'s span if pieces ``first..last`` lie there back
        to back in their own order, else None. Worked out once per pair (kept in ``memo``, which
        outlives this object while the pieces stay where they are: see PiecesCache)."""
        key = ("in order", first, last)
        if key not in self.memo:
            placed = self.placement()
            found = None
            if placed is not None and 0 <= first <= last < len(self.given):
                offsets = placed[1]
                shift = offsets[first] - self.starts[first]
                if all(offsets[k] - self.starts[k] == shift for k in range(first + 1, last + 1)):
                    found = offsets[first]
            self.memo[key] = found
        at: int | None = self.memo[key]
        return at

    def span_offset(self, offset: int, numel: int) -> int | None:
        """Where elements ``[offset, offset + numel)`` start in ``placement()``'s span, if they lie within
        one piece; None if they straddle two pieces or the pieces share no storage."""
        placed = self.placement()
        if placed is None:
            return None
        j = bisect.bisect_right(self.starts, offset) - 1
        if offset + numel > self.starts[j] + self.given[j].numel():
            return None
        return placed[1][j] + offset - self.starts[j]

    def tiling(self) -> Placed | None:
        """``placement()`` when the pieces cover their span exactly (no gap, no overlap): the span then
        holds every element once, in storage order, and can be sent as it lies instead of concatenated."""
        if self._tiling is not False:
            return self._tiling
        self._tiling = self._tile()
        return self._tiling

    def _tile(self) -> Placed | None:
        placed = self.placement()
        if placed is None:
            return None
        span, offsets = placed
        end = 0
        for offset, piece in sorted(zip(offsets, self.given), key=lambda t: t[0]):
            if offset != end:
                return None
            end += piece.numel()
        return (span, offsets) if end == span.numel() else None

    def whole(self) -> torch.Tensor:
        """Everything as one contiguous tensor: a view when the pieces already are back to back."""
        return self.range(0, self._numel)

    def range(self, offset: int, numel: int) -> torch.Tensor:
        """Elements ``[offset, offset + numel)``: a view when they lie in one piece (or in adjacent
        ones), else a copy of just that range."""
        if offset == 0 and numel == self._numel and len(self.given) == 1:
            return self.piece(0)
        j = bisect.bisect_right(self.starts, offset) - 1
        if j >= 0 and self.starts[j] == offset and self.given[j].numel() == numel:
            return self.piece(j)  # exactly one piece (DeepSpeed's ZeRO-1/2 list: one per fragment)
        at = self._in_order(max(j, 0), bisect.bisect_left(self.starts, offset + numel) - 1)
        if at is not None:  # pieces back to back in their storage (ZeRO-3's slices): the span's view
            placed = self.placement()
            assert placed is not None  # _in_order found them in its span
            return placed[0][at + offset - self.starts[max(j, 0)] :][:numel]
        parts = [part for part, _ in self.spans(offset, numel)]
        if len(parts) == 1:
            return parts[0]
        view = adjacent_view(parts)
        return view if view is not None else torch.cat(parts)


def main_run(pieces: Pieces) -> tuple[int, ...]:
    """The pieces (indices, in storage order) that lie back to back in one storage over the longest span,
    ties to the first: all of them when they tile one span (``tiling()``); else, with DeepSpeed's ZeRO-1/2
    fragments, all but the few a gap or another storage sets apart (a parameter straddling the partition
    edge keeps its whole size in the buffer; the tail padding is a tensor of its own). Worked out once
    per placement (kept in ``memo``)."""
    found: tuple[int, ...] | None = pieces.memo.get("main run")
    if found is None:
        found = pieces.memo["main run"] = _main_run(pieces)
    return found


def _main_run(pieces: Pieces) -> tuple[int, ...]:
    tiled = pieces.tiling()
    if tiled is not None:
        return tuple(sorted(range(len(pieces.given)), key=lambda k: tiled[1][k]))
    lying = sorted(
        (p.untyped_storage().data_ptr(), int(p.storage_offset()), k)
        for k, p in enumerate(pieces.given)
        if p.is_contiguous() and p.dtype == pieces.dtype and p.numel()
    )
    best: list[int] = []
    run: list[int] = []
    best_numel = numel = 0
    end: tuple[int, int] | None = None
    for storage, offset, k in lying:
        if (storage, offset) != end:
            run, numel = [], 0
        run.append(k)
        numel += pieces.given[k].numel()
        end = (storage, offset + pieces.given[k].numel())
        if numel > best_numel:
            best, best_numel = list(run), numel
    return tuple(best)


def run_view(pieces: Pieces, run: Sequence[int]) -> torch.Tensor:
    """The pieces ``run`` (``main_run``: back to back in storage, in that order) as one 1-D view."""
    first = pieces.given[run[0]]
    found: int | None = pieces.memo.get(("run numel", run[0], len(run)))
    if found is None:
        found = pieces.memo[("run numel", run[0], len(run))] = sum(pieces.given[k].numel() for k in run)
    return _storage_view(first, int(first.storage_offset()), found)


class SameTensors:
    """Whether a list of tensors is the one remembered: the same objects, held weakly (nothing is kept
    alive, and a tensor freed and replaced is never taken for the old one), each with its data where it
    was, of the same size and strides (``.data =`` and ``set_`` re-point a tensor in place, and ``set_``
    checks no bounds). ``gone``: called when a remembered tensor is freed."""

    def __init__(self, gone: Callable[[], None] | None = None) -> None:
        self._refs: tuple[weakref.ref[torch.Tensor], ...] = ()
        self._where: tuple[list[int], list[int], list[tuple[int, ...]]] = ([], [], [])
        self._on_free = None if gone is None else (lambda _ref: gone())

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        # asked once per call of every reader and writer, of hundreds of fragments: in C loops (map), not
        # a Python tuple per tensor
        ptrs, numels, strides = self._where
        return (
            len(self._refs) == len(tensors)
            and list(map(torch.Tensor.data_ptr, tensors)) == ptrs
            and all(map(operator.is_, map(weakref.ref.__call__, self._refs), tensors))
            and list(map(torch.Tensor.numel, tensors)) == numels
            and list(map(torch.Tensor.stride, tensors)) == strides
        )

    def remember(self, tensors: Sequence[torch.Tensor]) -> None:
        self._refs = tuple(weakref.ref(t, self._on_free) for t in tensors)
        self._where = (
            list(map(torch.Tensor.data_ptr, tensors)),
            list(map(torch.Tensor.numel, tensors)),
            list(map(torch.Tensor.stride, tensors)),
        )


class PiecesCache:
    """The Pieces of a fragment list that stays the same between calls (DeepSpeed's ZeRO-1/2 list lives
    from a step's reduction to its ``zero_grad()``; accumulation adds in place): where the fragments lie
    is worked out once per list, not once per call. The fragments are held
    weakly (SameTensors), so the cache never keeps freed gradient memory alive (DeepSpeed allocates
    them anew every step), and a fragment re-pointed or resized in place (as ``offload_states`` does)
    is worked out again."""

    def __init__(self) -> None:
        self._same = SameTensors()
        self._known: Known | None = None

    def pieces(self, fragments: Sequence[torch.Tensor]) -> Pieces:
        if self._known is not None and self._same.matches(fragments):
            return _from_known(fragments, self._known)
        built = Pieces(fragments)
        self._known = _known(built)
        self._same.remember(fragments)
        return built


def _known(pieces: Pieces) -> Known:
    """Where ``pieces`` lie as plain data (no tensor): what a PiecesCache keeps between calls."""
    placed, tiled = pieces.placement(), pieces.tiling() is not None
    if placed is None:
        return (pieces.starts, pieces._numel, None, 0, False, pieces.memo)
    span, offsets = placed
    return (pieces.starts, pieces._numel, offsets, span.numel(), tiled, pieces.memo)


def _from_known(fragments: Sequence[torch.Tensor], known: Known) -> Pieces:
    """Pieces of ``fragments``, which lie where ``known`` says: nothing is worked out again."""
    self = Pieces.__new__(Pieces)
    self.given, self._flat = list(fragments), None  # flattened on first use, as Pieces() does
    self.starts, self._numel, offsets, span_numel, tiled, self.memo = known
    if offsets is None:
        self._placement = self._tiling = None
        return self
    first = self.given[0]
    lo = int(first.storage_offset()) - offsets[0]
    self._placement = (_storage_view(first, lo, span_numel), offsets)
    self._tiling = self._placement if tiled else None
    return self
