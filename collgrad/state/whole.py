"""``model_parallel="whole"``: a tensor- or expert-parallel model's state as the unsharded model has it,
on every rank, under the unsharded model's names.

A call's executor makes each parameter whole across its data-parallel group: under tensor parallelism
that is this rank's shard, under expert parallelism this rank's experts. Whole mode goes one step on, a
bucket of those results at a time, one collective per bucket over the model-parallel group:

    tensor-parallel shard along d   every rank of the tensor-parallel group sends its shards of the
                                    bucket (each rank's run padded to the largest rank's: shards may
                                    differ in size), each tensor joined along d in rank order
    expert at local index i         every rank of the expert-parallel group sends its experts; rank
                                    e's is the unsharded model's expert ``e * local_count + i``
    anything else                   whole already (replicated over the model-parallel ranks): as it is

    tensor-parallel 2, a bucket of q (dim 0, 19 | 18 rows) and o (dim 1, 8 | 8 columns):
        rank 0 sends | q0 (19 x 8) | o0 (8 x 8) |          rank 1 | q1 (18 x 8) | o1 (8 x 8) | pad |
        all-gather -> q = cat(q0, q1, dim 0), o = cat(o0, o1, dim 1) on both

The buckets are a pure function of the whole tensors (names, shapes, dtypes) and every rank's shard
sizes, the same on every rank of a model-parallel group (``join_plan``, tested without a process
group), so all run the same collectives in the same order. The statistics combine each shard's
partial sums over the tensor-parallel group and take each expert from its rank (``whole_stats``); the
setters take whole values and each rank writes its own slice (``narrowed``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.backends.ops import Op
from collgrad.core.dispatch import checked_bucket_bytes
from collgrad.core.record import CallRecord
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import TENSOR_PARALLEL, Source
from collgrad.state.layout import ParamSlot, Split

__all__ = [
    "LOCAL",
    "WHOLE",
    "checked_mode",
    "refuse_unplaced",
    "whole_name",
    "laid_out",
    "others",
    "whole_order",
    "fingerprint",
    "JoinBucket",
    "join_plan",
    "Joiner",
    "narrowed",
    "whole_stat_rows",
]

#: ``model_parallel=`` values: this rank's tensor- or expert-parallel shards as they are (the frameworks'
#: accessors' answer), or every tensor as the unsharded model has it.
LOCAL, WHOLE = "local", "whole"


def checked_mode(mode: object) -> bool:
    """Whether ``model_parallel=`` asks for whole tensors; InvalidArgumentError (this rank) for a value
    that is neither mode."""
    if mode not in (LOCAL, WHOLE):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: model_parallel must be {LOCAL!r} (this rank's tensor- or expert-parallel "
            f"shards) or {WHOLE!r} (every tensor as the unsharded model has it), got {mode!r}"
        )
    return mode == WHOLE


def refuse_unplaced(source: Source) -> None:
    """InvalidArgumentError (this rank) for a model-parallel shard the source cannot place in its whole
    tensor: whole reads and checkpoints hold whole tensors only."""
    unplaced = sorted(source.model_parallel - source.splits.keys() - source.experts.keys())
    if unplaced:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {unplaced[0]} is a model-parallel shard collgrad cannot place in its whole "
            "tensor (a fused tensor-parallel layout, an expert under both expert and tensor parallelism, a DTensor "
            "sharded along more than one dimension): whole reads and checkpoints hold whole tensors of "
            "data-parallel models, of tensor-parallel shards that are one slice of one dimension (AutoTP's column "
            "and row splits, DTensor's Shard(d)) and of MoE experts spread over expert-parallel ranks; read such a "
            "model with model_parallel='local', save it with its framework's own checkpointing"
        )


def whole_name(source: Source, name: str) -> str:
    """Parameter ``name`` of ``source`` as the unsharded model names it (an expert by its global index)."""
    expert = source.experts.get(name)
    return expert.name if expert is not None else name


def laid_out(source: Source) -> list[tuple[ParamSlot, str, tuple[int, ...]]]:
    """Every tensor of the unsharded model ``source``'s parameters stand for, as every rank lays them
    out alike: per parameter of its layout, in order, the parameter and its whole tensors' names and
    shapes (a tensor-parallel shard's whole tensor; an expert of every expert-parallel rank at its local
    index, this rank's among them). Local."""
    splits = source.splits
    out = []
    for group in source.layout.groups:
        for slot in group.params:
            shape = splits[slot.name].whole if slot.name in splits else slot.shape
            expert = source.experts.get(slot.name)
            out += [(slot, name, shape) for name in (expert.names if expert is not None else (slot.name,))]
    return out


def others(source: Source) -> list[str]:
    """The tensors of the unsharded model ``source``'s parameters stand for of which no part is this
    rank's (other expert-parallel ranks' experts): in a checkpoint or a whole write, theirs. Local."""
    return [name for slot, name, _ in laid_out(source) if name != whole_name(source, slot.name)]


def whole_order(source: Source, names: Iterable[str]) -> list[str]:
    """``names`` (this rank's, in model order) as the unsharded model orders its tensors: each run of a
    MoE layer's experts (local indexes ``i``) becomes every expert-parallel rank's run in rank order
    (global indexes ``e * local_count + i``: ``named_parameters()`` order at ``ep_size`` 1). Pure."""
    out: list[str] = []
    run: list[str] = []
    for name in [*names, ""]:
        expert = source.experts.get(name)
        first = source.experts[run[0]] if run else None
        # a run ends where its MoE layer's experts end
        if first is not None and (expert is None or (expert.group, expert.layer) != (first.group, first.layer)):
            out += [source.experts[n].names[e] for e in range(len(first.names)) for n in run]
            run = []
        if expert is not None:
            run.append(name)
        elif name:
            out.append(name)
    return out


def fingerprint(source: Source) -> int:
    """A number every rank of the model computes alike where the unsharded model is the same: its
    tensors' names and shapes and the layout's dtypes (compared before a whole call moves anything,
    over every rank of the model: their shards' layouts legitimately differ)."""
    dtypes = [(str(g.wire_dtype), str(g.out_dtype)) for g in source.layout.groups]
    return stable_hash(repr((source.layout.variant, [(n, s) for _, n, s in laid_out(source)], dtypes)))


@dataclass(frozen=True)
class JoinBucket:
    """One collective of whole mode: the model-parallel set ``group`` (``Source.parallel_groups``' name),
    the parameters it makes whole (this rank's names), per parameter the elements each rank of the set
    sends and where in that rank's run they lie, every rank's run's length (``width``) and the dtype."""

    group: str
    members: tuple[str, ...]
    counts: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    width: int
    dtype: torch.dtype


def join_plan(
    named: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    splits: Mapping[str, Split],
    experts: Mapping[str, Any],
    bucket_bytes: int,
) -> tuple[JoinBucket, ...]:
    """The collectives that make ``named`` (this rank's parameters in call order: name, its shape here,
    the results' dtype) whole: its tensor-parallel shards (``splits``, whose ``bounds`` give every rank's
    size) and experts (``experts``), in order, consecutive ones of the same set and dtype in one bucket
    while the whole tensors fit ``bucket_bytes`` (a larger one alone). The same on every rank of a set.
    Pure."""
    out: list[JoinBucket] = []
    current: list[tuple[str, tuple[int, ...]]] = []
    key: tuple[str, torch.dtype] | None = None
    size = 0

    def close() -> None:
        if current and key is not None:
            ranks = len(current[0][1])
            offsets = [[0] * ranks]
            for _, counts in current[:-1]:
                offsets.append([at + n for at, n in zip(offsets[-1], counts)])
            ends = [at + n for at, n in zip(offsets[-1], current[-1][1])]
            members = tuple(n for n, _ in current)
            sizes = tuple(c for _, c in current)
            out.append(JoinBucket(key[0], members, sizes, tuple(map(tuple, offsets)), max(ends), key[1]))

    for name, shape, dtype in named:
        split, expert = splits.get(name), experts.get(name)
        if split is not None:
            group = TENSOR_PARALLEL
            counts = tuple(math.prod(split.shard_shape(r)) for r in range(len(split.bounds) - 1))
        elif expert is not None:
            group, counts = expert.group, (math.prod(shape),) * len(expert.names)
        else:
            continue
        whole = sum(counts) * dtype.itemsize
        if key != (group, dtype) or (current and size + whole > bucket_bytes):
            close()
            current, key, size = [], (group, dtype), 0
        current.append((name, counts))
        size += whole
    close()
    return tuple(out)


class Joiner:
    """A call's results made whole (the module's docstring): ``feed`` takes each step's results and
    returns those whole so far, in the order they came (a tensor already whole waits only for shards
    before it, whose bucket is not complete yet: about a bucket; an expert's whole tensors where it
    was). Collective: every rank of each model-parallel set feeds every step alike."""

    def __init__(self, source: Source, names: Sequence[str], run: Callable[..., CallRecord], bucket_bytes: int) -> None:
        """``names``: the call's parameters in result order; ``run``: ``OpenCall.run``."""
        self.source = source
        self._run = run
        dtypes = {s.name: g.out_dtype for g in source.layout.groups for s in g.params}
        shapes = self._shapes = {s.name: s.shape for g in source.layout.groups for s in g.params}
        key = ("join plan", tuple(names), bucket_bytes)
        plan = source.scratch.get(key)
        if plan is None:
            named = [(n, shapes[n], dtypes[n]) for n in names]
            plan = source.scratch[key] = join_plan(
                named, source.splits, source.experts, checked_bucket_bytes(bucket_bytes)
            )
        self.plan: tuple[JoinBucket, ...] = plan
        #: The shards this joins: their results are copied into its gathers (the executor need not copy them).
        self.members = frozenset(name for bucket in plan for name in bucket.members)
        self._waiting: dict[str, torch.Tensor] = {}  # shards, until their bucket is complete
        self._joined: dict[str, list[tuple[str, torch.Tensor]]] = {}  # by shard: what it was made whole into
        self._queue: deque[tuple[str, torch.Tensor | None]] = deque()  # results in order; None: a shard
        self._next = 0
        self.calls: list[CallRecord] = []

    def feed(self, results: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        for name, tensor in results:
            if name in self.members:
                self._waiting[name] = tensor
                self._queue.append((name, None))
            else:
                self._queue.append((name, tensor))
        while self._next < len(self.plan) and all(n in self._waiting for n in self.plan[self._next].members):
            self._joined.update(self._join(self._next))
            self._next += 1
        out: list[tuple[str, torch.Tensor]] = []
        while self._queue and (self._queue[0][1] is not None or self._queue[0][0] in self._joined):
            name, held = self._queue.popleft()
            out += [(name, held)] if held is not None else self._joined.pop(name)
        return out

    def done(self) -> bool:
        return self._next == len(self.plan)

    def _join(self, k: int) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Bucket ``k``'s shards made whole, by shard: the whole tensor, or every rank's expert."""
        bucket, source = self.plan[k], self.source
        group = source.parallel_groups[bucket.group]
        me, ranks = torch.distributed.get_rank(group), len(bucket.counts[0])
        mine = [self._waiting.pop(name).reshape(-1) for name in bucket.members]
        device = mine[0].device
        sizes = [[c[r] for c in bucket.counts] for r in range(ranks)]  # each rank's run: its shards, padding
        pad = [bucket.width - sum(s) for s in sizes]
        if pad[me]:
            mine.append(torch.zeros(pad[me], dtype=bucket.dtype, device=device))
        sent = torch.empty(bucket.width, dtype=bucket.dtype, device=device)
        torch.cat(mine, out=sent)  # one copy of every shard (a copy each costs ~4x in calls)
        got = torch.empty(ranks * bucket.width, dtype=bucket.dtype, device=device)
        self.calls.append(self._run(("whole", k), Op.ALL_GATHER, [sent], [got], group))
        rows = got.view(ranks, bucket.width)
        # every rank's shards as views, one split per rank
        parts = [rows[r].split_with_sizes(sizes[r] + [pad[r]] if pad[r] else sizes[r]) for r in range(ranks)]
        out: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for m, name in enumerate(bucket.members):
            split = source.splits.get(name)
            if split is None:
                shape = self._shapes[name]  # the layout's (a ZeRO-3 parameter's own is empty outside a gather)
                out[name] = [(n, parts[r][m].view(shape)) for r, n in enumerate(source.experts[name].names)]
            elif math.prod(split.whole[: split.dim]) == 1:  # dim 0 (or ones before it): shards follow each other
                out[name] = [(name, torch.cat([parts[r][m] for r in range(ranks)]).view(split.whole))]
            else:
                shards = [parts[r][m].view(split.shard_shape(r)) for r in range(ranks)]
                out[name] = [(name, torch.cat(shards, split.dim))]
        return out


def narrowed(source: Source, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole values (by the unsharded model's names, every rank given the same) as what this rank
    writes, by its own names: each tensor-parallel shard's slice, each of its experts, the rest as
    given; another rank's experts are theirs to write. A name the unsharded model lacks stays, for the
    write's own check to name. Local."""
    mine = {whole_name(source, n): n for n in source.params}
    theirs = set(others(source))
    out: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        here = mine.get(name)
        if here is None:
            if name not in theirs:
                out[name] = value
            continue
        split = source.splits.get(here)
        if split is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == split.whole:
            value = value.narrow(split.dim, split.lo, split.hi - split.lo)
        out[here] = value
    return out


def whole_stat_rows(
    source: Source, names: Sequence[str], rows: torch.Tensor, run: Callable[..., CallRecord], calls: list[CallRecord]
) -> dict[str, torch.Tensor]:
    """Per-parameter statistics of whole tensors from this rank's (``rows``: per name of ``names``, its
    sum of squares, max |x|, non-finite count, element count, float64): a tensor-parallel shard's summed
    (max taken) over the tensor-parallel group in rank order, every expert taken from its rank, one
    small all-gather per set; by the unsharded model's names. Collective over each set."""
    out = {n: rows[k] for k, n in enumerate(names)}
    sets: dict[str, list[int]] = {}
    for k, name in enumerate(names):
        expert = source.experts.get(name)
        set_name = TENSOR_PARALLEL if name in source.splits else expert.group if expert is not None else None
        if set_name is not None:
            sets.setdefault(set_name, []).append(k)
    for set_name in sorted(sets):  # the same order on every rank
        picked = sets[set_name]
        group = source.parallel_groups[set_name]
        size = torch.distributed.get_world_size(group)
        device = _compat.agreement_device(source.device.type)
        mine = rows[picked].reshape(-1).to(device)
        got = torch.empty(size * mine.numel(), dtype=mine.dtype, device=device)
        calls.append(run(("whole stats", set_name), Op.ALL_GATHER, [mine], [got], group))
        every = got.cpu().view(size, len(picked), -1)
        for j, k in enumerate(picked):
            name = names[k]
            if name in source.splits:
                total = every[0, j].clone()
                for r in range(1, size):  # a fixed order: every rank adds the same numbers the same way
                    total[0] += every[r, j, 0]
                    total[2:] += every[r, j, 2:]
                total[1] = every[:, j, 1].amax()  # propagates NaN
                out[name] = total
            else:
                del out[name]
                out.update((n, every[r, j]) for r, n in enumerate(source.experts[name].names))
    return out
