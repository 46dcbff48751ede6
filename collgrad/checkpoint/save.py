"""``save_full_model``: a consolidated checkpoint in the layout Hugging Face ``from_pretrained`` loads,
streamed bucket by bucket into safetensors shards, never the whole model in one memory.

    check    arguments; the sources of what is written opened; a probe file in the directory
             -> agree (arguments the same everywhere)                      (one small all-gather)
             -> without ``ranks``, agree: do all see every probe (they share the directory)  (another)
    plan     the shards laid out from the layouts (plan.py: the same on every rank); this rank's
             write items: where the ranks share the directory, its turn of every shard's bytes (a
             contiguous run of them), the first rank the headers; else shard k's rank (``ranks``) all
             of shard k
    execute  the module's weights (or the fp32 masters) streamed whole one bucket at a time (one
             collective per bucket; ZeRO-1/2 and stage 0 hold them whole: none), then the persistent
             buffers; each tensor this rank writes written at its offsets as it arrives (storage.py)
             -> agree: every rank wrote its part                               (one small all-gather)
    commit   the shards renamed to their final names, the index added, an earlier save's weights
             files removed (commit.py)  -> agree: done everywhere             (one small all-gather)
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, Collection, Hashable, Iterable, Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.checkpoint import commit, hashes
from collgrad.checkpoint.agree import Phases
from collgrad.checkpoint.match import (
    SHARD_HOLDERS,
    expert_holders,
    holders,
    io_costs,
    others,
    persistent_buffers,
    refuse_layout,
    refuse_unplaced,
    refuse_unshared_shards,
)
from collgrad.checkpoint.plan import EVERY_RANK, WHOLE, Files, Held, Holding, Ranges, WriteItem, lay_out, write_items
from collgrad.checkpoint.safetensors import INDEX_NAME, SAFE_DTYPES, Entry, index_json, is_weights_file
from collgrad.checkpoint.storage import Writer, remove_all, write_values
from collgrad.core.dispatch import Dispatcher
from collgrad.errors import InvalidArgumentError
from collgrad.state import adapters
from collgrad.state.adapters.base import Source, select
from collgrad.state.call import OpenCall
from collgrad.state.kinds import FP32, WEIGHTS, StateKind
from collgrad.state.layout import Partitioning, Split
from collgrad.state.model_cache import Context
from collgrad.state.read import FullStateStream
from collgrad.state.record import StateRecord
from collgrad.state.whole import laid_out, whole_name

__all__ = ["save_full_model", "SavedModel", "DEFAULT_MAX_SHARD_BYTES", "checked_shard_bytes", "plan_full_model"]

#: ``save_pretrained``'s default shard size ("5GB")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: A training state's weights file (its generation in the name), which only its manifest's commit removes.
_GENERATION = re.compile(r"^model-[0-9a-f]+-\d{5,}-of-\d{5,}\.safetensors$")


@dataclass(frozen=True)
class SavedModel:
    """What ``save_full_model`` wrote: every file of the checkpoint (shards in order, then the index if
    there is one), the ones this rank wrote (where the ranks share the writing: put in place, by the
    first rank), how many tensors and bytes of tensor data, the seconds the call took on this rank,
    the records of the streams that gathered the tensors, and the files of its content hashes."""

    directory: str
    files: tuple[str, ...]
    written_here: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float
    #: what each stream of whole tensors did (collectives, bytes sent by this rank)
    records: tuple[StateRecord, ...] = ()
    #: the ranks shared the writing (each its run of the bytes, into every shard), and the bytes of the
    #: shards (headers and tensors) this rank wrote
    shared: bool = False
    bytes_written: int = 0
    #: every writing rank's hash file and their record (hashes.py), where one directory holds every file
    hash_files: tuple[str, ...] = ()

    @property
    def first_writer(self) -> bool:
        """This rank wrote the checkpoint's first file: the one rank to write what goes beside it."""
        return bool(self.written_here) and self.written_here[0] == self.files[0]


