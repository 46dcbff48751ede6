"""``save_training_state`` / ``load_training_state``: the whole training state in one checkpoint that does
not depend on the world size, the ZeRO stage or the framework that wrote it, each rank writing and
reading only the ranges it holds. The directory is a Hugging Face model directory:

    directory/
      model.safetensors.index.json              the module's weights, as from_pretrained loads them
      model-<gen>-00001-of-0000N.safetensors    ... every parameter (frozen ones too) and persistent buffer
      (config.json, tokenizer files: the user's, beside them)
      training_state/                           where no loader of a model directory looks
        manifest.json                           what is where, the rest as JSON (manifest.py): the commit
        fp32-<gen>-00001-of-0000N.safetensors   the fp32 master weights of the trainable parameters
        optimizer-<k>-<gen>-00001-of-....       each per-element optimizer state (exp_avg, ...), by key

Every tensor is whole in its file, as ``save_full_model`` writes it, so any layout can take it back;
``from_pretrained``, PyTorch DCP's ``HuggingFaceStorageReader`` and a glob of ``*.safetensors`` all read
exactly the module's weights (temporaries and files being removed are hidden and named otherwise).

save   check: every rank opens the sources (weights, masters, each state), reads what is not per
         element, and writes a probe file -> agreement 1: arguments, those values the same on every
         rank, the save's generation (rank 0's)
       shared: every rank sees the next rank's probe -> agreement 2 (else rank 0 writes it all, streamed)
       plan: the files laid out from the layouts (every rank the same); this rank's write items: the
         fragments it holds, its turn of what every rank holds whole, rank 0 the headers (plan.py)
       write: each item at its offset of the file's temporary; fsync -> agreement 3 (a failure
         anywhere: the new files removed, the old checkpoint intact)
       commit: rank 0 renames the files, the index, then the manifest into place (the manifest last:
         it is the checkpoint), removes the files of the previous one -> agreement 4
load   check: manifest, headers and index (untrusted), names, shapes, param groups and states
         against the model; optimizer states created where it never stepped -> agreement 1 (a refusal:
         those states removed again, nothing else touched)
       plan + read: each rank its own ranges (plan.py's read items, storage.py) -> agreement 2
       then the rest: step counts, hyperparameters, the LR scheduler, the framework's counters
"""

from __future__ import annotations

import copy
import itertools
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.checkpoint import commit, hashes, storage
from collgrad.checkpoint.agree import (
    Once,
    Phases,
    Tally,
    deferred,
    exchange_parts,
    metadata_once,
    position,
    read_together,
)
from collgrad.checkpoint.load import LoadedModel
from collgrad.checkpoint.manifest import (
    MANIFEST_NAME,
    STATE_DIR,
    Manifest,
    ParamGroup,
    encode,
    manifest_path,
    read_manifest,
)
from collgrad.checkpoint.match import (
    Opened,
    Reads,
    held,
    holders,
    io_costs,
    listed,
    match,
    memory,
    opened,
    others,
    persistent_buffers,
    plain_kinds,
    planned_reads,
    refuse_layout,
    refuse_unmatched,
    refuse_unshared_shards,
    shapes,
)
from collgrad.checkpoint.plan import (
    Exchange,
    Files,
    IoCosts,
    WriteItem,
    exchanged_writes,
    lay_out,
    small_slices,
    write_items,
)
from collgrad.checkpoint.safetensors import (
    INDEX_NAME,
    Checkpoint,
    Entry,
    Stored,
    index_json,
    is_weights_file,
    open_mapped,
    refused,
)
from collgrad.checkpoint.save import DEFAULT_MAX_SHARD_BYTES, checked_shard_bytes
from collgrad.checkpoint.verify import differing, differs, recorded_pieces
from collgrad.core.dispatch import Dispatcher
from collgrad.errors import CollgradError, InvalidArgumentError
from collgrad.state import adapters
from collgrad.state.adapters.base import OptimizerView, create_states
from collgrad.state.call import OpenCall
from collgrad.state.kinds import FP32, WEIGHTS, OptimizerState
from collgrad.state.layout import Partitioning
from collgrad.state.model_cache import Context
from collgrad.state.read import FullStateStream
from collgrad.state.record import StateRecord
from collgrad.state.whole import laid_out, whole_name

__all__ = [
    "save_training_state",
    "load_training_state",
    "SavedTrainingState",
    "LoadedTrainingState",
    "file_names",
    "weights_index",
    "put_in_place",
]


@dataclass(frozen=True)
class SavedTrainingState:
    """What ``save_training_state`` wrote: the directory, every file of the checkpoint (the manifest
    last), its generation, the tensors and bytes of tensor data in it, the bytes this rank wrote, and
    the seconds the call took on this rank."""

    directory: str
    files: tuple[str, ...]
    generation: str
    tensors: int
    bytes: int
    bytes_written: int
    seconds: float
    #: the ranks did not share the directory: rank 0 wrote every tensor, streamed to it
    streamed: bool = False
    #: what each stream did (where the ranks do not share the directory, or DeepSpeed's accessors read a kind)
    records: tuple[StateRecord, ...] = ()
    #: the all-to-alls that moved small slices to the ranks that wrote them, and this rank's bytes into them
    collectives: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True)
