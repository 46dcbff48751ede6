"""``save_training_state`` / ``load_training_state``: the whole training state in one checkpoint that does
not depend on the world size, the ZeRO stage or the framework that wrote it, each rank writing and
reading only the ranges it holds.

    directory/
      training_state.json                      the manifest (manifest.py): what is where, the rest as JSON
      model.safetensors.index.json              the module's weights, as from_pretrained loads them
      model-<gen>-00001-of-0000N.safetensors    ... every parameter (frozen ones too) and persistent buffer
      fp32-<gen>-00001-of-0000N.safetensors     the fp32 master weights of the trainable parameters
      optimizer-<k>-<gen>-00001-of-....         each per-element optimizer state (exp_avg, ...), by key

Every tensor is whole in its file, as ``save_full_model`` writes it, so any layout can take it back.

save   check: every rank opens the sources (weights, masters, each state), reads what is not per
         element, and writes a probe file -> agreement 1: arguments, those values the same on every
         rank, the save's generation (rank 0's)
       shared: every rank sees every probe -> agreement 2 (else refused: the ranks must share the
         directory)
       write: the files laid out from the layouts (every rank the same), each rank writing the
         fragments it holds at their final offsets and its share of what every rank holds whole;
         fsync -> agreement 3 (a failure anywhere: the new files removed, the old checkpoint intact)
       commit: rank 0 renames the manifest and the index into place (the manifest last: it is the
         checkpoint), removes the files of the previous one -> agreement 4
load   check: manifest, headers and index (untrusted), names, shapes, param groups and states
         against the model; optimizer states created where it never stepped -> agreement 1 (a refusal:
         those states removed again, nothing else touched)
       read: each rank its own ranges (load.py's plan) -> agreement 2
       then the rest: step counts, hyperparameters, the LR scheduler, the framework's counters
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.core.buffers import Pieces
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.errors import CheckpointError, CollgradError, InvalidArgumentError, LayoutChangedError
from collgrad.state import adapters
from collgrad.state.adapters.base import LocalGrads, OptimizerView, Problem, Source, create_states, rank_in
from collgrad.state.call import OpenCall, source_of
from collgrad.state.files import Checkpoint, Stored, open_mapped
from collgrad.state.kinds import FP32, WEIGHTS, OptimizerState, StateKind
from collgrad.state.layout import Partitioning, owned_fragments
from collgrad.state.load import Into, _plan, execute
from collgrad.state.manifest import MANIFEST_NAME, Manifest, ParamGroup, encode, read_manifest
from collgrad.state.outcome import agree_outcome
from collgrad.state.read import FullStateStream
from collgrad.state.record import StateRecord
from collgrad.state.save import DEFAULT_MAX_SHARD_BYTES, persistent_buffers
from collgrad.state.shards import (
    INDEX_NAME,
    SINGLE_NAME,
    STALE,
    Entry,
    RangeWriter,
    Shard,
    bytes_of,
    cut_shards,
    follows_on,
    remove_all,
    remove_later,
    shared,
    stale_name,
)

__all__ = [
    "save_training_state",
    "load_training_state",
    "SavedTrainingState",
    "LoadedTrainingState",
    "Files",
    "Placed",
    "lay_out",
    "write_headers",
    "joined_writes",
    "write_small",
    "commit",
    "discard",
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


@dataclass(frozen=True)
class LoadedTrainingState:
    """What ``load_training_state`` did on this rank: the files it read, the tensors and optimizer states
    it loaded, the bytes of data and headers it read, whether it created the optimizer's states (an
    optimizer that had never stepped), the seconds it took, and with ``strict=False`` what did not match."""

    directory: str
    files: tuple[str, ...]
    tensors: int
    states: tuple[str, ...]
    bytes_read: int
    header_bytes: int
    created_states: bool
    seconds: float
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------- what it holds


@dataclass
class _Held:
    """A model's training state as this rank holds it: each kind's source with this rank's view of it
    (file stem, kind, source, local), the persistent buffers, and what is not a tensor of the model's shape."""

    sources: list[tuple[str, StateKind, Source, LocalGrads]]
    buffers: list[tuple[str, torch.Tensor]]
    keys: tuple[str, ...]
    param_groups: tuple[ParamGroup, ...]
    param_states: dict[str, dict[str, Any]]
    lr_scheduler: dict[str, Any] | None
    counters: dict[str, int | float]


