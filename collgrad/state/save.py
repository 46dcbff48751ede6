"""``save_full_model``: a consolidated checkpoint in the layout Hugging Face ``from_pretrained`` loads,
streamed bucket by bucket into safetensors shards (shards.py), never the whole model in one memory.

    agree: arguments, and the directory ready on the writing ranks       (one small all-gather)
    stream the module's weights (or the fp32 master weights) one bucket at a time (one collective
      per bucket; ZeRO-1/2 and stage 0 hold them whole: none), then the persistent buffers
      each rank cuts the same shards; shard k's rank keeps its tensors and writes it under a
      temporary name as soon as it is full
    agree: every rank wrote its shards                                    (one small all-gather)
    rename the shards to their final names; the first writing rank adds the index
    agree: done everywhere                                                (one small all-gather)
"""

from __future__ import annotations

import json
import os
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
from collgrad.state.adapters.base import select
from collgrad.state.call import OpenCall
from collgrad.state.kinds import FP32, WEIGHTS, StateKind
from collgrad.state.layout import Partitioning
from collgrad.state.outcome import agree_outcome, enter
from collgrad.state.read import FullStateStream
from collgrad.state.record import StateRecord
from collgrad.state.shards import SAFE_DTYPES, Entry, Shard, ShardFiles, plan_shards, shard_name

__all__ = ["save_full_model", "SavedModel", "DEFAULT_MAX_SHARD_BYTES", "INDEX_NAME"]

#: ``save_pretrained``'s default shard size ("5GB")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class SavedModel:
    """What ``save_full_model`` wrote: every file of the checkpoint (shards in order, then the index if
    there is one), the ones this rank wrote, how many tensors and bytes of tensor data, the seconds
    the call took on this rank, and the records of the streams that gathered the tensors."""

    directory: str
    files: tuple[str, ...]
    written_here: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float
    #: what each stream of whole tensors did (collectives, bytes sent by this rank)
    records: tuple[StateRecord, ...] = ()

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
    ranks: Sequence[int] = (0,),
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
    (a shared file system when there are several). ``params``: only these parameters (names or
    parameters), and then no buffers.

    Memory: a writing rank holds at most the shard it is filling plus what the stream holds (about
    two buckets of ``bucket_bytes``), the others only the stream. No shard appears under its final name
    before every rank has written all of its own; a failure on any rank (a bad directory, a full disk)
    raises on every rank (that rank: CollgradError with the cause; the others: RankFailedError) and
    removes the temporary files.

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``step()``. Returns a ``SavedModel``.
    """
    start = time.perf_counter()
    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    path = os.fspath(directory)
    resolved, error, group, me = enter(model)
    writers: tuple[int, ...] = (0,)
    names: list[str] | None = None
    try:
        if resolved is not None:
            writers = _checked(ranks, dtype, max_shard_bytes)
            names = None if params is None else [n for n, _ in select(resolved.module, params, trainable=False)]
            if me in writers:
                _ready(path, me)
    except (OSError, ValueError, TypeError, KeyError) as caught:
        error, writers, names = caught, (0,), None
    arguments = stable_hash((path, str(dtype), max_shard_bytes, writers, names))
    _agree(group, me, error, "check the arguments and make the directory", dispatcher.timeout, arguments)
    assert resolved is not None  # else _agree raised
    module = resolved.module
    calls = _open_calls(resolved, dtype, names, bucket_bytes, dispatcher)
    plan = plan_shards(_entries(calls, module, dtype, names), max_shard_bytes, {"format": "pt"})
    shards = ShardFiles(plan, path, writers, me)
    if me in writers:
        shards.create()
    streams: list[FullStateStream] = []
    try:
        for name, tensor in _tensors(calls, module, names, streams):
            shards.put(name, tensor)
        shards.finish()
        _agree(group, me, shards.error, "write its shards", dispatcher.timeout)
    except BaseException:
        shards.discard()
        raise
    files, here = _final_names(path, plan, shards, writers, me)
    _agree(group, me, shards.error, "give its shards their final names", dispatcher.timeout)
    seconds = time.perf_counter() - start
    records = tuple(stream.record() for stream in streams)
    tensors = sum(len(shard.entries) for shard in plan)
    return SavedModel(path, files, tuple(here), tensors, sum(s.data_bytes for s in plan), seconds, records)


def _checked(ranks: Sequence[int], dtype: torch.dtype | None, max_shard_bytes: int) -> tuple[int, ...]:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    writers = tuple(ranks) if not isinstance(ranks, int) else (ranks,)
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


def _ready(path: str, rank: int) -> None:
    """The directory made, and shown to take a file, on a writing rank (OSError otherwise)."""
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".collgrad-probe-{rank}")
    with open(probe, "wb") as f:
        f.write(b"0")
    os.remove(probe)


#: An opened stream's call, and its state.
Opened = tuple[OpenCall, StateKind]


def _open_calls(
    model: adapters.Model,
    dtype: torch.dtype | None,
    names: list[str] | None,
    bucket_bytes: int | None,
    dispatcher: Dispatcher,
) -> list[Opened]:
    """The calls whose streams bring the parameters whole (each opened on every rank together): the
    module's weights, or with ``dtype`` the fp32 master weights of the trainable ones and the module's
    weights of the frozen ones."""
    named = select(model.module, names, trainable=False)
    wanted: list[tuple[StateKind, list[str]]]
    if dtype is None:
        wanted = [(WEIGHTS, [n for n, _ in named])]
    else:
        trainable = [n for n, p in named if p.requires_grad]
        wanted = [(FP32, trainable), (WEIGHTS, [n for n, p in named if not p.requires_grad])]
    opened: list[Opened] = []
    for state, chosen in wanted:
        if chosen:
            name = f"save_full_model:{state.label}"
            call = OpenCall(
                model,
                name=name,
                streaming=True,
                kind=state,
                params=chosen,
                bucket_bytes=bucket_bytes,
                dispatcher=dispatcher,
            )
            opened.append((call, state))
    return opened


def _whole_here(call: OpenCall) -> bool:
    """Every rank holds these weights whole (ZeRO-1/2, stage 0, a plain module): read them as they are,
    each in its own dtype, with no stream."""
    return all(g.kind is Partitioning.REPLICATED for g in call.source.layout.groups) and call.source.accessor is None


def _entries(calls: list[Opened], module: nn.Module, dtype: torch.dtype | None, names: list[str] | None) -> list[Entry]:
    """Every tensor to write, as written, in layout order: the parameters, then the persistent buffers."""
    out = []
    for call, state in calls:
        params = call.source.params
        for group in call.source.layout.groups:
            for slot in group.params:
                kept = params[slot.name].dtype if state == WEIGHTS and _whole_here(call) else group.out_dtype
                out.append(Entry(slot.name, slot.shape, dtype or kept))
    if names is None:
        for name, buffer in persistent_buffers(module):
            written = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
            out.append(Entry(name, tuple(buffer.shape), written))
    return out


def _tensors(
    calls: list[Opened], module: nn.Module, names: list[str] | None, streams: list[FullStateStream]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor to save, whole, one bucket at a time (each stream opened is added to ``streams``),
    then (without ``params=``) the persistent buffers. As held: ShardFiles converts each as planned."""
    for call, _ in calls:
        if _whole_here(call):
            yield from ((name, p.detach()) for name, p in call.source.params.items())
            continue
        streams.append(FullStateStream(call, copy=False))
        yield from streams[-1]
    if names is None:
        yield from persistent_buffers(module)


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds (persistent ones), each once, in module order."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{prefix}.{name}" if prefix else name), buffer.detach()


