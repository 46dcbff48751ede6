"""``save_full_model``: a consolidated checkpoint in the layout Hugging Face ``from_pretrained`` loads,
streamed bucket by bucket into safetensors shards (shards.py), never the whole model in one memory.

    agree: arguments, the directory ready on the writing ranks, and which directory each rank sees
      (one small all-gather)
    stream the module's weights (or the fp32 master weights) one bucket at a time (one collective
      per bucket; ZeRO-1/2 and stage 0 hold them whole: none), then the persistent buffers
      the shards are cut the same on every rank; where the ranks see one directory, each writes its
      share of the tensors (a contiguous run of the bytes) into the shards at their offsets, the first
      rank the headers; else shard k's rank writes it
    agree: every rank wrote its part                                      (one small all-gather)
    rename the shards to their final names; the first writing rank adds the index
    agree: done everywhere                                                (one small all-gather)
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.errors import InvalidArgumentError
from collgrad.state import adapters
from collgrad.state.adapters.base import Source, select
from collgrad.state.call import OpenCall
from collgrad.state.kinds import FP32, WEIGHTS, StateKind
from collgrad.state.layout import Partitioning
from collgrad.state.model_cache import MODELS
from collgrad.state.outcome import agree_outcome
from collgrad.state.read import FullStateStream
from collgrad.state.record import StateRecord
from collgrad.state.shards import INDEX_NAME, SAFE_DTYPES, Entry, ShardFiles, cut_shards

__all__ = ["save_full_model", "SavedModel", "DEFAULT_MAX_SHARD_BYTES", "INDEX_NAME"]

#: ``save_pretrained``'s default shard size ("5GB")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class SavedModel:
    """What ``save_full_model`` wrote: every file of the checkpoint (shards in order, then the index if
    there is one), the ones this rank wrote (where the ranks share the writing: put in place, by the
    first rank), how many tensors and bytes of tensor data, the seconds the call took on this rank,
    and the records of the streams that gathered the tensors."""

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

    @property
    def first_writer(self) -> bool:
        """This rank wrote the checkpoint's first file: the one rank to write what goes beside it."""
        return bool(self.written_here) and self.written_here[0] == self.files[0]


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
    (about two buckets of ``bucket_bytes``). No shard appears under its final name
    before every rank has written all of its own; a failure on any rank (a bad directory, a full disk)
    raises on every rank (that rank: CollgradError with the cause; the others: RankFailedError) and
    removes the temporary files.

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``step()``. Returns a ``SavedModel``.
    """
    start = time.perf_counter()
    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    path = os.fspath(directory)
    entrance = adapters.enter(model)
    resolved, error, group, me = entrance
    writers: tuple[int, ...] = (0,)
    names: list[str] | None = None
    plan: _Plan | None = None
    try:
        if resolved is not None:
            writers = _checked(ranks, dtype, max_shard_bytes)
            names = None if params is None else [n for n, _ in select(resolved.module, params, trainable=False)]
            plan = _plan(resolved, dtype, names, dispatcher)
            if me in writers:
                _ready(path, me)
    except (OSError, ValueError, TypeError, KeyError) as caught:
        error, writers, names = caught, (0,), None
    arguments = stable_hash((path, str(dtype), max_shard_bytes, writers, names, ranks is None))
    seen = _directory_seen(path) if ranks is None else 0
    rows = _agree(group, me, error, "check the arguments and make the directory", dispatcher.timeout, arguments, seen)
    assert resolved is not None and plan is not None  # else _agree raised
    everyone = list(_compat.group_ranks(group)) if group is not None else [me]
    # every rank sees rank 0's directory on rank 0's machine: they share the writing
    share = (everyone.index(me), len(everyone)) if ranks is None and all(r[2] == seen != 0 for r in rows) else None
    shards = ShardFiles(cut_shards(tuple(plan.entries), max_shard_bytes), path, writers, me, share)
    if me in writers or share is not None:
        shards.create()
    streams: list[FullStateStream] = []
    try:  # every tensor, whole, as held (ShardFiles converts each as planned), in the plan's order
        for state, chosen, source, whole in plan.parts:
            if whole:
                tensors: Iterable[tuple[str, torch.Tensor]] = ((n, p.detach()) for n, p in source.params.items())
            else:  # one bucket at a time
                streams.append(_stream(entrance, state, chosen, bucket_bytes, dispatcher))
                tensors = streams[-1]
            for name, tensor in tensors:
                shards.put(name, tensor, kept=whole)
        for name, buffer in plan.buffers:
            shards.put(name, buffer)
        shards.finish()
        _agree(group, me, shards.error, "write its shards", dispatcher.timeout)
    except BaseException:
        shards.discard()
        raise
    files, here = shards.commit()
    _agree(group, me, shards.error, "give its shards their final names", dispatcher.timeout)
    seconds = time.perf_counter() - start
    records = tuple(stream.record() for stream in streams)
    data_bytes = sum(s.data_bytes for s in shards.plan)
    return SavedModel(
        path, files, here, len(plan.entries), data_bytes, seconds, records, share is not None, shards.bytes_written
    )


def _checked(ranks: Sequence[int] | None, dtype: torch.dtype | None, max_shard_bytes: int) -> tuple[int, ...]:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    writers = (0,) if ranks is None else tuple(ranks) if not isinstance(ranks, int) else (ranks,)
    if not writers or any(not isinstance(r, int) or not 0 <= r < world for r in writers):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: ranks must name the global ranks that write (0 to {world - 1}), got {ranks!r}"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in SAFE_DTYPES):
        raise InvalidArgumentError(f"rank {_compat.rank()}: dtype must be None or a torch dtype, got {dtype!r}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: max_shard_bytes must be a positive int, got {max_shard_bytes!r}"
        )
    return writers


def _directory_seen(path: str) -> int:
    """Which directory ``path`` is, as this rank sees it: its machine, device and inode (equal on two
    ranks only where they write into one directory), made where it is not there yet; a number no other
    rank tells where this rank cannot make or see it."""
    try:
        os.makedirs(path, exist_ok=True)
        found = os.stat(path)
    except OSError:
        return secrets.randbits(62) | 1
    return stable_hash((socket.gethostname(), found.st_dev, found.st_ino)) | 1


def _ready(path: str, rank: int) -> None:
    """The directory made, and shown to take a file, on a writing rank (OSError otherwise)."""
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".collgrad-probe-{rank}")
    with open(probe, "wb") as f:
        f.write(b"0")
    os.remove(probe)


@dataclass(frozen=True)
class _Plan:
    """What a save writes, decided before any data moves: per kind of state, the parameters it brings
    whole, their source, and whether every rank holds them whole already (then they are read as they
    are, each in its own dtype, with no stream; else a stream brings them, one bucket at a time); every
    tensor as written in layout order (the parameters, then the persistent buffers); and the buffers."""

    parts: tuple[tuple[StateKind, list[str], Source, bool], ...]
    entries: list[Entry]
    buffers: tuple[tuple[str, torch.Tensor], ...]


def _plan(model: adapters.Model, dtype: torch.dtype | None, names: list[str] | None, dispatcher: Dispatcher) -> _Plan:
    """The save's plan: the module's weights, or with ``dtype`` the fp32 master weights of the trainable
    parameters and the module's weights of the frozen ones. Local: the streams are opened later, on
    every rank together (``_stream``)."""
    module = model.module
    named = select(module, names, trainable=False)
    buffers = tuple(persistent_buffers(module)) if names is None else ()
    wanted: list[tuple[StateKind, list[str]]]
    if dtype is None:
        wanted = [(WEIGHTS, [n for n, _ in named])]
    else:
        trainable = [n for n, p in named if p.requires_grad]
        wanted = [(FP32, trainable), (WEIGHTS, [n for n, p in named if not p.requires_grad])]
    parts: list[tuple[StateKind, list[str], Source, bool]] = []
    entries: list[Entry] = []
    for state, chosen in wanted:
        if not chosen:
            continue
        source, _ = MODELS.source(dispatcher, model, chosen, state, None)
        # ZeRO-1/2, stage 0, a plain module: every rank holds these weights whole
        whole = source.accessor is None and all(g.kind is Partitioning.REPLICATED for g in source.layout.groups)
        parts.append((state, chosen, source, whole))
        for group in source.layout.groups:
            for slot in group.params:
                kept = source.params[slot.name].dtype if state == WEIGHTS and whole else group.out_dtype
                entries.append(Entry(slot.name, slot.shape, dtype or kept))
    for name, buffer in buffers:
        written = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
        entries.append(Entry(name, tuple(buffer.shape), written))
    return _Plan(tuple(parts), entries, buffers)


def _stream(
    entrance: adapters.Entrance,
    state: StateKind,
    chosen: list[str],
    bucket_bytes: int | None,
    dispatcher: Dispatcher,
) -> FullStateStream:
    """The whole tensors of ``state`` of the parameters ``chosen``, one bucket at a time: the call opened
    on every rank together (one small all-gather), then one collective per bucket."""
    call = OpenCall(
        entrance,
        name=f"save_full_model:{state.label}",
        streaming=True,
        kind=state,
        params=chosen,
        bucket_bytes=bucket_bytes,
        dispatcher=dispatcher,
    )
    return FullStateStream(call, copy=False)


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds (persistent ones), each once, in module order."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{prefix}.{name}" if prefix else name), buffer.detach()


def _agree(
    group: ProcessGroup | None,
    me: int,
    error: BaseException | None,
    what: str,
    timeout_s: float,
    arguments: int = 0,
    seen: int = 0,
) -> list[list[int]]:
    """Every rank learns whether any rank failed to ``what`` (and, with ``arguments``, whether every rank
    passed the same): this rank raises its own failure, the others RankFailedError naming it. ``seen``:
    told to the others (the directory this rank sees); returns every rank's row."""
    compared = "arguments (directory, dtype, max_shard_bytes, ranks or params)"
    return agree_outcome(
        group,
        me,
        error,
        call="save_full_model",
        what=what,
        timeout_s=timeout_s,
        arguments=arguments,
        compared=compared,
        extra=(seen,),
    )
