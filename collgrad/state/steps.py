"""The steps of a gradient plan as frozen data: pure functions of the layout (and, for a gather of
partitions as they lie, of where every rank's pieces lie). No tensor, no process group: every rank
builds the same steps, and tests need no ranks. The executors (execute.py and the modules it calls)
only move bytes as these say.

  Sent         ZeRO-1/2 gather: what a rank sends, its main run of pieces first
  flat_chunks  ZeRO-1/2 gather laid out by the backend: its collectives, the main runs apart
  flat_views   ZeRO-1/2 gather: the results' views of the gathered buffer, a call per run of them
  ReduceStep   all-reduce: the bucket's size, where each owned fragment goes, the gaps to zero
  CopyPlan     all-reduce: owned fragments copied into the bucket, runs of equal ones in one copy
  SlicesStep   ZeRO-3 / FSDP2 gather: chunks, runs of equal slices, and the result's cuts

A sliced step (ZeRO-3 / FSDP2), ``world`` = 2, slices a (3), b (3), c (2) back to back from ``lo``::

  each rank   | a_r a_r a_r | b_r b_r b_r | c_r c_r |          span = 8
  gathered    | a_0 a_1 | b_0 b_1 | c_0 c_1 |                   rank-major laid out parameter-major
  chunks      [a b] [c]   equal runs: (a, b) one strided copy, (c) another
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from collgrad.state.layout import Fragment, LayoutGroup, ParamSlot, fragment_of, strided_runs

__all__ = [
    "PIPELINE_CHUNKS",
    "COPY_FOR_A_COLLECTIVE",
    "MIN_CHUNK_BYTES",
    "DIRECT_SLICE_BYTES",
    "flat_views",
    "ReduceStep",
    "reduce_step",
    "CopyRows",
    "CopyPlan",
    "copy_plan",
    "Chunk",
    "StridedRun",
    "SlicesStep",
    "slices_step",
    "chunk_slots",
    "ViewRun",
    "view_runs",
    "Sent",
    "sent_pieces",
    "flat_chunks",
]

#: A ZeRO-3 / FSDP2 gather step goes in this many chunks, so that laying out one chunk overlaps
#: gathering the next (measurements: docs/notes/).
PIPELINE_CHUNKS = 4
#: ...but no chunk under this: small steps stay one collective.
MIN_CHUNK_BYTES = 1 << 20
#: A ZeRO-3 / FSDP2 slice of at least this much is gathered alone, straight into its place, where a flat
#: gather would lay it out by a copy: its own collective (~1 ms a round trip here) costs less than copying
#: it out of staging (a 0.45B GPT-2 read: 2.2 s laid out, DeepSpeed's per-parameter loop 1.8 s).
DIRECT_SLICE_BYTES = 2 << 20

#: A ZeRO-1/2 gather copies up to this much more rather than issue one more collective: a round trip of a
#: small Gloo collective costs ~1 ms on the 2-core machine measured, a copy of 1 MiB ~0.1-0.2 ms.
COPY_FOR_A_COLLECTIVE = 1 << 20

#: Per parameter, its (offset, numel) runs in a gathered buffer, in order.
Where = Sequence[Sequence[tuple[int, int]]]


def flat_views(where: Where, batch: tuple[int, ...], shapes: Sequence[tuple[int, ...]]) -> tuple[ViewRun, ...]:
    """The views of a gathered buffer of partitions as they lie for the parameters ``batch`` (indices into
    ``where`` and ``shapes``), by position in the batch: one per parameter that lies in one run; none for
    one that straddles ranks or pieces (its runs are concatenated)."""
    return view_runs([(where[k][0][0] if where[k] else 0, shapes[k]) if len(where[k]) <= 1 else None for k in batch])


class ReduceStep(NamedTuple):
    """One all-reduce step, its parameters back to back in batch order: the bucket's size, this rank's
    fragments with the bucket offset each goes to, and the (offset, numel) ranges no fragment of this
    rank fills (zeroed before the sum)."""

    total: int
    mine: tuple[tuple[Fragment, int], ...]
    gaps: tuple[tuple[int, int], ...]
    #: the results' views of the bucket, by position in the batch
    views: tuple[ViewRun, ...]


def reduce_step(group: LayoutGroup, batch: tuple[int, ...], rank: int) -> ReduceStep:
    """The ``ReduceStep`` of ``batch`` for the rank at position ``rank`` in ``group``."""
    total = 0
    where: dict[int, int] = {}
    for k in batch:
        where[k] = total
        total += group.params[k].numel
    # the batch's own parameters looked at, not every parameter: a stream of many batches stays linear
    found = (fragment_of(group, k, rank) for k in sorted(batch))
    mine = tuple((f, where[f.param] + f.param_offset) for f in found if f is not None)
    gaps: list[tuple[int, int]] = []
    at = 0
    for f, lo in sorted(mine, key=lambda m: m[1]):
        if lo > at:
            gaps.append((at, lo - at))
        at = max(at, lo + f.numel)
    if at < total:
        gaps.append((at, total - at))
    views = view_runs([(where[k], group.params[k].shape) for k in batch])
    return ReduceStep(total, mine, tuple(gaps), views)


@dataclass(frozen=True)
class CopyRows:
    """``count`` equal fragments, ``src_stride`` apart in this rank's storage span from ``src``, copied
    in one call to ``dst + i * dst_stride`` in the bucket (``dst_stride < 0``: DeepSpeed's ZeRO-1/2
    fragments lie back to front, so the i-th lands below the one before)."""

    src: int
    count: int
    numel: int
    src_stride: int
    dst: int
    dst_stride: int


class CopyPlan(NamedTuple):
    """How this rank's fragments go into an all-reduce bucket: ``runs`` of equal fragments (one copy
    each), and the others one by one (``single``: fragment and bucket offset)."""

    runs: tuple[CopyRows, ...]
    single: tuple[tuple[Fragment, int], ...]


def copy_plan(mine: Sequence[tuple[Fragment, int]], spans: Sequence[int | None]) -> CopyPlan:
    """``mine`` (fragments and their bucket offsets) with ``spans[i]``, where the i-th lies in this
    rank's storage span (None: it straddles two pieces): runs of equal fragments equally spaced both
    where they lie and where they go become ``CopyRows``; the others (a lone fragment, one that
    straddles) are copied one by one."""
    placed: list[Fragment] = []
    dsts: list[tuple[Fragment, int]] = []
    single: list[tuple[Fragment, int]] = []
    for (f, at), src in zip(mine, spans):
        if src is None:
            single.append((f, at))
        else:
            placed.append(Fragment(len(dsts), 0, src, f.numel))
            dsts.append((f, at))
    runs: list[CopyRows] = []
    for run in strided_runs(tuple(placed)):
        to = [dsts[placed[i].param][1] for i in run.frags]
        step = to[1] - to[0] if len(to) > 1 else 0
        if len(to) > 1 and abs(step) >= run.numel and all(t == to[0] + i * step for i, t in enumerate(to)):
            runs.append(CopyRows(run.local_offset, run.count, run.numel, run.stride, to[0], step))
        else:
            single += [dsts[placed[i].param] for i in run.frags]
    return CopyPlan(tuple(runs), tuple(single))


@dataclass(frozen=True)
class StridedRun:
    """``count`` equally sized slices (``numel`` each) at a constant distance ``stride`` from ``start``
    (relative to the step's ``lo``): a model's repeated layers, one strided view each side of a gather
    whose backend lays the data out itself."""

    start: int
    stride: int
    numel: int
    count: int


class Chunk(NamedTuple):
    """Part of a sliced step gathered as one bucket: ``span`` elements from ``lo`` (relative to the
    step's ``lo``), cut at parameter edges, and its slices as runs of equal slices equally spaced (a
    model's repeated layers), each laid out parameter-major by one strided copy."""

    lo: int
    span: int
    runs: tuple[StridedRun, ...]


class SlicesStep(NamedTuple):
    """How a step of a sliced group (ZeRO-3, FSDP2) is gathered and laid out. The batch's slices lie
    back to back from ``lo`` (``span`` elements) in each rank's buffer; the result holds each
    parameter's ``world`` slices end to end (``gathered`` elements each, to the next one's start), of
    which its first ``numel`` are the gradient."""

    lo: int
    span: int
    names: tuple[str, ...]
    gathered: tuple[int, ...]
    #: the results' views of the result buffer (a parameter's first ``numel`` of its gathered elements)
    views: tuple[ViewRun, ...]
    chunks: tuple[Chunk, ...]
    strided: tuple[StridedRun, ...]
    #: positions whose slices are gathered alone, straight into place (at least ``DIRECT_SLICE_BYTES``)
    direct: tuple[int, ...]
    #: the others, with where each starts in their concatenation, gathered together and laid out
    #: (empty where no slice is ``direct``: then the step goes by ``chunks``)
    rest: tuple[tuple[int, int], ...]


def slices_step(group: LayoutGroup, batch: tuple[int, ...], element_size: int) -> SlicesStep:
    """The ``SlicesStep`` of ``batch`` (a non-empty run of ``group``'s parameters) for slices of
    ``element_size`` bytes per element."""
    slots = [group.params[k] for k in batch]
    lo = slots[0].offset
    span = slots[-1].offset + slots[-1].slice_numel - lo
    count = max(1, min(PIPELINE_CHUNKS, span * element_size // MIN_CHUNK_BYTES))
    chunks = []
    slices = tuple(Fragment(k, 0, s.offset - lo, s.slice_numel) for k, s in enumerate(slots) if s.slice_numel)
    for c_lo, c_span, members in chunk_slots(slots, lo, count):
        within = set(members)
        inside = tuple(f for f in slices if f.param in within)
        chunks.append(Chunk(c_lo, c_span, _strided(inside)))
    ends = [s.offset for s in slots[1:]] + [lo + span]
    sizes = [end - s.offset for s, end in zip(slots, ends)]  # each slice with its padding, as it lies
    gathered = tuple(group.world * n for n in sizes)
    direct = tuple(k for k, n in enumerate(sizes) if n * element_size >= DIRECT_SLICE_BYTES)
    rest, at = [], 0
    for k, n in enumerate(sizes):
        if n * element_size < DIRECT_SLICE_BYTES:
            rest.append((k, at))
            at += n
    return SlicesStep(
        lo,
        span,
        tuple(s.name for s in slots),
        gathered,
        view_runs([(group.world * (s.offset - lo), s.shape) for s in slots]),
        tuple(chunks),
        _strided(slices),
        direct,
        tuple(rest) if direct else (),
    )


def _strided(slices: tuple[Fragment, ...]) -> tuple[StridedRun, ...]:
    """``slices`` (offsets relative to the step's ``lo``) as runs of equal slices equally spaced."""
    return tuple(StridedRun(r.local_offset, r.stride, r.numel, len(r.frags)) for r in strided_runs(slices))


def chunk_slots(slots: Sequence[ParamSlot], lo: int, count: int) -> list[tuple[int, int, list[int]]]:
    """``slots`` (back to back from ``lo``) cut at parameter edges into about ``count`` chunks of
    similar size: (start relative to ``lo``, elements, member positions) each; together they cover
    the span once, in order."""
    total = slots[-1].offset + slots[-1].slice_numel - lo
    target = -(-total // count)
    chunks: list[tuple[int, int, list[int]]] = []
    start, members = 0, []
    for j, s in enumerate(slots):
        members.append(j)
        end = s.offset + s.slice_numel - lo
        if end - start >= target or j == len(slots) - 1:
            chunks.append((start, end - start, members))
            start, members = end, []
    return chunks


class ViewRun(NamedTuple):
    """Results of one shape at a constant distance in a buffer: ``count`` views of ``shape``, the i-th at
    ``start + i * stride``, made in one call (``as_strided`` then ``unbind``); ``positions``: whose they
    are, in the order made."""

    start: int
    stride: int
    shape: tuple[int, ...]
    positions: tuple[int, ...]


def view_runs(items: Sequence[tuple[int, tuple[int, ...]] | None]) -> tuple[ViewRun, ...]:
    """``items[k]``: where result k starts in a buffer and its shape (None: made otherwise, e.g. one that
    straddles); grouped into ``ViewRun``s, a model's repeated layers a run per kind of tensor, so making
    the views costs a call per run rather than per result."""
    by_shape: dict[tuple[int, ...], list[Fragment]] = {}
    runs = []
    for k, item in enumerate(items):
        if item is not None:
            start, shape = item
            numel = 1
            for n in shape:
                numel *= n
            if not numel:  # empty: no place of its own to tell it from a neighbour by
                runs.append(ViewRun(start, 0, tuple(shape), (k,)))
                continue
            by_shape.setdefault(tuple(shape), []).append(Fragment(k, 0, start, numel))
    for shape, frags in by_shape.items():
        for run in strided_runs(tuple(frags)):
            runs.append(ViewRun(run.local_offset, run.stride, shape, tuple(frags[i].param for i in run.frags)))
    return tuple(sorted(runs))


class Sent(NamedTuple):
    """How a rank sends its partition in a ZeRO-1/2 gather: first ``head`` elements that lie back to back
    in its memory (its ``buffers.main_run``, sent as they lie), then the rest of its pieces end to end
    (concatenated: a parameter straddling the partition edge, the tail padding). ``pieces``: each
    piece as (offset in the partition, offset in what is sent, numel), in the partition's order."""

    head: int
    pieces: tuple[tuple[int, int, int], ...]


def sent_pieces(starts: Sequence[int], numels: Sequence[int], run: Sequence[int]) -> Sent:
    """The ``Sent`` of pieces starting at ``starts`` (in the partition) of ``numels`` elements whose
    main run is the pieces ``run`` (indices, in storage order)."""
    sent = [0] * len(starts)
    at = 0
    for k in run:
        sent[k], at = at, at + numels[k]
    head, members = at, set(run)
    for k in range(len(starts)):
        if k not in members:
            sent[k], at = at, at + numels[k]
    return Sent(head, tuple(zip(starts, sent, numels)))


def flat_chunks(partition: int, head: int, capacity: int, copy_budget: int = 0) -> tuple[tuple[int, int], ...]:
    """How a ZeRO-1/2 gather whose outputs the backend lays out strided goes: (offset, numel) in what
    each rank sends, one collective each, at most ``capacity`` elements. ``head``: what every rank sends
    as it lies in memory (the least of the ranks' heads); every chunk from the one holding the head's end
    on is concatenated by some rank (a collective's input is one contiguous tensor per rank), the rest
    is short (a straddling parameter's part, the padding). The head is cut apart from the rest, unless
    cutting at ``capacity`` alone takes fewer collectives and copies at most ``copy_budget`` elements
    more (a collective's round trip costs more than a short copy). Empty chunks are left out."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    head = max(0, min(head, partition))

    def cut(lo: int, hi: int) -> list[tuple[int, int]]:
        return [(a, min(capacity, hi - a)) for a in range(lo, hi, capacity)]

    def copied(chunks: list[tuple[int, int]]) -> int:
        return partition - next((lo for lo, n in chunks if lo + n > head), partition)

    apart, even = cut(0, head) + cut(head, partition), cut(0, partition)
    if len(even) < len(apart) and copied(even) <= copied(apart) + copy_budget:
        return tuple(even)
    return tuple(apart)