def _final_names(
    path: str, plan: tuple[Shard, ...], shards: ShardFiles, writers: tuple[int, ...], me: int
) -> tuple[tuple[str, ...], list[str]]:
    """This rank's shards renamed to their final names, and by the first writing rank the index added and
    an earlier save's weights files removed: every file of the checkpoint, and those this rank wrote. A
    failure is kept in ``shards.error`` (the temporaries not renamed yet removed) for the agreement."""
    count = len(plan)
    files = tuple(shard_name(k, count) for k in range(count)) + ((INDEX_NAME,) if count > 1 else ())
    here: list[str] = []
    try:
        for k, temporary in shards.written:
            os.replace(temporary, os.path.join(path, files[k]))
            here.append(files[k])
        if me == writers[0]:
            if count > 1:
                _write_index(path, plan)
                here.append(INDEX_NAME)
            _remove_stale(path, files)
    except OSError as caught:
        shards.error = caught
        shards.discard()
    return files, here


def _remove_stale(path: str, files: tuple[str, ...]) -> None:
    """Weights files an earlier save left in ``path`` that are not part of this one (``from_pretrained``
    would load ``model.safetensors`` before an index), as ``save_pretrained`` removes them."""
    for name in os.listdir(path):
        stale = name == "model.safetensors" or name == INDEX_NAME or (name.startswith("model-") and "-of-" in name)
        if stale and name.endswith((".safetensors", ".json")) and name not in files:
            os.remove(os.path.join(path, name))


def _write_index(path: str, plan: tuple[Shard, ...]) -> None:
    count = len(plan)
    index = {
        "metadata": {"total_size": sum(s.data_bytes for s in plan)},
        "weight_map": {e.name: shard_name(k, count) for k, shard in enumerate(plan) for e in shard.entries},
    }
    temporary = os.path.join(path, f".{INDEX_NAME}.tmp")
    with open(temporary, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(temporary, os.path.join(path, INDEX_NAME))


def _agree(
    group: ProcessGroup | None, me: int, error: BaseException | None, what: str, timeout_s: float, arguments: int = 0
) -> None:
    """Every rank learns whether any rank failed to ``what`` (and, with ``arguments``, whether every rank
    passed the same): this rank raises its own failure, the others RankFailedError naming it."""
    compared = "arguments (directory, dtype, max_shard_bytes, ranks or params)"
    agree_outcome(
        group, me, error, call="save_full_model", what=what, timeout_s=timeout_s, arguments=arguments, compared=compared
    )