@_compat.uncollected  # the whole job: its allocations set off full collections of the heap
def save_full_model(
    model: object,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ranks: Sequence[int] | None = None,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    dispatcher: Dispatcher | None = None,
) -> SavedModel:
    """Write ``model``'s whole ``state_dict`` (trainable and frozen parameters, persistent buffers; a
    tied weight once, under its first name, as ``save_pretrained`` does) to ``directory`` as safetensors
    shards of at most ``max_shard_bytes`` each plus ``model.safetensors.index.json`` (one shard:
    ``model.safetensors`` alone), which ``transformers``' ``from_pretrained`` and ``safetensors`` load.

    ``dtype=None`` keeps the module's dtype (a 16-bit model is written 16-bit, as ZeRO-3's
    ``_zero3_consolidated_16bit_state_dict`` gives it); ``dtype=torch.float32`` (or another floating
    dtype) writes the fp32 master weights of the trainable parameters converted to it, and the other
    tensors converted. ``ranks``: the global ranks that write, shard k by ``ranks[k % len(ranks)]``
    (a shared file system when there are several); by default (None) every rank that sees the same
    directory on the same machine as the others writes its share of every shard at its offsets, else
    rank 0 alone. ``params``: only these parameters (names or parameters), and then no buffers.

    Memory: a rank holds at most one tensor converted to the file's dtype plus what the stream holds
    (about two buckets of ``bucket_bytes``), and on a network file system a buffer of 4 MiB that joins
    its small writes (``storage.JOINED_WRITE_BYTES``). No shard appears under its final name
    before every rank has written all of its own; a failure on any rank (a bad directory, a full disk)
    raises on every rank (that rank: CollgradError with the cause; the others: RankFailedError) and
    removes the temporary files.

    Under tensor parallelism (DeepSpeed AutoTP) every tensor is still written whole, under the unsharded
    model's names: each shard by one of the ranks that hold it, into its slice of the whole tensor's
    place (a shard along dimension 1 row by row); the ranks must share the directory.

    When and where: on every rank of the model's data-parallel group (under tensor parallelism, every
    rank of the model), with the same arguments, outside
    ``step()``. Returns a ``SavedModel``.
    """
    start = time.perf_counter()
    ctx = Context.of(dispatcher)
    path = os.fspath(directory)
    entrance = adapters.enter(model)
    resolved, error, group, me = entrance
    writers: tuple[int, ...] = (0,)
    names: list[str] | None = None
    wanted: list[_Wanted] = []
    entries: list[Entry] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    joined_below = 0
    try:
        if resolved is not None:
            writers = _checked(ranks, dtype, max_shard_bytes)
            joined_below = io_costs(path).joined_below  # this rank's writes: how small a write is joined
            names = None if params is None else [n for n, _ in select(resolved.module, params, trainable=False)]
            buffers = list(persistent_buffers(resolved.module)) if names is None else []
            wanted, entries = _wanted(ctx, resolved, dtype, names, buffers)
            if ranks is None or me in writers:
                _probe(path, me, me in writers)
    except (OSError, ValueError, TypeError, KeyError) as caught:
        error, writers, names = caught, (0,), None
    arguments = stable_hash((path, str(dtype), max_shard_bytes, writers, names, ranks is None))
    compared = "arguments (directory, dtype, max_shard_bytes, ranks or params)"
    # the ranks that hold a part of the model agree and share the writing; each stream is its own group's
    everywhere = entrance.model_group
    phases = Phases(everywhere, me, "save_full_model", compared, ctx.dispatcher.timeout)
    phases.agree(error, "check the arguments and make the directory", arguments=arguments)
    assert resolved is not None  # else the agreement raised
    everyone = list(_compat.group_ranks(everywhere)) if everywhere is not None else [me]
    shared = False
    if ranks is None:  # every rank sees the next rank's probe: they share the writing, each its turn of the bytes
        rows = phases.agree(None, "look for the others' files", extra=(int(commit.sees(path, everyone, me)),))
        shared = all(row[2] for row in rows)
    commit.unprobe(path, me)
    refuse_unshared_shards(  # agreed above
        (one.source for one in wanted),
        shared,
        f"every rank must see the directory {path} (a shared file system) and ranks be None",
    )
    index = everyone.index(me) if shared else me
    files, items = _plan(entries, max_shard_bytes, index, len(everyone), None if shared else writers, wanted)
    mine = {item.tensor: item for item in items if item.held is not None}
    into = {file: commit.temporary(os.path.join(path, file)) for file in files.names()}
    # every byte hashed as it goes out where one directory holds every file (hashes.py)
    recorded = shared or len(writers) == 1
    writer = Writer(hashes.Hasher({into[f]: f for f in files.names()}) if recorded else None, joined_below)
    streams: list[FullStateStream] = []
    hashed = None  # this rank's hash file: ((temporary, final), digest)
    try:
        headers = files.headers()
        for item in items:
            if item.held is None:
                writer.write_bytes(into[item.file], item.size, 0, headers[item.file])
        for one in wanted:  # every tensor, whole, as held, in the layout's order
            tensors: Iterable[tuple[str, torch.Tensor]]
            if one.whole:
                tensors = ((n, p.detach()) for n, p in one.source.params.items())
            else:  # one bucket at a time
                streams.append(_stream(resolved, group, me, one, bucket_bytes, ctx))
                tensors = streams[-1]
            _put(writer, into, mine, tensors, kept=one.whole, source=one.source)
        _put(writer, into, mine, buffers, kept=True)
        writer.finish()
        hashed = commit.hash_file(writer, path, hashes.hash_file_name(None, index))
        rows = phases.agree(writer.error, "write its shards", extra=commit.told(hashed))
    except BaseException:
        writer.remove()
        if hashed is not None:
            remove_all([hashed[0][0]])
        raise
    here: list[str] = []
    error = None
    named = commit.recorded(rows, lambda k: hashes.hash_file_name(None, k))
    try:
        first = index == 0 if shared else me == writers[0]
        here = _commit(path, files, items, into, first, shared, named if recorded else None)
    except OSError as caught:
        error = caught
        writer.remove()
    phases.agree(error, "give its shards their final names")
    finals = files.names() + ((INDEX_NAME,) if len(files.names()) > 1 else ())
    hash_files = (*named, hashes.RECORD_NAME) if recorded else ()
    records = tuple(stream.record() for stream in streams)
    seconds = time.perf_counter() - start
    here = [f for f in here if f not in hash_files]
    saved = (len(entries), files.data_bytes(), seconds, records, shared, writer.bytes_written, hash_files)
    return SavedModel(path, finals, tuple(here), *saved)