class LoadedTrainingState(LoadedModel):
    """What ``load_training_state`` did on this rank: what ``load_full_model`` tells (``path``: the
    directory; the files it read, the tensors, the bytes of data and of metadata (manifest, headers, hash
    files: none where another rank read them for the group), the seconds, with
    ``strict=False`` what did not match), and the optimizer states it loaded by key and whether it
    created them (an optimizer that had never stepped)."""

    states: tuple[str, ...] = ()
    created_states: bool = False

    @property
    def directory(self) -> str:
        return self.path


# --------------------------------------------------------------------------------------------- what it holds


@dataclass
class _Held:
    """A model's training state as this rank holds it: each kind opened (file stem, kind, source, this
    rank's view), the persistent buffers, and what is not a tensor of the model's shape."""

    sources: list[Opened]
    buffers: list[tuple[str, torch.Tensor]]
    keys: tuple[str, ...]
    param_groups: tuple[ParamGroup, ...]
    param_states: dict[str, dict[str, Any]]
    lr_scheduler: dict[str, Any] | None
    counters: dict[str, int | float]


def _per_element(held: Mapping[str, Any], holder: torch.Tensor) -> list[str]:
    """The keys of ``held`` (one holder's optimizer state) with one value per element of it."""
    return sorted(k for k, v in held.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == holder.shape)


def _state_keys(view: OptimizerView) -> tuple[str, ...]:
    """The per-element state keys the optimizer holds, the same for every holder (or none at all: it
    never stepped); InvalidArgumentError (this rank) where they differ."""
    found = {id(h): _per_element(view.optimizer.state.get(h) or {}, h) for h in view.distinct_holders()}
    kinds = {tuple(keys) for keys in found.values()}
    if len(kinds) > 1:
        names = {tuple(found[id(h)]): n for n, h in view.holders.items()}
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: the optimizer holds different per-element states for different parameters "
            f"({'; '.join(f'{n}: {list(k)}' for k, n in names.items())}): step every parameter before saving"
        )
    return next(iter(kinds), ())


def _scalars(view: OptimizerView, keys: tuple[str, ...], spread: Spread) -> dict[str, dict[str, Any]]:
    """Every trainable parameter's optimizer state that is not per element (``step``, ...), by the
    unsharded model's name (an expert's: for it on every expert-parallel rank, as ``_groups``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, holder in view.holders.items():
        held = view.optimizer.state.get(holder) or {}
        scalars = {k: v for k, v in held.items() if k not in keys}
        out.update((whole, scalars) for whole in spread.get(name, (name,)))
    return out


#: By a parameter's name here, every name it is laid out under in a checkpoint where that is not only its
#: own: an expert spread over expert-parallel ranks stands for the same local expert of every such rank
#: (match.laid_out), which the ranks save alike.
Spread = Mapping[str, tuple[str, ...]]


def _spread(one: Opened) -> Spread:
    return {n: e.names for n, e in one.source.experts.items()}


def _groups(view: OptimizerView, spread: Spread) -> tuple[ParamGroup, ...]:
    """The optimizer's param groups: the unsharded model's names of each one's parameters (every
    expert-parallel rank's experts), its other keys."""
    names: list[list[str]] = [[] for _ in view.optimizer.param_groups]
    for name, index in view.groups.items():
        names[index].extend(spread.get(name, (name,)))
    return tuple(
        ParamGroup(tuple(n), {k: v for k, v in g.items() if k != "params"})
        for n, g in zip(names, view.optimizer.param_groups)
    )


def _held(ctx: Context, model: adapters.Model, optimizer: Any, lr_scheduler: Any) -> _Held:
    """What a save writes, as this rank holds it. Local."""
    refuse_layout(model)
    view = model.optimizer_view(optimizer)
    counters = model.counters()
    scheduler = model.lr_scheduler(lr_scheduler)
    keys = _state_keys(view)
    buffers = list(persistent_buffers(model.module))
    trainable = list(view.holders)
    sources = [opened(ctx, model, "model", WEIGHTS, optimizer), opened(ctx, model, "fp32", FP32, optimizer, trainable)]
    for k, key in enumerate(keys):
        sources.append(opened(ctx, model, f"optimizer-{k}", OptimizerState(key), optimizer, trainable))
    spread = _spread(sources[0])
    groups, scalars = _groups(view, spread), _scalars(view, keys, spread)
    if keys and any(one.source.accessor is not None for one in sources):
        view.linked()  # DeepSpeed's accessors read the states through links a checkpoint save may have dropped
    state = None if scheduler is None else scheduler.state_dict()
    return _Held(sources, buffers, keys, groups, scalars, state, counters)


def _entries_of(held: _Held) -> dict[str, list[Entry]]:
    """Each file stem's tensors as this rank's sources lay them out (the same on every rank): each
    layout's order, named and shaped as the unsharded model has them (match.laid_out), the dtype each is
    held in; the module's persistent buffers after its weights."""
    out: dict[str, list[Entry]] = {}
    for one in held.sources:
        dtypes: dict[str, torch.dtype] = {}
        for group, buffer in zip(one.source.layout.groups, one.local.buffers):
            for k, slot in enumerate(group.params):
                if one.source.accessor is not None:  # DeepSpeed's accessors return fp32 (masters, their states)
                    dtypes[slot.name] = torch.float32
                else:
                    dtypes[slot.name] = buffer[k].dtype if isinstance(buffer, list) else group.wire_dtype
        out[one.stem] = [Entry(name, shape, dtypes[slot.name]) for slot, name, shape in laid_out(one.source)]
    out["model"] += [Entry(n, tuple(b.shape), b.dtype) for n, b in held.buffers]
    return out


