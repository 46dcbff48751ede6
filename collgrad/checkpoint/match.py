"""A model as a checkpoint sees it, and the one check of a checkpoint against it.

    opened(ctx, model, kind, ...)   one kind of the model's state opened (its source, this rank's view
                                    of it), checked to be readable here
    held(sources, buffers)          what this rank holds, as the plan's holdings (data): a tensor-parallel
                                    shard's as elements of its whole tensor, an expert under its global
                                    name; memory(...): the memory behind them (storage.py resolves one
                                    against the other); planned_reads(...): a load's items, what the
                                    ranks hold alike read once between them; reads(...): its plan
    laid_out(source), shapes(...)   the tensors a checkpoint of the model holds, named and shaped as the
                                    unsharded model has them (every rank's experts; this rank's)
    match(...)                      a checkpoint's tensors against the model's names and shapes: a tied
                                    weight under any of its names, a shape that differs refused, keys on
                                    one side only named (``refuse_unmatched``: with strict, refused)

Every refusal is ``refused`` (safetensors.py): a CheckpointError naming this rank, the file and why,
raised before anything changes. Local: the jobs agree on the verdict between ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from collgrad import _compat
from collgrad.checkpoint import storage
from collgrad.checkpoint.plan import (
    LOCAL_CALL_SECONDS,
    WHOLE,
    Held,
    Holding,
    IoCosts,
    Ranges,
    ReadExchange,
    ReadItem,
    SharedRead,
    holdings,
    in_whole,
    small_slices,
    split_reads,
)
from collgrad.checkpoint.safetensors import Stored, refused
from collgrad.checkpoint.storage import LoadPlan, Memory, load_plan
from collgrad.errors import InvalidArgumentError, LayoutChangedError
from collgrad.state import adapters
from collgrad.state.adapters.base import LocalGrads, Problem, Source, rank_in
from collgrad.state.kinds import StateKind
from collgrad.state.layout import Expert, StateLayout
from collgrad.state.model_cache import Context
from collgrad.state.whole import laid_out, others, refuse_unplaced, whole_name

__all__ = [
    "Opened",
    "opened",
    "refuse_layout",
    "refuse_unplaced",
    "refuse_unshared_shards",
    "held",
    "SHARD_HOLDERS",
    "expert_holders",
    "holders",
    "shapes",
    "others",
    "memory",
    "Reads",
    "SHARED_MIN_BYTES",
    "shared_min_bytes",
    "io_costs",
    "plain_kinds",
    "planned_reads",
    "reads",
    "persistent_buffers",
    "Matched",
    "match",
    "refuse_unmatched",
    "listed",
]


@dataclass(frozen=True)
class Opened:
    """One kind of a model's state as this rank holds it: the file stem it is saved under (``model``,
    ``fp32``, ``optimizer-<k>``), the kind, its source and this rank's view of it."""

    stem: str
    kind: StateKind
    source: Source
    local: LocalGrads


def opened(
    ctx: Context,
    model: adapters.Model,
    stem: str,
    kind: StateKind,
    optimizer: Any = None,
    names: Sequence[str] | None = None,
    *,
    loading: bool = False,
) -> Opened:
    """The source of ``kind`` of ``names`` (None: every parameter) and this rank's view of it, checked to
    be readable (``loading``: writable) in place; InvalidArgumentError (a tensor- or expert-parallel
    shard) or LayoutChangedError (this rank) otherwise."""
    source = ctx.source(model, kind, optimizer, names)[0]
    refuse_unplaced(source)
    local = source.read()
    if local.problem is not Problem.OK:
        how = "written here" if loading else "read here"
        raise LayoutChangedError(
            f"rank {_compat.rank()}: the {kind.describe()} cannot be {how} ({local.problem.describe()}"
            f"{'; ' + local.detail if local.detail else ''}){'; nothing was loaded' if loading else ''}"
        )
    return Opened(stem, kind, source, local)