def _checked(ranks: Sequence[int] | None, dtype: torch.dtype | None, max_shard_bytes: int) -> tuple[int, ...]:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    writers = (0,) if ranks is None else tuple(ranks) if not isinstance(ranks, int) else (ranks,)
    if not writers or any(not isinstance(r, int) or not 0 <= r < world for r in writers):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: ranks must name the global ranks that write (0 to {world - 1}), got {ranks!r}"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in SAFE_DTYPES):
        raise InvalidArgumentError(f"rank {_compat.rank()}: dtype must be None or a torch dtype, got {dtype!r}")
    checked_shard_bytes(max_shard_bytes)
    return writers


def checked_shard_bytes(max_shard_bytes: object) -> int:
    """``max_shard_bytes`` if it is a positive int; InvalidArgumentError (this rank) otherwise."""
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: max_shard_bytes must be a positive int, got {max_shard_bytes!r}"
        )
    return max_shard_bytes


def _probe(path: str, rank: int, writing: bool) -> None:
    """This rank's probe file in the directory; only a writing rank must be able to make one (another
    that cannot just does not share the writing)."""
    try:
        commit.probe(path, rank)
    except OSError:
        if writing:
            raise


@dataclass(frozen=True)
class _Wanted:
    """One kind of state a save writes: the parameters it brings whole, their source, and whether every
    rank holds them whole already (then they are read as they are, each in its own dtype, with no
    stream; else a stream brings them, one bucket at a time)."""

    kind: StateKind
    names: list[str]
    source: Source
    whole: bool