def _opened(
    model: adapters.Model, kind: StateKind, optimizer: Any, names: list[str] | None
) -> tuple[Source, LocalGrads]:
    """The source of ``kind`` of ``names`` (None: every parameter) and this rank's view of it, checked
    to be readable in place; LayoutChangedError or InvalidArgumentError (this rank) otherwise."""
    source = source_of(model, kind, optimizer, params=names)[0]
    if source.model_parallel:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {sorted(source.model_parallel)[0]} is a tensor- or expert-parallel shard: a "
            "training state holds data-parallel models only"
        )
    local = source.read()
    if local.problem is not Problem.OK:
        raise LayoutChangedError(
            f"rank {_compat.rank()}: the {kind.describe()} cannot be read here ({local.problem.describe()}"
            f"{'; ' + local.detail if local.detail else ''})"
        )
    return source, local


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


def _scalars(view: OptimizerView, keys: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every trainable parameter's optimizer state that is not per element (``step``, ...), by name."""
    out = {}
    for name, holder in view.holders.items():
        held = view.optimizer.state.get(holder) or {}
        out[name] = {k: v for k, v in held.items() if k not in keys}
    return out


def _groups(view: OptimizerView) -> tuple[ParamGroup, ...]:
    names: list[list[str]] = [[] for _ in view.optimizer.param_groups]
    for name, index in view.groups.items():
        names[index].append(name)
    return tuple(
        ParamGroup(tuple(n), {k: v for k, v in g.items() if k != "params"})
        for n, g in zip(names, view.optimizer.param_groups)
    )


def _held(model: adapters.Model, optimizer: Any, lr_scheduler: Any) -> _Held:
    """What a save writes, as this rank holds it. Local."""
    view = model.optimizer_view(optimizer)
    keys = _state_keys(view)
    trainable = list(view.holders)
    sources: list[tuple[str, StateKind, Source, LocalGrads]] = [
        ("model", WEIGHTS, *_opened(model, WEIGHTS, optimizer, None))
    ]
    sources.append(("fp32", FP32, *_opened(model, FP32, optimizer, trainable)))
    for k, key in enumerate(keys):
        kind = OptimizerState(key)
        sources.append((f"optimizer-{k}", kind, *_opened(model, kind, optimizer, trainable)))
    if keys and any(source.accessor is not None for _, _, source, _ in sources):
        view.linked()  # DeepSpeed's accessors read the states through links a checkpoint save may have dropped
    scheduler = model.lr_scheduler(lr_scheduler)
    state = None if scheduler is None else scheduler.state_dict()
    return _Held(
        sources,
        list(persistent_buffers(model.module)),
        keys,
        _groups(view),
        _scalars(view, keys),
        state,
        model.counters(),
    )


# ------------------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Placed:
    """Where a tensor lies in a checkpoint being written: its file (path, size), its bytes' offset, its entry."""

    path: str
    size: int
    offset: int
    entry: Entry


@dataclass(frozen=True)
class Files:
    """A save's files, laid out before any byte moves: by file stem, its shards and the name of each;
    where each tensor lies, by (stem, name)."""

    directory: str
    shards: Mapping[str, tuple[tuple[str, Shard], ...]]
    placed: Mapping[tuple[str, str], Placed]

    def mapped(self, stem: str) -> dict[str, str]:
        """The file each tensor of ``stem`` is in, by name (as an index's ``weight_map``)."""
        return {e.name: file for file, shard in self.shards.get(stem, ()) for e in shard.entries}


def _entries(source: Source, local: LocalGrads) -> list[Entry]:
    """Every tensor of ``source`` as written: its layout's order, the dtype it is held in."""
    out = []
    for position, group in enumerate(source.layout.groups):
        buffer = local.buffers[position]
        for k, slot in enumerate(group.params):
            if source.accessor is not None:  # DeepSpeed's accessors return fp32 (masters, their states)
                dtype = torch.float32
            else:
                dtype = buffer[k].dtype if isinstance(buffer, list) else group.wire_dtype
            out.append(Entry(slot.name, slot.shape, dtype))
    return out


def lay_out(directory: str, entries: Mapping[str, Sequence[Entry]], generation: str, max_shard_bytes: int) -> Files:
    """Every file of a save and the place of every tensor in it, from each file stem's tensors in order
    (``model``: the weights and buffers, ``fp32``, ``optimizer-<k>``: the k-th key of the manifest's
    optimizer states), each stem cut into shards of at most ``max_shard_bytes``: the same on every
    rank. Pure."""
    shards: dict[str, tuple[tuple[str, Shard], ...]] = {}
    placed: dict[tuple[str, str], Placed] = {}
    for stem, listed in entries.items():
        if not listed:
            continue
        cut = cut_shards(tuple(listed), max_shard_bytes)
        named = tuple((f"{stem}-{generation}-{k + 1:05d}-of-{len(cut):05d}.safetensors", s) for k, s in enumerate(cut))
        shards[stem] = named
        for file, shard in named:
            path = os.path.join(directory, file)
            for entry, offset in zip(shard.entries, shard.offsets):
                placed[(stem, entry.name)] = Placed(path, shard.size, offset, entry)
    return Files(directory, shards, placed)


def _entries_of(held: _Held) -> dict[str, list[Entry]]:
    """Each file stem's tensors as this rank's sources lay them out (the same on every rank)."""
    out = {}
    for stem, _, source, local in held.sources:
        out[stem] = _entries(source, local)
        if stem == "model":
            out[stem] += [Entry(n, tuple(b.shape), b.dtype) for n, b in held.buffers]
    return out


def _writes(held: _Held, files: Files, index: int, world: int) -> Iterator[tuple[Placed, int, torch.Tensor]]:
    """What this rank writes, as (tensor's place, first element, values): the fragments it holds of
    every partitioned tensor, and its share of the tensors every rank holds whole (each written by one
    rank, the ranks taking turns through each file's bytes). Local."""
    for stem, _, source, local in held.sources:
        if source.accessor is not None:  # read only through DeepSpeed's accessors: streamed (``_stream``)
            continue
        whole: list[tuple[str, torch.Tensor]] = []
        for group, buffer in zip(source.layout.groups, local.buffers):
            if group.kind is Partitioning.REPLICATED:
                assert isinstance(buffer, list)
                whole.extend((slot.name, buffer[k]) for k, slot in enumerate(group.params))
                continue
            assert isinstance(buffer, Pieces)
            for fragment in owned_fragments(group, rank_in(group)):
                place = files.placed[(stem, group.params[fragment.param].name)]
                for view, at in buffer.spans(fragment.local_offset, fragment.numel):
                    yield place, fragment.param_offset + at, view
        if stem == "model":
            whole += held.buffers
        for name, tensor in _share(whole, [files.placed[(stem, n)] for n, _ in whole], index, world):
            yield files.placed[(stem, name)], 0, tensor


def _share(
    whole: Sequence[tuple[str, torch.Tensor]], places: Sequence[Placed], index: int, world: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share of tensors every rank holds whole (``shards.shared``: contiguous runs of their
    bytes per rank). Pure."""
    for k in shared([p.entry.nbytes for p in places], index, world):
        yield whole[k]


def _write(held: _Held, files: Files, index: int, world: int, writer: RangeWriter) -> None:
    """This rank's part of every file written (rank 0 also every header), at its offsets. Failures are
    kept in ``writer.error``."""
    if index == 0:
        write_headers(files, writer)
    with torch.no_grad():
        for path, size, offset, data in joined_writes(_writes(held, files, index, world)):
            if writer.error is not None:
                return
            writer.write(path, size, offset, bytes_of(data))


def write_headers(files: Files, writer: RangeWriter) -> None:
    """Every shard's header written at the start of its file (by one writer). Failures are kept in
    ``writer.error``."""
    for named in files.shards.values():
        for file, shard in named:
            writer.write(os.path.join(files.directory, file), shard.size, 0, memoryview(shard.header))


def joined_writes(writes: Iterable[tuple[Placed, int, torch.Tensor]]) -> Iterator[tuple[str, int, int, torch.Tensor]]:
    """Each write as (file, its size, byte offset, contiguous CPU values in the file's dtype), joined
    with the one before where its bytes follow in the file and its values in memory (ZeRO's flat
    partitions, the weights' flat buffer: one write per file). One at a time, as they come: a value
    cast to the file's dtype is held only until it is written. Local."""
    held: tuple[str, int, int, torch.Tensor] | None = None
    for place, lo, values in writes:
        data = values.detach().reshape(-1)
        if data.device.type != "cpu" or data.dtype != place.entry.dtype:
            data = data.to("cpu", place.entry.dtype)
        data = data.contiguous()
        if not data.numel():
            continue
        offset = place.offset + lo * place.entry.dtype.itemsize
        if held is not None:
            path, size, at, before = held
            together = follows_on((path, at, before), place.path, offset, data)
            if together is not None:
                held = (path, size, at, together)
                continue
            yield held
        held = (place.path, place.size, offset, data)
    if held is not None:
        yield held


def _stream(
    entrance: adapters.Entrance,
    held: _Held,
    files: Files,
    index: int,
    optimizer: Any,
    dispatcher: Dispatcher,
    writer: RangeWriter,
    every: bool,
) -> list[StateRecord]:
    """Tensors written whole by rank 0 as streams bring them: ``every`` one, headers included, where the
    ranks do not share the directory, else only the kinds read through DeepSpeed's accessors. A kind
    partitioned among the ranks streamed to every rank a bucket at a time (one collective per bucket),
    what every rank holds whole written as it is. Collective: every rank takes part in every stream,
    whatever fails (failures are kept in ``writer.error``). Returns the streams' records."""
    streams: list[FullStateStream] = []
    if index == 0 and every:
        write_headers(files, writer)
    for stem, kind, source, local in held.sources:
        if not every and source.accessor is None:
            continue
        whole = source.accessor is None and all(g.kind is Partitioning.REPLICATED for g in source.layout.groups)
        tensors: Iterable[tuple[str, torch.Tensor]]
        if whole:
            tensors = [
                (s.name, b[k])
                for g, b in zip(source.layout.groups, local.buffers)
                for k, s in enumerate(g.params)
                if isinstance(b, list)
            ]
        else:
            call = OpenCall(
                entrance,
                name=f"save_training_state:{stem}",
                streaming=True,
                kind=kind,
                params=list(source.params),
                dispatcher=dispatcher,
                optimizer=optimizer,
            )
            stream = FullStateStream(call, copy=False)  # each valid until the next: written at once
            tensors = stream
            streams.append(stream)
        for name, tensor in itertools.chain(tensors, held.buffers if stem == "model" and every else ()):
            if index == 0:
                place = files.placed[(stem, name)]
                data = tensor.detach().reshape(-1).to("cpu", place.entry.dtype).contiguous()
                if data.numel():
                    writer.write(place.path, place.size, place.offset, bytes_of(data))
    return [stream.record() for stream in streams]  # once consumed: what each sent


# -------------------------------------------------------------------------------------------------- save


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
    ``training_state.json``. ``load_training_state`` resumes it at any world size, ZeRO stage or
    framework.

    ``model``: a DeepSpeed engine (or the module it wraps: its own optimizer and scheduler are saved), an
    FSDP2 root or a plain module (pass ``optimizer`` and ``lr_scheduler``).

    Each rank writes the ranges it holds straight to their final offsets in the shared files (what
    every rank holds whole, the ranks share); no collective carries any state, only four small
    agreements. Where the ranks do not share ``directory`` (found out at the start: each looks for the
    others' probe files), rank 0 writes the whole checkpoint into its own, every partitioned kind
    streamed to it one bucket at a time (as ``save_full_model`` does). A state that is not per
    element must be the same on every rank, or the save is refused. Never half a checkpoint: the new
    files carry a new generation in their names, flushed to the disk before the manifest (the
    checkpoint) is renamed into place; a failure on any rank raises on every rank and leaves the
    previous checkpoint in ``directory`` as it was.

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``forward()``/``step()``. Returns a ``SavedTrainingState``.
    """
    start = time.perf_counter()
    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    path = os.fspath(directory)
    resolved, error, group, me = adapters.enter(model)
    held: _Held | None = None
    fingerprint = 0
    try:
        if resolved is not None:
            if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
                raise InvalidArgumentError(
                    f"rank {me}: max_shard_bytes must be a positive int, got {max_shard_bytes!r}"
                )
            held = _held(resolved, optimizer, lr_scheduler)
            fingerprint = stable_hash(_shared_json(held))
            os.makedirs(path, exist_ok=True)
            _probe(path, me)
    except (CollgradError, OSError, ValueError, TypeError, KeyError) as caught:
        error = caught
    ranks = list(_compat.group_ranks(group)) if group is not None else [me]
    call = "save_training_state"
    rows = agree_outcome(
        group,
        me,
        error,
        call=call,
        what="check the model and make the directory",
        timeout_s=dispatcher.timeout,
        arguments=stable_hash((path, max_shard_bytes)),
        compared="arguments (directory, max_shard_bytes)",
        extra=(fingerprint, secrets.randbits(62)),
    )
    assert resolved is not None and held is not None  # else an agreement raised
    if len({row[2] for row in rows}) > 1:
        _unprobe(path, me)
        raise InvalidArgumentError(
            f"rank {me}: the optimizer's states that are not per element (its step counts), its param groups, "
            "the LR scheduler's state or the framework's counters differ between the ranks: a training state holds "
            "them once, so they must be the same on every rank"
        )
    generation = f"{rows[0][3]:016x}"
    sees = all(os.path.exists(os.path.join(path, f".collgrad-probe-{r}")) for r in ranks)
    rows = agree_outcome(
        group, me, None, call=call, what="look for the others' files", timeout_s=dispatcher.timeout, extra=(int(sees),)
    )
    _unprobe(path, me)
    shared = all(row[2] for row in rows)
    index, world = ranks.index(me), len(ranks)
    files = lay_out(path, _entries_of(held), generation, max_shard_bytes)
    writer = RangeWriter()
    manifest = _manifest(resolved, held, files, generation, world)
    temporaries: list[tuple[str, str]] = []
    records: list[StateRecord] = []
    try:
        entrance = adapters.Entrance(resolved, None, group, me)
        if shared:
            _write(held, files, index, world, writer)
        # each rank's directory its own: rank 0 writes every tensor as the streams bring it; else only
        # what DeepSpeed's accessors read (BF16_Optimizer's masters and states, NVMe-swapped ZeRO-3)
        records = _stream(entrance, held, files, index, optimizer, dispatcher, writer, every=not shared)
        writer.finish()
        if index == 0 and writer.error is None:
            temporaries = write_small(path, manifest, files, generation)
    except OSError as caught:
        writer.error = caught
    except InvalidArgumentError as caught:  # a value JSON cannot hold (found on every rank alike)
        writer.error = caught
    try:
        agree_outcome(
            group, me, writer.error, call=call, what="write its part of the files", timeout_s=dispatcher.timeout
        )
    except CollgradError:
        discard(writer, temporaries)
        raise
    error = None
    if index == 0:
        try:
            commit(path, temporaries, set(manifest.files()))
        except OSError as caught:
            error = caught
    agree_outcome(group, me, error, call=call, what="put the checkpoint in place", timeout_s=dispatcher.timeout)
    names = (*manifest.files(), *(os.path.basename(final) for _, final in temporaries))
    data = sum(s.data_bytes for named in files.shards.values() for _, s in named)
    return SavedTrainingState(
        path,
        tuple(names) if index == 0 else (*manifest.files(), INDEX_NAME, MANIFEST_NAME),
        generation,
        len(files.placed),
        data,
        writer.bytes_written,
        time.perf_counter() - start,
        not shared,
        tuple(records),
    )


def _shared_json(held: _Held) -> bytes:
    """What every rank must hold the same, as the manifest writes it (a value JSON cannot hold raises
    here, on the rank that holds it)."""
    probe = Manifest("", {}, {}, {}, {}, held.param_groups, held.param_states, held.lr_scheduler, held.counters)
    return probe.to_json()


def _manifest(model: adapters.Model, held: _Held, files: Files, generation: str, world: int) -> Manifest:
    layout = (
        next(source.layout.variant for stem, _, source, _ in held.sources if stem == "fp32") if held.sources else ""
    )
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


def write_small(path: str, manifest: Manifest, files: Files, generation: str) -> list[tuple[str, str]]:
    """The index and the manifest written under temporary names and flushed to the disk; returns each
    (temporary, final). OSError where the disk refuses them."""
    weight_map = files.mapped("model")
    total = sum(s.data_bytes for _, s in files.shards.get("model", ()))
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
    out = []
    for final, body in ((INDEX_NAME, index.encode()), (MANIFEST_NAME, manifest.to_json())):
        temporary = os.path.join(path, f".{final}.{generation}.tmp")
        with open(temporary, "wb") as f:
            f.write(body)
            f.flush()
            os.fdatasync(f.fileno())
        out.append((temporary, os.path.join(path, final)))
    return out


def discard(writer: RangeWriter, temporaries: Sequence[tuple[str, str]]) -> None:
    """What a failed save wrote removed: the tensor files this rank opened, the index and manifest
    written under temporary names (the previous checkpoint is left as it was)."""
    writer.remove()
    remove_all(temporary for temporary, _ in temporaries)


def commit(path: str, temporaries: Sequence[tuple[str, str]], files: set[str]) -> None:
    """A written checkpoint put in place: the index, then the manifest (the checkpoint) renamed over
    the previous ones, the directory flushed; then the tensor files of earlier saves removed, in the
    background (the interpreter's exit waits for that). OSError where the file system refuses."""
    for temporary, final in temporaries:
        os.replace(temporary, final)
    _sync_directory(path)
    # each earlier file renamed out of the way now (a later save_full_model may write a file of its name
    # before the removal gets to it), removed later
    doomed = []
    for stale in _stale(path, files):
        hidden = stale
        if not os.path.basename(stale).startswith(STALE):
            hidden = stale_name(stale)
            try:
                os.rename(stale, hidden)
            except OSError:
                continue
        doomed.append(hidden)
    remove_later(doomed)


def _probe(path: str, rank: int) -> None:
    with open(os.path.join(path, f".collgrad-probe-{rank}"), "wb") as f:
        f.write(b"0")


def _unprobe(path: str, rank: int) -> None:
    remove_all([os.path.join(path, f".collgrad-probe-{rank}")])


def _sync_directory(path: str) -> None:
    """The directory's entries (the renames) flushed to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stale(path: str, files: set[str]) -> list[str]:
    """The tensor files of earlier saves in ``path`` that this checkpoint does not name (an earlier
    training state's, an earlier ``save_full_model``'s ``model.safetensors`` or shards, which
    ``from_pretrained`` would load before the index), and any left renamed for removal; nothing else."""
    out = []
    for name in os.listdir(path):
        ours = name.endswith(".safetensors") and "-of-" in name and name.startswith(("model-", "fp32-", "optimizer-"))
        if (ours or name == SINGLE_NAME or name.startswith(STALE)) and name not in files:
            out.append(os.path.join(path, name))
    return out


# -------------------------------------------------------------------------------------------------- load


@dataclass
class _Matched:
    """A checkpoint matched with the model on this rank: what each source takes from which file, the
    buffers, the optimizer's states that are not per element by holder, and what did not match."""

    into: list[Into]
    buffers: list[tuple[torch.Tensor, Stored]]
    param_states: list[tuple[torch.Tensor, Mapping[str, Any]]]
    seen: list[object]
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


def load_training_state(
    model: object,
    directory: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    strict: bool = True,
    dispatcher: Dispatcher | None = None,
) -> LoadedTrainingState:
    """Resume ``model`` from the training state ``save_training_state`` wrote to ``directory``, whatever
    world size, ZeRO stage or framework wrote it: every fp32 master weight, per-element optimizer state
    and step count bitwise the saved one, the module's weights the masters in the module's dtype (frozen
    parameters and buffers as saved), the param groups' hyperparameters, the LR scheduler's state and
    the framework's counters as saved. An optimizer that has never stepped is given its states first,
    as its first step would make them.

    Each rank reads only the ranges it holds (load.py's plan); no collective carries any state. Files are
    untrusted: the manifest, every header and every file name are checked, and the checkpoint against
    the model (names, shapes, param groups, the optimizer's state keys), before any state changes; a
    refusal on any rank raises on every rank and leaves the model and optimizer as they were.
    ``strict=False``: parameters on one side only are left out and named in the result (shapes must
    still match, and the optimizer's keys).

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``forward()``/``step()``. Returns a ``LoadedTrainingState``.
    """
    start = time.perf_counter()
    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    path = os.fspath(directory)
    resolved, error, group, me = adapters.enter(model)
    undo: Callable[[], None] | None = None
    manifest: Manifest | None = None
    matched: _Matched | None = None
    view: OptimizerView | None = None
    scheduler = None
    header_bytes = 0
    try:
        if resolved is not None:
            manifest = read_manifest(path)
            checkpoints = _checkpoints(path, manifest)
            header_bytes = sum(c.header_bytes for c in checkpoints.values())
            view = resolved.optimizer_view(optimizer)
            scheduler = resolved.lr_scheduler(lr_scheduler)
            _check_rest(path, manifest, scheduler, strict)
            if manifest.optimizer:
                undo = create_states(view)
            matched = _match(resolved, view, optimizer, manifest, checkpoints, strict)
    except (CollgradError, OSError, ValueError, TypeError, KeyError) as caught:
        error = caught
    try:
        agree_outcome(
            group,
            me,
            error,
            call="load_training_state",
            what="check the training state against the model",
            timeout_s=dispatcher.timeout,
            arguments=stable_hash((path, strict, None if matched is None else matched.seen)),
            compared="arguments or checkpoints (directory, strict; or the files' names, dtypes and shapes)",
        )
    except CollgradError:
        if undo is not None:
            undo()
        raise
    assert manifest is not None and matched is not None and view is not None and resolved is not None
    bytes_read, error = execute(_plan(matched.into, matched.buffers))
    agree_outcome(
        group,
        me,
        error,
        call="load_training_state",
        what="read its part of the training state",
        timeout_s=dispatcher.timeout,
    )
    _apply(resolved, view, scheduler, manifest, matched)
    files = sorted({s.file for one in matched.into for s in one.stored.values()})
    return LoadedTrainingState(
        path,
        tuple(files),
        len(matched.into[0].stored) + len(matched.buffers),
        tuple(manifest.optimizer),
        bytes_read,
        header_bytes,
        undo is not None,
        time.perf_counter() - start,
        matched.missing,
        matched.unexpected,
    )


def _checkpoints(path: str, manifest: Manifest) -> dict[str, Checkpoint]:
    """Every file of the manifest opened, each header checked, by what it holds ("model", "fp32",
    "optimizer:<key>")."""
    where = os.path.join(path, MANIFEST_NAME)
    out = {"model": open_mapped(path, manifest.weights, where)}
    if manifest.fp32:
        out["fp32"] = open_mapped(path, manifest.fp32, where)
    for key, mapped in manifest.optimizer.items():
        out[f"optimizer:{key}"] = open_mapped(path, mapped, where)
    return out


def _check_rest(path: str, manifest: Manifest, scheduler: Any, strict: bool) -> None:
    if strict and (scheduler is None) != (manifest.lr_scheduler is None):
        has = "holds an LR scheduler's state" if manifest.lr_scheduler is not None else "holds no LR scheduler's state"
        raise CheckpointError(
            f"rank {_compat.rank()}: {path} {has}, and this model {'has' if scheduler is not None else 'has no'} "
            "scheduler: pass lr_scheduler= (or none), or strict=False; nothing was loaded"
        )


def _refused(path: str, reason: str) -> CheckpointError:
    return CheckpointError(f"rank {_compat.rank()}: {path}: {reason}; nothing was loaded")


def _listed(names: Sequence[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _match(
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
    weights, local = _opened(model, WEIGHTS, optimizer, None)
    shapes = {slot.name: slot.shape for group in weights.layout.groups for slot in group.params}
    trainable = list(view.holders)
    buffers = dict(persistent_buffers(model.module))
    stored_weights = checkpoints["model"].tensors
    masters = checkpoints["fp32"].tensors if "fp32" in checkpoints else {}
    missing = [n for n in trainable if n not in masters]
    missing += [n for n in [*shapes, *buffers] if n not in trainable and n not in stored_weights]
    unexpected = list(dict.fromkeys([*(n for n in masters if n not in view.holders), *stored_weights]))
    unexpected = [n for n in unexpected if n not in shapes and n not in buffers]
    if strict and (missing or unexpected):
        parts = [f"missing from the checkpoint: {_listed(missing)}"] if missing else []
        parts += [f"not in the model: {_listed(unexpected)}"] if unexpected else []
        raise _refused(
            manifest_path(checkpoints),
            f"does not match the model ({'; '.join(parts)}); pass strict=False to load what matches",
        )
    wrong = [
        f"{n}: {list(s.shape)} in the checkpoint, {list(shapes[n])} in the model"
        for found in (stored_weights, masters)
        for n, s in found.items()
        if n in shapes and s.shape != shapes[n]
    ]
    wrong += [
        f"{n}: {list(s.shape)} in the checkpoint, {list(b.shape)} in the model"
        for n, b in buffers.items()
        if (s := stored_weights.get(n)) is not None and s.shape != tuple(b.shape)
    ]
    if wrong:
        raise _refused(manifest_path(checkpoints), f"shapes differ from the model's: {_listed(wrong)}")
    # trainable weights from the masters (the module's weights are the masters in its dtype), the rest as saved
    taken = {
        n: masters[n] if n in view.holders and n in masters else stored_weights[n]
        for n in shapes
        if n in masters or n in stored_weights
    }
    into = [Into(weights, local, taken)]
    kinds = model.load_kinds()
    loaded = [n for n in trainable if n in masters]
    if FP32 in kinds and loaded:
        source, mine = _opened(model, FP32, optimizer, loaded)
        into.append(Into(source, mine, {n: masters[n] for n in loaded}))
    keys = _state_keys(view)
    if manifest.optimizer and tuple(sorted(manifest.optimizer)) != keys:
        raise _refused(
            manifest_path(checkpoints),
            f"holds the optimizer states {sorted(manifest.optimizer)}, the optimizer here {list(keys)}: resume with "
            "the optimizer that saved it",
        )
    for key in manifest.optimizer:
        stored = checkpoints[f"optimizer:{key}"].tensors
        lacking = [n for n in loaded if n not in stored]
        if lacking:
            raise _refused(manifest_path(checkpoints), f"holds no optimizer state {key!r} of {_listed(lacking)}")
        wrong = [n for n in loaded if stored[n].shape != shapes[n]]
        if wrong:
            raise _refused(
                manifest_path(checkpoints),
                f"its optimizer state {key!r} of {_listed(wrong)} is not shaped as the parameter",
            )
        source, mine = _opened(model, OptimizerState(key), optimizer, loaded)
        into.append(Into(source, mine, {n: stored[n] for n in loaded}))
    _check_groups(manifest, view, checkpoints)
    param_states = _param_states(manifest, view, loaded, checkpoints)
    seen: list[object] = [
        sorted((n, str(s.dtype), s.shape, s.file.rsplit("/", 1)[-1]) for one in into for n, s in one.stored.items())
    ]
    return _Matched(
        into,
        [(b, stored_weights[n]) for n, b in buffers.items() if n in stored_weights],
        param_states,
        seen,
        tuple(missing),
        tuple(unexpected),
    )


def manifest_path(checkpoints: Mapping[str, Checkpoint]) -> str:
    return os.path.join(checkpoints["model"].directory, MANIFEST_NAME)


def _check_groups(manifest: Manifest, view: OptimizerView, checkpoints: Mapping[str, Checkpoint]) -> None:
    """The model's param groups hold the parameters the checkpoint's did, group by group."""
    mine = _groups(view)
    if len(mine) != len(manifest.param_groups) or any(
        set(a.params) != set(b.params) for a, b in zip(mine, manifest.param_groups)
    ):
        theirs = [len(g.params) for g in manifest.param_groups]
        here = [len(g.params) for g in mine]
        raise _refused(
            manifest_path(checkpoints),
            f"its optimizer's param groups (parameters per group: {theirs}) are not this optimizer's ({here}): "
            "build the optimizer with the same groups",
        )


def _param_states(
    manifest: Manifest, view: OptimizerView, loaded: list[str], checkpoints: Mapping[str, Checkpoint]
) -> list[tuple[torch.Tensor, Mapping[str, Any]]]:
    """Each holder's saved states that are not per element: the same for every parameter it holds
    (ZeRO keys one state by a group's flat partition), CheckpointError (this rank) otherwise."""
    out: dict[int, tuple[torch.Tensor, Mapping[str, Any], str]] = {}
    for name in loaded:
        holder = view.holders[name]
        saved = manifest.param_states.get(name, {})
        kept = out.get(id(holder))
        if kept is None:
            out[id(holder)] = (holder, saved, name)
        elif kept[1] is not saved and _json_of(kept[1]) != _json_of(saved):  # one value read once: the same
            raise _refused(
                manifest_path(checkpoints),
                f"the optimizer's states of {kept[2]} and {name} ({_listed(sorted(saved))}) differ, and this optimizer "
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