def refuse_layout(model: adapters.Model) -> None:
    """InvalidArgumentError (this rank) for a model held in a parallel layout a whole-model checkpoint
    does not support (``Model.unsupported_layout``), naming its first parameter and the layout."""
    layout = model.unsupported_layout()
    if layout is not None:
        first = next((n for n, _ in model.module.named_parameters()), "its first parameter")
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {first} is held under {layout}, which collgrad's whole-model checkpoints "
            "do not support: save and load this model with its framework's own checkpointing "
            "(engine.save_checkpoint / load_checkpoint)"
        )


def refuse_unshared_shards(sources: Iterable[Source], able: bool, needs: str) -> None:
    """InvalidArgumentError (this rank) where ``sources`` hold tensor- or expert-parallel shards and the
    ranks cannot write them into their whole tensors' places (``able`` False: the caller's verdict, the
    same on every rank); ``needs`` says what it takes."""
    if not able and any(source.splits or source.experts for source in sources):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: the model holds tensor- or expert-parallel shards, which their holders write "
            f"into the whole tensors' places: {needs}"
        )


def held(
    sources: Sequence[Opened], buffers: Sequence[tuple[str, torch.Tensor]], *, loading: bool = False
) -> list[Holding]:
    """What this rank holds of ``sources`` (and of ``buffers``, with the first: the module's weights), as
    the plan's holdings; ``memory`` gives the memory behind them, by the same indexes. ``loading``: with
    what it holds whole besides (ZeRO-3's persistent parameters, which a load writes too), and through
    its setter what collgrad reads only through DeepSpeed's accessors. Local."""
    out: list[Holding] = []
    for k, one in enumerate(sources):
        source = one.source
        whole = tuple((n, tuple(t.shape)) for n, t in _whole(source, buffers if k == 0 else (), loading))
        setter = loading and source.accessor_set is not None
        # a pure function of the source's layout and this rank: kept with the source (a save or load
        # asks it again of the same layout each time)
        key = ("holdings", one.stem, k, whole, setter, loading)
        found = source.scratch.get(key)
        if found is None or found[0] is not source.layout:
            ranks = [rank_in(group) for group in source.layout.groups]
            mine = holdings(one.stem, k, source.layout, ranks, whole, setter)
            found = source.scratch[key] = (source.layout, _in_whole(mine, source, loading))
        out += found[1]
    return out


#: ``Holding.among`` of a tensor-parallel shard held whole: the ranks of its data-parallel group hold it.
SHARD_HOLDERS = "tensor-parallel shard"


def expert_holders(expert: Expert) -> str:
    """``Holding.among`` of an expert held whole: the ranks of its expert-data-parallel group hold it
    (named by them: MoE layers of different ``ep_size`` have different groups)."""
    return f"experts of ranks {','.join(map(str, expert.holders))}"


def _in_whole(mine: list[Holding], source: Source, loading: bool) -> list[Holding]:
    """``mine`` (a source's holdings, each in its own tensor's elements) as elements of the whole
    tensors: a tensor-parallel shard's mapped into its slice (``in_whole``), held alike by the ranks of
    its data-parallel group where it is held whole; an expert's under its name in the unsharded model,
    held alike by its expert-data-parallel group where held whole. A save writes what every shard holds
    of a tensor that is not split once: from the first tensor-parallel rank's fragments (another's
    partitions may be cut elsewhere: uneven shards make the ranks' flat buffers differ); a load reads
    them everywhere."""
    if not source.splits and not source.experts:
        return mine
    out: list[Holding] = []
    for holding in mine:
        expert = source.experts.get(holding.tensor)
        if expert is not None:
            among = expert_holders(expert) if holding.replica else holding.among
            out.append(holding._replace(tensor=expert.name, among=among))
            continue
        split = source.splits.get(holding.tensor)
        if split is None:
            if loading or holding.replica or source.tensor_parallel_rank == 0:
                out.append(holding)
            continue
        pieces = in_whole(holding, split)
        out += [p._replace(among=SHARD_HOLDERS) for p in pieces] if holding.replica else pieces
    return out