def _wanted(
    ctx: Context,
    model: adapters.Model,
    dtype: torch.dtype | None,
    names: list[str] | None,
    buffers: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[_Wanted], list[Entry]]:
    """What a save writes: the module's weights, or with ``dtype`` the fp32 master weights of the
    trainable parameters and the module's weights of the frozen ones; and every tensor as written, in
    layout order (the parameters, then the persistent ``buffers``). Local: the streams are opened
    later, on every rank together (``_stream``)."""
    refuse_layout(model)
    named = select(model.module, names, trainable=False)
    kinds: list[tuple[StateKind, list[str]]]
    if dtype is None:
        kinds = [(WEIGHTS, [n for n, _ in named])]
    else:
        trainable = [n for n, p in named if p.requires_grad]
        kinds = [(FP32, trainable), (WEIGHTS, [n for n, p in named if not p.requires_grad])]
    wanted: list[_Wanted] = []
    entries: list[Entry] = []
    for kind, chosen in kinds:
        if not chosen:
            continue
        source = ctx.source(model, kind, None, chosen)[0]
        refuse_unplaced(source)
        # ZeRO-1/2, stage 0, a plain module: every rank holds these weights whole
        whole = source.accessor is None and all(g.kind is Partitioning.REPLICATED for g in source.layout.groups)
        wanted.append(_Wanted(kind, chosen, source, whole))
        out_dtypes = {slot.name: group.out_dtype for group in source.layout.groups for slot in group.params}
        for slot, name, shape in laid_out(source):  # as the unsharded model has them, every rank's experts
            kept = source.params[slot.name].dtype if kind == WEIGHTS and whole else out_dtypes[slot.name]
            entries.append(Entry(name, shape, dtype or kept))
    for name, buffer in buffers:
        written = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
        entries.append(Entry(name, tuple(buffer.shape), written))
    return wanted, entries


def _stream(
    model: adapters.Model, group: ProcessGroup | None, me: int, one: _Wanted, bucket_bytes: int | None, ctx: Context
) -> FullStateStream:
    """The whole tensors of ``one``, one bucket at a time: the call opened on every rank together (one
    small all-gather), then one collective per bucket."""
    call = OpenCall(
        adapters.Entrance(model, None, group, me),
        name=f"save_full_model:{one.kind.label}",
        streaming=True,
        kind=one.kind,
        params=one.names,
        bucket_bytes=bucket_bytes,
        dispatcher=ctx.dispatcher,
        models=ctx.models,
    )
    return FullStateStream(call, copy=False)


def _plan(
    entries: list[Entry],
    max_shard_bytes: int,
    index: int,
    world: int,
    writers: tuple[int, ...] | None,
    wanted: list[_Wanted],
) -> tuple[Files, list[WriteItem]]:
    """The shards laid out, and what rank ``index`` of ``world`` writes of them: every rank holds every
    tensor whole (the streams bring them), or of a tensor-parallel split its shard's slice of the whole
    tensor, alike with the other ranks of its data-parallel group, or of a MoE layer's experts spread
    over ranks its own, alike with its expert-data-parallel group; so its turn of what every rank holds
    and of what its groups hold (plan.py), or with ``writers`` the files that are its own (shard k by
    ``writers[k % len(writers)]``: no split then). Kept with the model for the next save of the same
    tensors alike (a pure function of these arguments). Local."""
    scratch = wanted[0].source.scratch
    splits = {name: split for one in wanted for name, split in one.source.splits.items()}
    experts = {e.name: expert_holders(e) for one in wanted for e in one.source.experts.values()}
    elsewhere = {name for one in wanted for name in others(one.source)}  # other ranks' experts
    among = holders(one.source for one in wanted)
    key = ("save_full_model plan", tuple(entries), max_shard_bytes, index, world, writers, tuple(splits.items()), among)
    found = scratch.get("save_full_model plan")
    if isinstance(found, tuple) and found[0] == key:
        kept: tuple[Files, list[WriteItem]] = found[1]
        return kept
    planned = plan_full_model(
        entries, max_shard_bytes, index, world, writers, splits, experts, elsewhere, among, scratch
    )
    scratch["save_full_model plan"] = (key, planned)
    return planned