def file_names(generation: str, stems: Iterable[str]) -> dict[str, str]:
    """The name of each stem's files in a training state of ``generation`` (``lay_out``'s ``name``): the
    module's weights in the directory, the rest in ``STATE_DIR``. Pure."""
    return {
        stem: f"{'' if stem == 'model' else STATE_DIR + '/'}{stem}-{generation}-{{k:05d}}-of-{{n:05d}}.safetensors"
        for stem in stems
    }


# -------------------------------------------------------------------------------------------------- save


@_compat.uncollected  # the whole job: its allocations set off full collections of the heap
def save_training_state(
    model: object,
    directory: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dispatcher: Dispatcher | None = None,
) -> SavedTrainingState:
    """Save ``model``'s whole training state to ``directory``: the module's weights in the layout
    ``from_pretrained`` loads (every parameter, frozen ones too, and the persistent buffers; add a
    config beside them), the fp32 master weights, every per-element state the optimizer holds under
    its own keys (``exp_avg``, ``momentum_buffer``, any), its other states (step counts) and param
    groups' hyperparameters, the LR scheduler's ``state_dict()`` and the framework's counters (a
    DeepSpeed engine's steps and samples, its fp16 loss scaler); tensors as safetensors, the rest in
    ``training_state/manifest.json``. The directory is a model directory: the weights at its top, the
    rest in ``training_state/``, where no loader of a model directory looks. ``load_training_state``
    resumes it at any world size, ZeRO stage or framework.

    ``model``: a DeepSpeed engine (or the module it wraps: its own optimizer and scheduler are saved), an
    FSDP2 root or a plain module (pass ``optimizer`` and ``lr_scheduler``).

    Each rank writes the ranges it holds straight to their final offsets in the shared files (what
    every rank holds whole, the ranks share), four small agreements around it; where those ranges are
    small (a ZeRO-3 or FSDP2 slice under ``IoCosts.small_below`` bytes: many ranks, or small tensors)
    each tensor is written whole by one rank, its slices sent to it over one all-to-all a window, so
    that each rank writes a few contiguous runs of each file. Where the ranks do not share
    ``directory`` (found out at the start: each looks for the others' probe files), rank 0 writes the
    whole checkpoint into its own, every partitioned kind streamed to it one bucket at a time (as
    ``save_full_model`` does). A state that is not per
    element must be the same on every rank, or the save is refused. Never half a checkpoint: the new
    files carry a new generation in their names, flushed to the disk before the manifest (the
    checkpoint) is renamed into place; a failure on any rank raises on every rank and leaves the
    previous checkpoint in ``directory`` as it was.

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``forward()``/``step()``. Returns a ``SavedTrainingState``.
    """
    start = time.perf_counter()
    ctx = Context.of(dispatcher)
    entrance = adapters.enter(model)
    phases = save_phases(ctx, entrance, "save_training_state")
    save = begin_save(ctx, entrance, phases, os.fspath(directory), optimizer, lr_scheduler, max_shard_bytes)
    writer = save.writer()
    records: list[StateRecord] = []
    if save.shared:  # each rank its own ranges, straight from its memory (small pieces exchanged first)
        save.write(writer, storage.in_memory(save.memory), phases)
    try:
        # each rank's directory its own: rank 0 writes every tensor as the streams bring it; else only
        # what DeepSpeed's accessors read (BF16_Optimizer's masters and states, NVMe-swapped ZeRO-3)
        records = _stream(ctx, entrance, save, optimizer, writer)
    except (OSError, InvalidArgumentError) as caught:
        writer.error = caught
    return end_save(save, writer, phases, start, records)


def save_phases(ctx: Context, entrance: adapters.Entrance, call: str) -> Phases:
    """The agreements of a save named ``call``: over every rank that holds a part of the model (under
    tensor parallelism, every shard's), within the dispatcher's bounded wait."""
    compared = (
        "arguments (directory, max_shard_bytes; the costs of its I/O: the file system it lies on, "
        "COLLGRAD_IO_CALL_SECONDS, COLLGRAD_NETWORK_BYTES_PER_SECOND)"
    )
    return Phases(entrance.model_group, entrance.me, call, compared, ctx.dispatcher.timeout)