def holders(sources: Iterable[Source]) -> dict[str, tuple[int, int]]:
    """The sets of ranks ``held``'s replicas name besides every rank (``plan.write_items``' ``among``),
    each as this rank's index among them and how many they are: the holders of its tensor-parallel
    shards (its data-parallel group: the layout's group that holds them) and of its experts (each MoE
    layer's expert-data-parallel group). Local."""
    out: dict[str, tuple[int, int]] = {}
    me = _compat.rank()
    for source in sources:
        splits = source.splits
        for group in source.layout.groups:
            if SHARD_HOLDERS not in out and any(slot.name in splits for slot in group.params):
                out[SHARD_HOLDERS] = (group.group_ranks.index(me), len(group.group_ranks))
        for expert in source.experts.values():
            out.setdefault(expert_holders(expert), (expert.holders.index(me), len(expert.holders)))
    return out


def shapes(source: Source) -> dict[str, tuple[int, ...]]:
    """Each parameter of ``source``'s layout this rank holds a part of, in order, named and shaped as the
    unsharded model has it (a tensor-parallel shard's whole tensor; an expert by its global index): what
    a load matches a checkpoint against. Local."""
    return {name: shape for slot, name, shape in laid_out(source) if name == whole_name(source, slot.name)}


def memory(
    sources: Sequence[Opened], buffers: Sequence[tuple[str, torch.Tensor]], *, loading: bool = False
) -> list[Memory]:
    """The memory behind ``held``'s holdings, by the same indexes: each source's local buffers, the
    tensors it holds whole, its setter. Local."""
    out = []
    for k, one in enumerate(sources):
        tensors = [t for _, t in _whole(one.source, buffers if k == 0 else (), loading)]
        setter = _setter(one.source) if loading and one.source.accessor_set is not None else None
        out.append(Memory(one.local.buffers, tensors, setter))
    return out


def _whole(
    source: Source, buffers: Sequence[tuple[str, torch.Tensor]], loading: bool
) -> list[tuple[str, torch.Tensor]]:
    """What a source holds whole outside its layout: with ``loading``, ZeRO-3's persistent parameters;
    then ``buffers``."""
    return [*(source.held_whole().items() if loading else ()), *buffers]


class Reads(NamedTuple):
    """A load's reads on this rank: what it reads alone (its holdings' read items), and what every rank
    of its group holds alike, read once between them (``plan.shared_reads``' windows:
    ``storage.read_shared``); ``position``: this rank's in the group; ``key``: what the items depend on
    beyond the memory (its last two: the costs and the least bytes shared, the plan's choices)."""

    own: list[ReadItem]
    shared: list[SharedRead]
    position: int
    key: Hashable
    #: per window of ``shared``, this rank's own items that lie in its turn of the window's bytes, each
    #: with where its bytes start in its part: put in place from there, not read a second time
    from_turn: tuple[tuple[tuple[ReadItem, int], ...], ...] = ()
    #: the windows of small pieces read by one rank each and moved to their holders (plan.exchanged_reads)
    exchanged: tuple[ReadExchange, ...] = ()

    def fingerprint(self) -> tuple[object, ...]:
        """What every rank's reads must have alike (the gathers and exchanges are collective): their
        windows, the bytes of each rank's part of a gather, the bytes the exchanges move over the group,
        and the choices that made them (the costs, the least bytes shared: the environment of each
        rank)."""
        choices = self.key[-2:] if isinstance(self.key, tuple) else ()
        exchanged = self.exchanged[0].total if self.exchanged else 0
        return len(self.shared), sum(w.part_bytes for w in self.shared), len(self.exchanged), exchanged, *choices

    def here(self) -> list[ReadItem]:
        """Every item this rank reads from the files itself: its own, and its turn of what is shared
        (what a verified load checks against the save's hashes)."""
        mine = (item for w in self.shared for item, owner in zip(w.items, w.owner) if owner == self.position)
        runs = (
            ReadItem(file, offset, torch.uint8, "", "", Ranges(0, n), Held(0, WHOLE, 0), (n,))
            for w in self.exchanged
            for file, offset, n in w.runs
        )
        return [*self.own, *mine, *runs]


