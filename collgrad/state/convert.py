"""``convert_deepspeed_checkpoint``: a checkpoint DeepSpeed's ``engine.save_checkpoint`` wrote (ZeRO-1/2/3,
BF16_Optimizer, any data-parallel size) turned into a training state (training.py's layout) offline,
in one process, in bounded memory, which ``load_training_state`` resumes at any world size, stage or
under FSDP2, and whose weights ``from_pretrained`` loads.

    read     every rank's files memory-mapped and checked (deepspeed_checkpoint.py): where each
             element of each tensor lies, in which rank's flat partition
    lay out  the training state's files from those tensors, as save_training_state lays them out
    write    each tensor's pieces, rank by rank, straight from the mapped files to their offsets
             (adjacent ones in one write); a piece in another dtype (ZeRO-3's weights, the masters in
             the module's dtype) cast on its own; flushed
    commit   the index, then the manifest renamed into place: never half a checkpoint

Nothing is held but one piece at a time and the page cache: the process's own memory does not grow
with the checkpoint (the bench's ``collgrad_convert`` row measures it against ``deepspeed_zero_to_fp32``).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from collgrad.errors import CheckpointError, CollgradError, InvalidArgumentError
from collgrad.state.deepspeed_checkpoint import DeepSpeedCheckpoint, Placement, read_deepspeed_checkpoint
from collgrad.state.manifest import Manifest, ParamGroup
from collgrad.state.save import DEFAULT_MAX_SHARD_BYTES
from collgrad.state.shards import Entry, RangeWriter, bytes_of
from collgrad.state.training import (
    Files,
    Placed,
    commit,
    discard,
    joined_writes,
    lay_out,
    write_headers,
    write_small,
)

__all__ = ["convert_deepspeed_checkpoint", "Converted"]


@dataclass(frozen=True)
class Converted:
    """What ``convert_deepspeed_checkpoint`` wrote: the directory, its files (the manifest last), the
    source's tag, layout and data-parallel size, the tensors and bytes of tensor data, the seconds."""

    directory: str
    files: tuple[str, ...]
    tag: str
    layout: str
    world_size: int
    tensors: int
    bytes: int
    seconds: float


def convert_deepspeed_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> Converted:
    """Convert the DeepSpeed checkpoint in ``checkpoint_dir`` (``tag``: default the one its ``latest``
    names, as DeepSpeed's loader takes it) into a training state in ``out_dir``: the module's weights
    (as ``from_pretrained`` loads them; tied ones once), the fp32 masters, every per-element optimizer
    state by its key, the optimizer's step counts and hyperparameters, the LR scheduler's state, the
    engine's steps, samples and fp16 loss scaler. ``progress(done, total)``: bytes of tensor data
    written so far, after each write.

    Every file is untrusted (only containers, tensors and four inert stand-ins for DeepSpeed's classes
    are unpickled, every field checked against the others: CheckpointError naming the file); a failure
    while writing removes what was written and leaves a checkpoint already in ``out_dir`` loadable.
    Offline: one process, no process group; DeepSpeed need not be installed."""
    start = time.perf_counter()
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidArgumentError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    source = read_deepspeed_checkpoint(checkpoint_dir, tag)
    path = os.fspath(out_dir)
    generation = secrets.token_hex(8)
    files = lay_out(path, _entries(source), generation, max_shard_bytes)
    manifest = _manifest(source, files, generation)
    manifest.to_json()  # a value JSON cannot hold refused before anything is written
    total = sum(s.data_bytes for named in files.shards.values() for _, s in named)
    writer = RangeWriter()
    temporaries: list[tuple[str, str]] = []
    try:
        os.makedirs(path, exist_ok=True)
        write_headers(files, writer)
        done = 0
        with torch.no_grad():
            for file, size, offset, data in joined_writes(_writes(source, files)):
                writer.write(file, size, offset, bytes_of(data))
                done += data.nbytes
                if writer.error is not None:
                    break
                if progress is not None:
                    progress(done, total)
        writer.finish()
        if writer.error is not None:
            raise writer.error
        temporaries = write_small(path, manifest, files, generation)
        commit(path, temporaries, set(manifest.files()))
    except OSError as error:
        discard(writer, temporaries)
        raise CollgradError(
            f"{path}: writing the converted checkpoint failed ({error.strerror or error}); what was written is "
            "removed, and a checkpoint already there is as it was"
        ) from error
    return Converted(
        path,
        manifest.files() + tuple(os.path.basename(final) for _, final in temporaries),
        source.tag,
        source.layout,
        source.world,
        len(files.placed),
        total,
        time.perf_counter() - start,
    )