@dataclass
class Save:
    """A training-state save between its check and its commit (``begin_save``): the directory, what this
    rank holds, the files laid out (every rank the same), the manifest without its hashes, the save's
    generation, this rank's place among the ``world`` ranks that write, whether they share the
    directory, and where they do, this rank's write items and the memory behind them. Local."""

    path: str
    held: _Held
    files: Files
    manifest: Manifest
    generation: str
    index: int
    world: int
    shared: bool
    items: list[WriteItem]
    memory: list[storage.Memory]
    #: the windows of small pieces moved to the ranks that write them (plan.exchanged_writes)
    exchanged: list[Exchange] = field(default_factory=list)
    #: the collectives that moved them, and this rank's bytes into them
    moved: Tally = field(default_factory=Tally)
    #: what the directory's I/O costs (match.io_costs): the plan's choices, and how small a write is joined
    costs: IoCosts = field(default_factory=IoCosts)

    def write(self, writer: storage.Writer, values_of: storage.ValuesOf, phases: Phases) -> None:
        """This rank's bytes written (``values_of``: its memory, or a copy of it): its items where they lie,
        then its small pieces exchanged over ``phases``' group within its bounded wait (collective where
        there are any: every rank of the save calls it, whatever failed). Failures are kept in
        ``writer.error``."""
        storage.write(writer, self.items, values_of, self.files.headers(), self.temporary)
        if self.exchanged:
            assert phases.group is not None, "nothing is exchanged without a group"
            exchange = exchange_parts(phases.group, self.moved, phases.timeout_s)
            storage.write_exchanged(writer, self.exchanged, values_of, self.temporary, exchange)

    def staged_items(self) -> list[WriteItem]:
        """Every item whose values this rank writes or sends: what an async save copies at the call."""
        return [*self.items, *(item for window in self.exchanged for item in window.sends)]

    def temporary(self, file: str) -> str:
        """Where ``file`` is written before the commit."""
        return _temporary(self.path, file)

    def writer(self) -> storage.Writer:
        """A writer hashing every byte of the save's files as it goes out (hashes.py)."""
        return storage.Writer(
            hashes.Hasher({self.temporary(f): f for f in self.files.names()}), self.costs.joined_below
        )


@_compat.uncollected
def begin_save(
    ctx: Context,
    entrance: adapters.Entrance,
    phases: Phases,
    path: str,
    optimizer: Any,
    lr_scheduler: Any,
    max_shard_bytes: int,
    needs: Callable[[Save], str | None] = lambda save: None,
) -> Save:
    """A save's check and plan: the model and arguments checked on every rank, the same non-per-element
    state on every rank, the save's generation (rank 0's), whether the ranks share ``path``, the files
    laid out and this rank's items. ``needs``: what a save of this kind needs that ``save`` lacks
    (InvalidArgumentError on every rank, nothing written), the same on every rank. Collective over
    ``phases``' group (two agreements); raises on every rank together."""
    resolved, error, group, me = entrance
    ranks = list(_compat.group_ranks(phases.group)) if phases.group is not None else [me]
    held_: _Held | None = None
    fingerprint = 0
    costs = IoCosts()
    try:
        costs = io_costs(path)  # the plan's choice of what is exchanged: the same on every rank (compared below)
        if resolved is not None:
            checked_shard_bytes(max_shard_bytes)
            held_ = _held(ctx, resolved, optimizer, lr_scheduler)
            fingerprint = stable_hash(_shared_json(held_))
            commit.probe(path, me)
            if me == ranks[0]:  # the first rank writes into it whether or not the others share it
                os.makedirs(os.path.join(path, STATE_DIR), exist_ok=True)
    except (CollgradError, OSError, ValueError, TypeError, KeyError) as caught:
        error = caught
    arguments = stable_hash((path, max_shard_bytes, costs))
    what = "check the model and make the directory"
    rows = phases.agree(error, what, arguments=arguments, extra=(fingerprint, secrets.randbits(62)))
    assert resolved is not None and held_ is not None  # else an agreement raised
    if len({row[2] for row in rows}) > 1:
        commit.unprobe(path, me)
        raise InvalidArgumentError(
            f"rank {me}: the optimizer's states that are not per element (its step counts), its param groups, "
            "the LR scheduler's state or the framework's counters differ between the ranks: a training state holds "
            "them once, so they must be the same on every rank"
        )
    generation = f"{rows[0][3]:016x}"
    rows = phases.agree(None, "look for the others' files", extra=(int(commit.sees(path, ranks, me)),))
    commit.unprobe(path, me)
    shared = all(row[2] for row in rows)
    refuse_unshared_shards(  # the same on every rank: agreed above, or of the same optimizer
        (one.source for one in held_.sources),
        shared and all(one.source.accessor is None for one in held_.sources),
        f"every rank must see the directory {path} (a shared file system), and the optimizer keep its states "
        "where collgrad reads them (not DeepSpeed's BF16_Optimizer or NVMe offload)",
    )
    index, world = ranks.index(me), len(ranks)
    entries = _entries_of(held_)
    files = lay_out(entries, max_shard_bytes, file_names(generation, entries), held_.sources[0].source.scratch)
    manifest = _manifest(resolved, held_, files, generation, world)
    save = Save(path, held_, files, manifest, generation, index, world, shared, [], [], costs=costs)
    lacking = needs(save)
    if lacking is not None:
        raise InvalidArgumentError(f"rank {me}: {lacking}")
    if shared:
        readable = [one for one in held_.sources if one.source.accessor is None]
        among = holders(one.source for one in readable)
        items = write_items(files, held(readable, held_.buffers), index, world, among=among)
        small = small_slices(plain_kinds(readable), files.placed, costs, world)
        save.items, save.exchanged = exchanged_writes(files, items, small, index, world)
        save.memory = memory(readable, held_.buffers)
    return save