#: What the ranks hold alike is read once between them from this many bytes on: less is not worth
#: the gather's collective (a round trip of ~1 ms on the 2-core machine measured, where a rank reads
#: ~1 MiB from the page cache in ~0.2 ms). ``COLLGRAD_SHARED_READ_BYTES`` overrides it (the same on
#: every rank: the load's check compares what each rank would share).
SHARED_MIN_BYTES = 1 << 20


def shared_min_bytes() -> int:
    """``SHARED_MIN_BYTES``, or ``COLLGRAD_SHARED_READ_BYTES`` where it is set (0: share whatever there is)."""
    return int(_number("COLLGRAD_SHARED_READ_BYTES", SHARED_MIN_BYTES))


def io_costs(directory: str | None = None) -> IoCosts:
    """The costs the plans weigh (plan.IoCosts) for the files of ``directory``: a call of
    ``LOCAL_CALL_SECONDS`` where it lies on a local file system (``storage.LOCAL_FILE_SYSTEMS``: on one
    machine a few preads cost less than an exchange), else a network file system's (IoCosts'; also
    with no directory: the simulation's); ``COLLGRAD_IO_CALL_SECONDS``,
    ``COLLGRAD_NETWORK_BYTES_PER_SECOND`` and ``COLLGRAD_FILE_SYSTEM_BYTES_PER_SECOND`` where set. The
    same on every rank that sees the directory alike: a save's and a load's checks compare what they
    decide. Local."""
    default = IoCosts()
    if directory is not None and storage.file_system(directory) in storage.LOCAL_FILE_SYSTEMS:
        default = default._replace(call_seconds=LOCAL_CALL_SECONDS)
    return IoCosts(
        _number("COLLGRAD_IO_CALL_SECONDS", default.call_seconds),
        _number("COLLGRAD_NETWORK_BYTES_PER_SECOND", default.network_bytes_per_second),
        _number("COLLGRAD_FILE_SYSTEM_BYTES_PER_SECOND", default.file_system_bytes_per_second),
    )


def _number(name: str, default: float) -> float:
    given = os.environ.get(name, "")
    try:
        found = float(given) if given else default
    except ValueError:
        found = -1.0
    if found < 0:
        raise InvalidArgumentError(f"rank {_compat.rank()}: {name}={given!r} is not a number of at least 0")
    return found


def plain_kinds(sources: Sequence[Opened]) -> list[tuple[str, StateLayout]]:
    """The kinds of ``sources`` (stem, layout) whose slices the group's ranks alone hold: all but those of
    a model with tensor- or expert-parallel shards (other sets of ranks hold theirs). Local."""
    return [(one.stem, one.source.layout) for one in sources if not (one.source.splits or one.source.experts)]


@_compat.uncollected
def planned_reads(
    sources: Sequence[Opened],
    buffers: Sequence[tuple[str, torch.Tensor]],
    stored: Mapping[tuple[str, str], Stored],
    index: int = 0,
    world: int = 1,
    *,
    costs: IoCosts,
) -> Reads:
    """This rank's reads of ``stored`` (by (stem, name)) into ``sources`` and ``buffers`` (with the first),
    as rank ``index`` of a group of ``world`` that holds the same (the model's data-parallel group):
    its holdings as read items (plan.py, pure); what every rank holds whole alike (a ZeRO-1/2 model's
    weights, the buffers) read once between the ranks where it is at least ``shared_min_bytes()``, the
    world is large enough that the file system's bandwidth, shared by every rank, makes it pay
    (``IoCosts.shares`` of ``costs``: ``io_costs`` of the checkpoint's directory) and the model has no
    tensor- or expert-parallel shards (whose holders are other sets of ranks); small slices exchanged
    (``costs.small_below``). The same decision on every rank: a function of what they agreed they see.
    Kept with the first source for the next load alike. Local."""
    # what the items depend on: the stored tensors, each source's stem and layout (frozen: the same
    # object while the source is kept), what each holds whole (ZeRO-3's persistent parameters change
    # with its state; the buffers), the group
    key = (
        tuple(stored.items()),
        tuple((one.stem, one.source.layout) for one in sources),
        tuple(
            tuple(n for n, _ in _whole(one.source, b, True)) for one, b in zip(sources, [buffers, *[()] * len(sources)])
        ),
        index,
        world,
        costs,  # the plan's choices: the load's check compares them between the ranks (fingerprint)
        shared_min_bytes(),
    )
    scratch = sources[0].source.scratch
    found = scratch.get("planned reads")
    if isinstance(found, tuple) and found[0] == key:
        kept: Reads = found[1]
        return kept
    mine = held(sources, buffers, loading=True)
    # a tensor- or expert-parallel shard's replicas are held by other sets of ranks than the group
    parallel = any(one.source.splits or one.source.experts for one in sources)
    costs, min_bytes = key[-2], key[-1]
    assert isinstance(costs, IoCosts) and isinstance(min_bytes, int)
    small = small_slices(plain_kinds(sources), stored, costs, world)
    split = split_reads(stored, mine, index, world, not parallel and costs.shares(world), min_bytes, small)
    planned = Reads(split.own, split.shared, index, key, split.from_turn, tuple(split.exchanged))
    scratch["planned reads"] = (key, planned)
    return planned


