"""Where every rank's share of each parameter lies, for any kind of state: plain data, the same on every
rank, built once per source by its adapter and consumed by every reader, stream, writer, statistic,
save and the drop-in. The kinds of state (collgrad/state/kinds.py: gradients, fp32 masters, optimizer
states, module weights) lie as the parameters do, so one layout type serves them all; a group's wire
dtype is the local tensors' of the kind the source reads.

Three partitionings cover DeepSpeed's optimizers and FSDP2 (docs/notes/deepspeed-gradient-layout.md)::

  PARTITIONED_FLAT (ZeRO-1/2): one flat buffer per optimizer param group, padded so that every rank
  owns an equal contiguous partition of P elements. Parameters may straddle partition edges.

      flat    | a a a a a b b b c c c c c c c . |   (. = tail padding, zero)
      ranks   | rank 0: [0, 8)  | rank 1: [8, 16) |   P = 8
      a: offset 0, b: offset 5 (rank 0), c: offset 8 (rank 1), 7 elements

  SLICED (ZeRO-3, FSDP2): every parameter is cut into world equal slices of ceil(numel / world) elements
  (the last zero-padded); rank r's buffer holds slice r of every parameter, back to back.

      rank r  | a_r a_r a_r | b_r b_r | c_r c_r c_r c_r |     offsets 0, 3, 5 on every rank
      a       = a_0 + a_1 + ... (concatenated), cut to a.numel

  REPLICATED (BF16_Optimizer, no ZeRO, a plain module, weights below ZeRO-3): every rank already
  holds every parameter's state whole.

A rank's local buffer for a group is one contiguous tensor of P elements (PARTITIONED_FLAT,
SLICED) in the group's wire dtype. Nothing here touches a process group.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from collgrad._compat import maker
from collgrad.backends.ops import ValueEnum

__all__ = [
    "Partitioning",
    "ParamSlot",
    "Split",
    "Expert",
    "LayoutGroup",
    "StateLayout",
    "Fragment",
    "owned_fragments",
    "fragment_of",
    "Run",
    "strided_runs",
    "gathered_runs",
]


class Partitioning(ValueEnum):
    PARTITIONED_FLAT = "partitioned_flat"
    SLICED = "sliced"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    numel: int
    #: PARTITIONED_FLAT: start in the group's flat buffer; SLICED: start in every rank's buffer.
    offset: int
    #: SLICED: elements of each rank's slice; otherwise ``numel``.
    slice_numel: int
    #: A tensor- or expert-parallel shard: reconstructed across the data-parallel group only.
    model_parallel_shard: bool = False


class Split(NamedTuple):
    """Where this rank's tensor-parallel shard of a parameter lies in the whole tensor: indexes
    ``[lo, hi)`` of dimension ``dim`` of a tensor of shape ``whole`` (``whole.narrow(dim, lo, hi - lo)``
    is the shard). The ranks of the parameter's data-parallel group hold the same shard. ``bounds``:
    where every tensor-parallel rank's shard starts along ``dim``, in rank order, and the end (shards
    may differ in size: AutoTP cuts a vocabulary unevenly); empty where not known."""

    dim: int
    whole: tuple[int, ...]
    lo: int
    hi: int
    bounds: tuple[int, ...] = ()

    def shard_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """The shard's shape: this rank's, or tensor-parallel rank ``rank``'s (from ``bounds``)."""
        size = self.hi - self.lo if rank is None else self.bounds[rank + 1] - self.bounds[rank]
        return self.whole[: self.dim] + (size,) + self.whole[self.dim + 1 :]


class Expert(NamedTuple):
    """An expert of a MoE layer whose experts are spread over expert-parallel ranks, each rank holding
    its own experts whole under local indexes: the unsharded model's name of the expert at this local
    index on each expert-parallel rank (``names[e]``: global index ``e * local_count + i``), this rank's
    position among them (its index in the expert-parallel group), and the global ranks that hold this
    rank's experts (its expert-data-parallel group)."""

    names: tuple[str, ...]
    position: int
    holders: tuple[int, ...]
    #: The model-parallel set its expert-parallel group is (``Source.parallel_groups``).
    group: str = ""
    #: Its MoE layer (the module holding the layer's experts): a run of experts ends where it changes.
    layer: str = ""

    @property
    def name(self) -> str:
        """This rank's expert's name in the unsharded model."""
        return self.names[self.position]