def end_save(
    save: Save, writer: storage.Writer, phases: Phases, start: float, records: Sequence[StateRecord] = ()
) -> SavedTrainingState:
    """A save whose bytes ``writer`` has written, finished: flushed, this rank's hash file written, every
    rank agreed (a failure anywhere: the new files removed, the old checkpoint intact), then rank 0
    commits (commit.py): the files, the index, every rank's hash file, then the manifest recording them.
    Collective over ``phases``' group (two agreements); raises on every rank together."""
    path, files, index = save.path, save.files, save.index
    renames: list[tuple[str, str]] = []
    hashed = None  # this rank's hash file: ((temporary, final), digest)
    try:
        writer.finish()
        hashed = commit.hash_file(writer, path, hashes.hash_file_name(save.generation, index))
        if index == 0 and writer.error is None:
            renames = [(save.temporary(f), os.path.join(path, f)) for f in files.names()]
            renames.append(weights_index(path, files))
            save.manifest.to_json()  # a value JSON cannot hold refused here, on every rank alike, before the agreement
    except (OSError, InvalidArgumentError) as caught:  # a value JSON cannot hold: found on every rank alike
        writer.error = caught
    try:
        rows = phases.agree(writer.error, "write its part of the files", extra=commit.told(hashed))
    except CollgradError:
        commit.discard(writer, renames + ([hashed[0]] if hashed is not None else []))
        raise
    error = None
    named = commit.recorded(rows, lambda k: hashes.hash_file_name(save.generation, k))
    if index == 0:
        try:  # every rank's hash file, then the manifest recording them: the commit
            renames += [(save.temporary(name), os.path.join(path, name)) for name in named]
            final = replace(save.manifest, hashes=named).to_json()
            renames.append(commit.write_small(manifest_path(path), final))
            put_in_place(path, renames)
        except OSError as caught:
            error = caught
    phases.agree(error, "put the checkpoint in place")
    return SavedTrainingState(
        path,
        (*files.names(), INDEX_NAME, *named, MANIFEST_NAME),
        save.generation,
        len(files.placed),
        files.data_bytes(),
        writer.bytes_written,
        time.perf_counter() - start,
        not save.shared,
        tuple(records),
        save.moved.collectives,
        save.moved.bytes,
    )


def _temporary(path: str, file: str) -> str:
    return commit.temporary(os.path.join(path, file))


def weights_index(path: str, files: Files) -> tuple[str, str]:
    """The index of the module's weights written under its temporary name, flushed: (temporary, final)."""
    body = index_json(files.mapped("model"), files.data_bytes("model"))
    return commit.write_small(os.path.join(path, INDEX_NAME), body)


def put_in_place(path: str, renames: Sequence[tuple[str, str]]) -> None:
    """A written training state committed (commit.py): its files, the index, then the manifest renamed
    into place; then the files of earlier checkpoints in ``path`` removed (an earlier training state's,
    an earlier ``save_pretrained``'s or ``save_full_model``'s weights, which ``from_pretrained`` or a glob
    would read beside these) and temporaries a killed save left. OSError where the file system refuses."""
    commit.commit(renames, [(path, _earlier_weights), (os.path.join(path, STATE_DIR), _earlier_state)])


def _earlier_weights(name: str) -> bool:
    return is_weights_file(name) or name.endswith(commit.TEMPORARY)


def _earlier_state(name: str) -> bool:
    hash_file = name.startswith("hashes-") and name.endswith(".json")
    return name.endswith(".safetensors") or name.endswith(commit.TEMPORARY) or hash_file


def _stream(
    ctx: Context,
    entrance: adapters.Entrance,
    save: Save,
    optimizer: Any,
    writer: storage.Writer,
) -> list[StateRecord]:
    """Tensors written whole by the first rank as streams bring them: every one, headers included, where
    the ranks do not share the directory, else only the kinds read through DeepSpeed's accessors. A kind
    partitioned among the ranks streamed to every rank a bucket at a time (one collective per bucket),
    what every rank holds whole written as it is. Collective: every rank takes part in every stream,
    whatever fails (failures are kept in ``writer.error``). Returns the streams' records."""
    streams: list[FullStateStream] = []
    held, files, writing, every = save.held, save.files, save.index == 0, not save.shared
    if writing and every:
        for named in files.shards.values():
            for file, shard in named:
                writer.write_bytes(save.temporary(file), shard.size, 0, shard.header)
    for one in held.sources:
        source = one.source
        if not every and source.accessor is None:
            continue
        whole = source.accessor is None and all(g.kind is Partitioning.REPLICATED for g in source.layout.groups)
        tensors: Iterable[tuple[str, torch.Tensor]]
        if whole:
            tensors = [
                (s.name, b[k])
                for g, b in zip(source.layout.groups, one.local.buffers)
                for k, s in enumerate(g.params)
                if isinstance(b, list)
            ]
        else:
            call = OpenCall(
                entrance,
                name=f"save_training_state:{one.stem}",
                streaming=True,
                kind=one.kind,
                params=list(source.params),
                dispatcher=ctx.dispatcher,
                optimizer=optimizer,
                models=ctx.models,
            )
            stream = FullStateStream(call, copy=False)  # each valid until the next: written at once
            tensors = stream
            streams.append(stream)
        for name, tensor in itertools.chain(tensors, held.buffers if one.stem == "model" and every else ()):
            if writing:
                place = files.placed[(one.stem, name)]
                writer.write(save.temporary(place.file), place.size, place.offset, tensor, place.entry.dtype, False)
    return [stream.record() for stream in streams]  # once consumed: what each sent