def reads(sources: Sequence[Opened], buffers: Sequence[tuple[str, torch.Tensor]], planned: Reads) -> LoadPlan:
    """``planned``'s own items resolved against this rank's memory (storage.py): kept with the first
    source for the next load of the same tensors into the same layouts and memory. Local."""
    into = memory(sources, buffers, loading=True)
    return load_plan(into, lambda: planned.own, sources[0].source.scratch, planned.key)


def _setter(source: Source) -> Any:
    """DeepSpeed's local setter, by the parameter's index in the source's layout (fp32 values)."""
    put = source.accessor_set
    assert put is not None
    params = [source.params[slot.name] for group in source.layout.groups for slot in group.params]

    def setter(param: int, values: torch.Tensor) -> None:
        put(params[param], values.to(torch.float32))

    return setter


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds (persistent ones), each once, in module order."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{prefix}.{name}" if prefix else name), buffer.detach()


@dataclass(frozen=True)
class Matched:
    """The checkpoint's tensor of each name the model keeps that it holds (by the model's name), the
    model's names it lacks and its names the model lacks."""

    stored: Mapping[str, Stored]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def match(
    where: str,
    shapes: Mapping[str, tuple[int, ...]],
    stored: Mapping[str, Stored],
    aliases: Mapping[str, Sequence[str]] | None = None,
    others: Sequence[str] = (),
) -> Matched:
    """The tensors of ``stored`` (a checkpoint's, ``where``) of the names ``shapes`` gives the model's
    shapes of, each found under any of its ``aliases`` (a tied weight's names); the rest on either side
    named. ``others``: names of the model matched elsewhere (not unexpected here). A shape that
    differs: CheckpointError (this rank)."""
    found: dict[str, Stored] = {}
    missing, wrong = [], []
    known = set(others)
    for name, shape in shapes.items():
        names = aliases.get(name, (name,)) if aliases is not None else (name,)
        known.update(names)
        hit = next((stored[a] for a in names if a in stored), None)
        if hit is None:
            missing.append(name)
        elif hit.shape != tuple(shape):
            wrong.append(f"{name}: {list(hit.shape)} in the checkpoint, {list(shape)} in the model")
        else:
            found[name] = hit
    if wrong:
        raise refused(where, f"shapes differ from the model's: {listed(wrong)}")
    return Matched(found, tuple(missing), tuple(n for n in stored if n not in known))


def refuse_unmatched(where: str, missing: Sequence[str], unexpected: Sequence[str], strict: bool) -> None:
    """With ``strict``, keys on one side only refused (CheckpointError naming them, this rank)."""
    if strict and (missing or unexpected):
        parts = [f"missing from the checkpoint: {listed(missing)}"] if missing else []
        parts += [f"not in the model: {listed(unexpected)}"] if unexpected else []
        raise refused(
            where,
            f"the checkpoint does not match the model ({'; '.join(parts)}); pass strict=False to load what matches",
        )


def listed(names: Sequence[str], most: int = 8) -> str:
    """At most ``most`` of ``names``, and how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