@_compat.uncollected
def plan_full_model(
    entries: Sequence[Entry],
    max_shard_bytes: int,
    index: int,
    world: int,
    writers: tuple[int, ...] | None = None,
    splits: Mapping[str, Split] | None = None,
    experts: Mapping[str, str] | None = None,
    elsewhere: Collection[str] = (),
    among: Mapping[str, tuple[int, int]] | None = None,
    memo: dict[Hashable, Any] | None = None,
) -> tuple[Files, list[WriteItem]]:
    """The shards of ``entries`` laid out, and what rank ``index`` of ``world`` writes of them (``_plan``'s
    work, as data): every tensor held whole by every rank (``Held(0, WHOLE, k)``: the k-th entry), or of
    a tensor-parallel split (``splits``) its shard's slice of the whole tensor, held alike by the ranks
    ``among`` names, or an expert (``experts``: its holders' set; those of other ranks, ``elsewhere``,
    not held here). ``writers``: the ranks that write whole files, else every rank
    its turn of the bytes. Pure but for ``memo`` (lay_out's)."""
    files = lay_out({"model": list(entries)}, max_shard_bytes, memo=memo)
    everything = []
    for k, e in enumerate(entries):
        split = (splits or {}).get(e.name)
        if e.name in elsewhere:
            continue
        if split is None:
            held = (experts or {}).get(e.name, EVERY_RANK)
            everything.append(Holding("model", e.name, Ranges(0, e.numel), Held(0, WHOLE, k), True, held))
        else:
            ranges = Ranges.slice(e.shape, split.dim, split.lo, split.hi)
            everything.append(Holding("model", e.name, ranges, Held(0, WHOLE, k), True, SHARD_HOLDERS))
    by_file = None if writers is None else [writers[k % len(writers)] for k in range(len(files.names()))]
    return files, write_items(files, everything, index, world, by_file, among)


def _put(
    writer: Writer,
    into: dict[str, str],
    mine: dict[str, WriteItem],
    tensors: Iterable[tuple[str, torch.Tensor]],
    kept: bool,
    source: Source | None = None,
) -> None:
    """Each of ``tensors`` (name, whole value; of a tensor-parallel split, this rank's shard; of an
    expert, named as ``source`` names it here) this rank writes (``mine``, by the unsharded model's
    names) written at its place in its file's temporary (``into``): a shard's slice row by row where it
    is not one run of the whole tensor. Every rank goes through every tensor (a stream's collectives),
    whatever fails: failures stay in ``writer``."""
    for name, tensor in tensors:
        item = mine.get(whole_name(source, name) if source is not None else name)
        if item is None:
            continue
        if tensor.numel() != item.ranges.numel:
            writer.error = writer.error or InvalidArgumentError(
                f"rank {_compat.rank()}: {name} has {tensor.numel()} elements, not {item.ranges.numel}"
            )
            continue
        write_values(writer, into[item.file], item, tensor, kept=kept)


def _commit(
    path: str,
    files: Files,
    items: Sequence[WriteItem],
    into: dict[str, str],
    first: bool,
    shared: bool,
    named: dict[str, int] | None,
) -> list[str]:
    """This rank's shards renamed to their final names (where the ranks share the writing: every shard,
    by the first rank), and by the first the index, every rank's hash file and the record of them
    (``named``: each hash file's digest; None: none recorded) added and an earlier save's weights and
    hash files removed: the files this rank put in place. OSError where the file system refuses."""
    written = dict.fromkeys(item.file for item in items)
    here = [f for f in files.names() if (first if shared else f in written)]
    renames = [(into[f], os.path.join(path, f)) for f in here]  # each file's temporary, as written
    if first and len(files.names()) > 1:
        final = os.path.join(path, INDEX_NAME)
        renames.append(commit.write_small(final, index_json(files.mapped("model"), files.data_bytes())))
        here.append(INDEX_NAME)
    if first and named is not None:
        renames += [(commit.temporary(os.path.join(path, name)), os.path.join(path, name)) for name in named]
        renames.append(commit.write_small(os.path.join(path, hashes.RECORD_NAME), hashes.record_json(named)))
        here += [*named, hashes.RECORD_NAME]
    every = [os.path.join(path, f) for f in files.names()]  # other writers' shards: never swept
    commit.commit(renames, [(path, _earlier)] if first else [], keep=every)
    return here


def _earlier(name: str) -> bool:
    """A weights file an earlier ``save_pretrained`` or ``save_full_model`` left (``from_pretrained``
    would load ``model.safetensors`` before an index), as ``save_pretrained`` removes them, or an earlier
    ``save_full_model``'s hash file; a training state's generation-named files are its manifest's, left
    to it."""
    hashed = name == hashes.RECORD_NAME or (name.startswith("model.safetensors.hashes-") and name.endswith(".json"))
    return (is_weights_file(name) and not _GENERATION.match(name)) or hashed