def _shared_json(held: _Held) -> bytes:
    """What every rank must hold the same, as the manifest writes it (a value JSON cannot hold raises
    here, on the rank that holds it)."""
    probe = Manifest("", {}, {}, {}, {}, held.param_groups, held.param_states, held.lr_scheduler, held.counters)
    return probe.to_json()


def _manifest(model: adapters.Model, held: _Held, files: Files, generation: str, world: int) -> Manifest:
    layout = next(one.source.layout.variant for one in held.sources if one.stem == "fp32")
    saved_by = {"framework": model.framework, "layout": layout, "world_size": world}
    return Manifest(
        generation,
        saved_by,
        files.mapped("model"),
        files.mapped("fp32"),
        {key: files.mapped(f"optimizer-{k}") for k, key in enumerate(held.keys)},
        held.param_groups,
        held.param_states,
        held.lr_scheduler,
        held.counters,
    )


# -------------------------------------------------------------------------------------------------- load


@_compat.uncollected  # the whole job: its allocations set off full collections of the heap
def load_training_state(
    model: object,
    directory: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    strict: bool = True,
    verify: bool = True,
    dispatcher: Dispatcher | None = None,
) -> LoadedTrainingState:
    """Resume ``model`` from the training state ``save_training_state`` wrote to ``directory``, whatever
    world size, ZeRO stage or framework wrote it: every fp32 master weight, per-element optimizer state
    and step count bitwise the saved one, the module's weights the masters in the module's dtype (frozen
    parameters and buffers as saved), the param groups' hyperparameters, the LR scheduler's state and
    the framework's counters as saved. An optimizer that has never stepped is given its states first,
    as its first step would make them.

    Each rank reads the ranges it holds, or as ``load_full_model`` does where they are small or every rank
    holds them alike: its turn of them, the rest brought by the group's ranks. The manifest and the
    headers are read by the group's first rank and broadcast where that pays (from 12 ranks). Files are
    untrusted: every rank checks the manifest, every header and every file name, and the checkpoint
    against the model (names, shapes, param groups, the optimizer's state keys), before any state changes; a
    refusal on any rank raises on every rank and leaves the model and optimizer as they were.
    ``strict=False``: parameters on one side only are left out and named in the result (shapes must
    still match, and the optimizer's keys).

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``forward()``/``step()``. Returns a ``LoadedTrainingState``.
    """
    start = time.perf_counter()
    ctx = Context.of(dispatcher)
    path = os.fspath(directory)
    entrance = adapters.enter(model)
    resolved, error, group, me = entrance
    undo: Callable[[], None] | None = None
    manifest: Manifest | None = None
    matched: _Matched | None = None
    view: OptimizerView | None = None
    scheduler = None
    differ = 0  # where this rank's reads differ from the save's hashes (see _differing)
    planned: Reads | None = None
    everywhere = entrance.model_group
    index, world = position(everywhere, me)
    # the manifest and every header read by the group's first rank, sent to the others: each checks them
    moved = Tally()  # the collectives that move checkpoint bytes between the ranks
    metadata = metadata_once(everywhere, me, ctx.dispatcher.timeout, lambda: _metadata(path, verify), moved)
    header_bytes = metadata.bytes_read
    try:
        if resolved is not None:
            refuse_layout(resolved)
            manifest, checkpoints, pieces = metadata.get()
            view = resolved.optimizer_view(optimizer)
            scheduler = resolved.lr_scheduler(lr_scheduler)
            _check_rest(path, manifest, scheduler, strict)
            if manifest.optimizer:
                undo = create_states(view)
            matched = _match(ctx, resolved, view, optimizer, manifest, checkpoints, strict)
            planned = planned_reads(
                matched.sources, matched.buffers, matched.stored, index, world, costs=io_costs(path)
            )
            if verify:  # the bytes this rank reads, against the save's hashes, before anything changes
                differ = _differing(path, manifest, planned, pieces.get())
    except (CollgradError, OSError, ValueError, TypeError, KeyError) as caught:
        error = caught
    compared = (
        "arguments or checkpoints (directory, strict; or the files: their names and headers; or the costs of its "
        "I/O: the file system it lies on, COLLGRAD_IO_CALL_SECONDS, COLLGRAD_NETWORK_BYTES_PER_SECOND, "
        "COLLGRAD_SHARED_READ_BYTES)"
    )
    phases = Phases(everywhere, me, "load_training_state", compared, ctx.dispatcher.timeout)
    try:
        shared = None if planned is None else planned.fingerprint()
        seen = stable_hash((path, strict, None if matched is None else matched.seen, shared))
        what = "check the training state against the model"
        rows = phases.agree(error, what, arguments=seen, extra=(differ,))
        if any(row[2] for row in rows):  # a file some rank read differs: every rank names the same one
            assert manifest is not None  # else the agreement raised
            raise differs(path, sorted(manifest.files()), [row[2] for row in rows if row[2]])
    except CollgradError:
        if undo is not None:
            undo()
        raise
    assert manifest is not None and matched is not None and view is not None and resolved is not None
    assert planned is not None  # with the rest: else the agreement raised
    bytes_read, error = read_together(matched.sources, matched.buffers, planned, ctx.dispatcher, everywhere, moved)
    phases.agree(error, "read its part of the training state")
    _apply(resolved, view, scheduler, manifest, matched)
    files = sorted({s.file for s in matched.stored.values()})
    seconds = time.perf_counter() - start
    missing, unexpected = matched.missing, matched.unexpected
    loaded = (path, tuple(files), matched.tensors, bytes_read, header_bytes, seconds, missing, unexpected)
    loaded_moved = (*loaded, moved.collectives, moved.bytes)
    return LoadedTrainingState(*loaded_moved, states=tuple(manifest.optimizer), created_states=undo is not None)