@dataclass(frozen=True)
class LayoutGroup:
    index: int
    kind: Partitioning
    group_ranks: tuple[int, ...]  # global ranks of the group the partitions are spread over
    partition_numel: int  # P: elements of every rank's local buffer
    wire_dtype: torch.dtype  # dtype of the local buffers
    out_dtype: torch.dtype  # dtype of the returned gradients
    params: tuple[ParamSlot, ...]

    @property
    def world(self) -> int:
        return len(self.group_ranks)

    @functools.cached_property
    def flat_index(self) -> FlatIndex:
        """The parameters by where they start in a PARTITIONED_FLAT group's flat buffer: built once."""
        order = sorted(range(len(self.params)), key=lambda k: (self.params[k].offset, self.params[k].numel))
        ends = tuple(self.params[k].offset + self.params[k].numel for k in order)
        return FlatIndex(tuple(order), tuple(self.params[k].offset for k in order), ends)


@dataclass(frozen=True)
class StateLayout:
    """Every group, and the result order (``engine.module.named_parameters()`` order)."""

    variant: str
    groups: tuple[LayoutGroup, ...]
    order: tuple[str, ...]

    def fingerprint(self) -> int:
        """A number that differs when names, shapes, dtypes, groups or offsets differ; ranks compare it
        before moving any data (a mismatch would otherwise scramble results or hang). Computed once."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> int:
        # Group sizes, not members: expert-parallel ranks legitimately sit in different expert groups.
        text = repr(
            (
                self.variant,
                self.order,
                [
                    (g.kind, g.world, g.partition_numel, str(g.wire_dtype), str(g.out_dtype), g.params)
                    for g in self.groups
                ],
            )
        )
        return zlib.crc32(text.encode())


class Fragment(NamedTuple):
    """Elements ``[param_offset, param_offset + numel)`` of ``param`` are at ``local_offset`` in this
    rank's local buffer. A tuple: a rank's plans make one for each tensor it holds a part of, 40,000 a
    kind for a 3.9B-parameter model (made at C speed)."""

    param: int
    param_offset: int
    local_offset: int
    numel: int


_fragment = maker(Fragment)


def owned_fragments(group: LayoutGroup, rank_in_group: int) -> tuple[Fragment, ...]:
    """The parts of each parameter this rank holds (padding excluded), in parameter order. Over all
    ranks, every element of every parameter is held exactly once. Costs what the rank holds: a
    partition's parameters are found by bisection of the flat buffer's offsets (``FlatIndex``), not
    by a scan of every parameter, so that the ranks' fragments of a 40,000-tensor model at 1,024 ranks
    are 40,000 looks in all, not 40 million."""
    if group.kind is Partitioning.PARTITIONED_FLAT:
        lo, hi = rank_in_group * group.partition_numel, (rank_in_group + 1) * group.partition_numel
        found = (fragment_of(group, k, rank_in_group) for k in group.flat_index.overlapping(lo, hi))
        return tuple(f for f in found if f is not None)
    if group.kind is Partitioning.SLICED:  # fragment_of's slices, without a call a parameter (40,000 a kind)
        return tuple(
            _fragment((k, start, p.offset, min(p.slice_numel, p.numel - start)))
            for k, p in enumerate(group.params)
            if p.slice_numel and (start := rank_in_group * p.slice_numel) < p.numel
        )
    return tuple(Fragment(k, 0, 0, p.numel) for k, p in enumerate(group.params))


def fragment_of(group: LayoutGroup, param: int, rank_in_group: int) -> Fragment | None:
    """The part of parameter ``param`` (its index in ``group.params``) that rank ``rank_in_group`` holds,
    or None where it holds none: one look, for a step that wants only its batch's parameters."""
    p = group.params[param]
    if group.kind is Partitioning.PARTITIONED_FLAT:
        lo = rank_in_group * group.partition_numel
        start, end = max(p.offset, lo), min(p.offset + p.numel, lo + group.partition_numel)
        return Fragment(param, start - p.offset, start - lo, end - start) if start < end else None
    if group.kind is Partitioning.SLICED:
        start = rank_in_group * p.slice_numel
        numel = min(p.slice_numel, p.numel - start)
        return Fragment(param, start, p.offset, numel) if numel > 0 else None
    return Fragment(param, 0, 0, p.numel)