def _entries(source: DeepSpeedCheckpoint) -> dict[str, list[Entry]]:
    """Each file stem's tensors: the module's (tied names once), the masters, each per-element state."""
    trainable = {p.name: p for p in source.trainable}
    frozen = {p.name: p for p in source.frozen}
    model = []
    for name, tensor in source.module.items():
        if name in source.aliases:
            continue
        placed = trainable.get(name) or frozen.get(name)
        if source.layout == "zero3" and placed is None and name not in source.buffers:
            raise CheckpointError(
                f"{source.path}: its module holds {name}, which neither its param_shapes, its frozen_param_shapes "
                "nor its buffer_names shape (an empty parameter?); nothing was written"
            )
        shape = placed.shape if placed is not None else tuple(tensor.shape)
        model.append(Entry(name, shape, tensor.dtype))
    out = {"model": model, "fp32": [Entry(p.name, p.shape, _flat(source, p, None).dtype) for p in source.trainable]}
    for k, key in enumerate(source.keys):
        out[f"optimizer-{k}"] = [Entry(p.name, p.shape, _flat(source, p, key).dtype) for p in source.trainable]
    return out


def _flat(source: DeepSpeedCheckpoint, placement: Placement, key: str | None, rank: int = 0) -> torch.Tensor:
    """The flat tensor of ``rank`` that ``placement`` lies in: its group's fp32 partition (``key`` None),
    the state ``key`` of it, or a ZeRO-3 frozen parameter's own fragment."""
    held = source.ranks[rank]
    if placement.group < 0:
        return held.frozen[placement.name]
    if key is None:
        return held.fp32[placement.group]
    found: torch.Tensor = held.states[placement.group][key]
    return found


def _pieces(
    source: DeepSpeedCheckpoint, placement: Placement, key: str | None, place: Placed
) -> Iterator[tuple[Placed, int, torch.Tensor]]:
    at = 0
    for piece in placement.pieces:
        yield place, at, _flat(source, placement, key, piece.rank)[piece.start : piece.start + piece.numel]
        at += piece.numel


def _writes(source: DeepSpeedCheckpoint, files: Files) -> Iterator[tuple[Placed, int, torch.Tensor]]:
    """Every tensor's values as (its place, first element, values), piece by piece, from the mapped files."""
    by_name = {p.name: p for p in (*source.trainable, *source.frozen)}
    for entry in (e for _, shard in files.shards.get("model", ()) for e in shard.entries):
        place = files.placed[("model", entry.name)]
        placement = by_name.get(entry.name)
        if source.layout == "zero3" and placement is not None:  # the masters (or frozen fragments), cast
            yield from _pieces(source, placement, None, place)
        else:  # whole in rank 0's file: the weights below ZeRO-3, the buffers
            yield place, 0, source.module[entry.name]
    for stem, key in (("fp32", None), *((f"optimizer-{k}", key) for k, key in enumerate(source.keys))):
        for placement in source.trainable:
            yield from _pieces(source, placement, key, files.placed[(stem, placement.name)])


def _manifest(source: DeepSpeedCheckpoint, files: Files, generation: str) -> Manifest:
    names = [[p.name for p in source.trainable if p.group == g] for g in range(len(source.group_states))]
    groups = tuple(
        ParamGroup(tuple(n for g in flat_groups for n in names[g]), hyperparameters)
        for flat_groups, hyperparameters in source.param_groups
    )
    states: dict[str, Any] = {p.name: source.group_states[p.group] for p in source.trainable}
    return Manifest(
        generation,
        {
            "framework": "deepspeed",
            "layout": f"deepspeed-checkpoint:{source.layout}",
            "world_size": source.world,
            "converted_from": source.tag,
        },
        files.mapped("model"),
        files.mapped("fp32"),
        {key: files.mapped(f"optimizer-{k}") for k, key in enumerate(source.keys)},
        groups,
        states,
        None if source.lr_scheduler is None else dict(source.lr_scheduler),
        dict(source.counters),
    )