@dataclass
class _Matched:
    """A checkpoint matched with the model on this rank: the sources a load writes (the module's
    weights first), the stored tensor each of their names takes by (stem, name), the buffers, the
    optimizer's states that are not per element by holder, what every rank compares, and what did not
    match."""

    sources: list[Opened]
    stored: dict[tuple[str, str], Stored]
    buffers: list[tuple[str, torch.Tensor]]
    tensors: int
    param_states: list[tuple[torch.Tensor, Mapping[str, Any]]]
    seen: list[object]
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


def _differing(path: str, manifest: Manifest, planned: Reads, pieces: list[hashes.Piece] | None) -> int:
    """The pieces of the files this rank reads (``planned.here()``) that overlap its ranges, hashed against
    ``pieces``, what the save recorded (verify.py's ``differing``: 0, or 1 + the index of a file that
    differs). Local."""
    assert pieces is not None, "a verified load reads the recorded pieces"
    return differing(path, pieces, sorted(manifest.files()), planned.here())


@_compat.uncollected
def _metadata(path: str, verify: bool) -> tuple[Manifest, dict[str, Checkpoint], Once[list[hashes.Piece] | None]]:
    """The training state's manifest, every file it names opened (``_checkpoints``) and, for a verified
    load, the pieces its hash files record (``verify.recorded_pieces``, its refusal kept for the load's
    own order): what the group reads once (``metadata_once``)."""
    manifest = read_manifest(path)
    pieces = deferred(lambda: recorded_pieces(path, manifest) if verify else None)
    return manifest, _checkpoints(path, manifest), pieces


def _checkpoints(path: str, manifest: Manifest) -> dict[str, Checkpoint]:
    """Every file of the manifest opened, each header checked, by what it holds ("model", "fp32",
    "optimizer:<key>")."""
    where = manifest_path(path)
    out = {"model": open_mapped(path, manifest.weights, where)}
    if manifest.fp32:
        out["fp32"] = open_mapped(path, manifest.fp32, where)
    for key, mapped in manifest.optimizer.items():
        out[f"optimizer:{key}"] = open_mapped(path, mapped, where)
    return out


def _check_rest(path: str, manifest: Manifest, scheduler: Any, strict: bool) -> None:
    if strict and (scheduler is None) != (manifest.lr_scheduler is None):
        has = "holds an LR scheduler's state" if manifest.lr_scheduler is not None else "holds no LR scheduler's state"
        raise refused(
            path,
            f"{has}, and this model {'has' if scheduler is not None else 'has no'} scheduler: pass lr_scheduler= "
            "(or none), or strict=False",
        )


@_compat.uncollected
def _match(
    ctx: Context,
    model: adapters.Model,
    view: OptimizerView,
    optimizer: Any,
    manifest: Manifest,
    checkpoints: Mapping[str, Checkpoint],
    strict: bool,
) -> _Matched:
    """The checkpoint matched with the model: names (trainable ones against the masters, every
    parameter and buffer against the weights), shapes, the optimizer's per-element keys and param
    groups; CheckpointError (this rank) for what differs. Opens the sources a load writes. Local."""
    where = manifest_path(checkpoints["model"].directory)
    weights = opened(ctx, model, "model", WEIGHTS, optimizer, loading=True)
    shaped = shapes(weights.source)  # as the unsharded model has them (what this rank holds a part of)
    whole = {n: whole_name(weights.source, n) for n in view.holders}  # the unsharded model's names
    trainable = set(whole.values())
    elsewhere = others(weights.source)  # other expert-parallel ranks' experts: in the checkpoint, not here
    buffers = dict(persistent_buffers(model.module))
    stored_weights = checkpoints["model"].tensors
    masters = checkpoints["fp32"].tensors if "fp32" in checkpoints else {}
    # the one match (match.py), twice: the trainable parameters against the masters, every parameter
    # and buffer against the weights (a trainable one is taken from its master where there is one)
    known = [*shaped, *buffers, *elsewhere]
    in_masters = match(where, {n: shaped[n] for n in whole.values()}, masters, others=known)
    in_weights = match(
        where, {**shaped, **{n: tuple(b.shape) for n, b in buffers.items()}}, stored_weights, others=elsewhere
    )
    missing = [*in_masters.missing, *(n for n in in_weights.missing if n not in trainable)]
    unexpected = list(dict.fromkeys([*in_masters.unexpected, *in_weights.unexpected]))
    refuse_unmatched(where, missing, unexpected, strict)
    # trainable weights from the masters (the module's weights are the masters in its dtype), the rest as saved
    taken = {
        n: masters[n] if n in trainable and n in masters else stored_weights[n]
        for n in shaped
        if n in masters or n in stored_weights
    }
    sources = [weights]
    stored = {("model", n): s for n, s in taken.items()}
    stored.update((("model", n), stored_weights[n]) for n in buffers if n in stored_weights)
    loaded = [n for n, w in whole.items() if w in masters]  # by the names here (what the sources select)
    if FP32 in model.load_kinds() and loaded:
        sources.append(opened(ctx, model, "fp32", FP32, optimizer, loaded, loading=True))
        stored.update((("fp32", whole[n]), masters[whole[n]]) for n in loaded)
    keys = _state_keys(view)
    if manifest.optimizer and tuple(sorted(manifest.optimizer)) != keys:
        raise refused(
            where,
            f"holds the optimizer states {sorted(manifest.optimizer)}, the optimizer here {list(keys)}: resume with "
            "the optimizer that saved it",
        )
    for key in manifest.optimizer:
        found = checkpoints[f"optimizer:{key}"].tensors
        lacking = [whole[n] for n in loaded if whole[n] not in found]
        if lacking:
            raise refused(where, f"holds no optimizer state {key!r} of {listed(lacking)}")
        wrong = [whole[n] for n in loaded if found[whole[n]].shape != shaped[whole[n]]]
        if wrong:
            raise refused(
                where,
                f"its optimizer state {key!r} of {listed(wrong)} is not shaped as the parameter",
            )
        stem = f"optimizer:{key}"
        sources.append(opened(ctx, model, stem, OptimizerState(key), optimizer, loaded, loading=True))
        stored.update(((stem, whole[n]), found[whole[n]]) for n in loaded)
    _check_groups(where, manifest, view, _spread(weights))
    param_states = _param_states(where, manifest, view, {n: whole[n] for n in loaded})
    # what every rank must see alike: every tensor of the checkpoint (a rank loads only its own experts
    # of a MoE layer spread over expert-parallel ranks: Checkpoint.digest), and what did not match
    seen: list[object] = [sorted((k, c.digest) for k, c in checkpoints.items()), missing, unexpected]
    kept = [(n, b) for n, b in buffers.items() if n in stored_weights]
    tensors = len(taken) + len(kept)
    return _Matched(sources, stored, kept, tensors, param_states, seen, tuple(missing), tuple(unexpected))