class FlatIndex(NamedTuple):
    """A PARTITIONED_FLAT group's parameters by where they start in the flat buffer, whatever their order
    in the group (DeepSpeed lays them out in order): their indexes, and the offsets they start and end
    at, both ascending because parameters of a flat buffer never overlap (an invariant of the layout)."""

    order: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """The parameters with an element in ``[lo, hi)`` of the flat buffer, in parameter order."""
        first = bisect.bisect_right(self.ends, lo)  # the first that ends after lo
        last = bisect.bisect_left(self.starts, hi)  # the first that starts at or after hi
        return sorted(self.order[first:last])


@dataclass(frozen=True)
class Run:
    """``count`` fragments of ``numel`` elements each, the i-th at ``local_offset + i * stride`` in the
    local buffer (``stride >= numel``): one strided 2-D view, reduced row by row in one call. ``frags``:
    their positions in the fragment tuple they came from."""

    frags: tuple[int, ...]
    local_offset: int
    stride: int
    numel: int

    @property
    def count(self) -> int:
        return len(self.frags)


def strided_runs(frags: tuple[Fragment, ...], candidates: int = 8) -> tuple[Run, ...]:
    """``frags`` as runs of equally sized fragments at a constant distance, so that per-fragment
    reductions cost a call per run rather than per fragment. A model's blocks repeat: the same layer of
    every block lies one block apart, so a few runs cover them all. Every fragment is in exactly one run
    (a run of one where nothing fits). Greedy, at plan time: from the lowest free fragment of a size,
    the longest progression over the distances to the next ``candidates`` free ones."""
    by_size: dict[int, dict[int, int]] = {}
    for i, f in enumerate(frags):
        by_size.setdefault(f.numel, {})[f.local_offset] = i
    runs = []
    for numel, at in by_size.items():
        offsets = sorted(at)
        free = set(offsets)
        for k, start in enumerate(offsets):
            if start not in free:
                continue
            best = [start]
            later = (o for o in offsets[k + 1 :] if o in free)
            for _, nxt in zip(range(candidates), later):
                step = nxt - start
                if step < numel:  # rows of a 2-D view must not overlap
                    continue
                seq, o = [start], start + step
                while o in free:
                    seq.append(o)
                    o += step
                if len(seq) > len(best):
                    best = seq
            free.difference_update(best)
            stride = best[1] - best[0] if len(best) > 1 else numel
            runs.append(Run(tuple(at[o] for o in best), start, stride, numel))
    return tuple(sorted(runs, key=lambda r: r.local_offset))


def gathered_runs(group: LayoutGroup, placements: list[list[tuple[int, int, int]]]) -> list[list[tuple[int, int]]]:
    """Where each parameter of a PARTITIONED_FLAT group lies in the gather of every rank's partition as
    it lies in memory: per parameter, its (offset, numel) runs in the gathered buffer, in order.
    ``placements[r]``: rank r's pieces as (offset in its partition, offset in what it sent, numel)."""
    out: list[list[tuple[int, int]]] = [[] for _ in group.params]
    for r, pieces in enumerate(placements):
        pieces = sorted(p for p in pieces if p[2])  # an empty piece holds nothing (and would be found first)
        starts = [p[0] for p in pieces]
        base = r * group.partition_numel
        for f in owned_fragments(group, r):
            at, left = f.local_offset, f.numel
            while left:
                j = bisect.bisect_right(starts, at) - 1
                start, sent, numel = pieces[j]
                n = min(left, start + numel - at)
                runs = out[f.param]
                where = base + sent + at - start
                if runs and runs[-1][0] + runs[-1][1] == where:  # continues the previous run
                    runs[-1] = (runs[-1][0], runs[-1][1] + n)
                else:
                    runs.append((where, n))
                at, left = at + n, left - n
    return out