def _check_groups(where: str, manifest: Manifest, view: OptimizerView, spread: Spread) -> None:
    """The model's param groups hold the parameters the checkpoint's did, group by group (by the
    unsharded model's names)."""
    mine = _groups(view, spread)
    if len(mine) != len(manifest.param_groups) or any(
        set(a.params) != set(b.params) for a, b in zip(mine, manifest.param_groups)
    ):
        theirs = [len(g.params) for g in manifest.param_groups]
        here = [len(g.params) for g in mine]
        raise refused(
            where,
            f"its optimizer's param groups (parameters per group: {theirs}) are not this optimizer's ({here}): "
            "build the optimizer with the same groups",
        )


def _param_states(
    where: str, manifest: Manifest, view: OptimizerView, loaded: Mapping[str, str]
) -> list[tuple[torch.Tensor, Mapping[str, Any]]]:
    """Each holder's saved states that are not per element: the same for every parameter it holds
    (ZeRO keys one state by a group's flat partition), CheckpointError (this rank) otherwise.
    ``loaded``: the parameters loaded, by their names here, each the unsharded model's name."""
    out: dict[int, tuple[torch.Tensor, Mapping[str, Any], str]] = {}
    for here, name in loaded.items():
        holder = view.holders[here]
        saved = manifest.param_states.get(name, {})
        kept = out.get(id(holder))
        if kept is None:
            out[id(holder)] = (holder, saved, name)
        elif kept[1] is not saved and _json_of(kept[1]) != _json_of(saved):  # one value read once: the same
            raise refused(
                where,
                f"the optimizer's states of {kept[2]} and {name} ({listed(sorted(saved))}) differ, and this optimizer "
                "keeps one for both (one ZeRO param group): resume where they were saved apart",
            )
    return [(holder, saved) for holder, saved, _ in out.values()]


def _json_of(values: Mapping[str, Any]) -> str:
    return repr(encode(dict(values), "a state"))


def _apply(model: adapters.Model, view: OptimizerView, scheduler: Any, manifest: Manifest, matched: _Matched) -> None:
    """What is not a tensor of the model's shape put back once every range is read: each holder's
    states that are not per element (step counts: in the dtype and on the device the optimizer keeps
    them), the hyperparameters, the scheduler's state, the framework's counters. Local."""
    for holder, saved in matched.param_states:
        held = view.optimizer.state.setdefault(holder, {})
        for key, value in saved.items():
            now = held.get(key)
            if isinstance(value, torch.Tensor):  # a tensor of its own per holder: optimizers step them in place
                value = value.to(now.device, now.dtype, copy=True) if isinstance(now, torch.Tensor) else value.clone()
            held[key] = copy.deepcopy(value) if isinstance(value, (list, dict)) else value
    for group, kept in zip(view.optimizer.param_groups, manifest.param_groups):
        for key, value in kept.hyperparameters.items():
            if key in model.layout_keys:  # what the group is here, not a hyperparameter of the run
                continue
            now = group.get(key)
            if isinstance(now, torch.Tensor) and isinstance(value, torch.Tensor):
                now.copy_(value)
            else:
                group[key] = value
    if scheduler is not None and manifest.lr_scheduler is not None:
        scheduler.load_state_dict(dict(manifest.lr_scheduler))
    known = model.counters()
    model.set_counters({k: v for k, v in manifest.counters.items() if k in known})
    view.linked()
