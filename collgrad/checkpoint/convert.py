"""``convert_deepspeed_checkpoint``: a checkpoint DeepSpeed's ``engine.save_checkpoint`` wrote (ZeRO-1/2/3,
BF16_Optimizer, any data-parallel size) turned into a training state (training.py's layout) offline,
in one process, in bounded memory, which ``load_training_state`` resumes at any world size, stage or
under FSDP2, and whose weights ``from_pretrained`` loads.

    read     every rank's files memory-mapped and checked (deepspeed_checkpoint.py): where each
             element of each tensor lies, in which rank's flat partition
    lay out  the training state's files from those tensors, as save_training_state lays them out
    write    each tensor's pieces (plan.py's write items: one process holding every rank's pieces),
             rank by rank, straight from the mapped files to their offsets
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
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator

import torch

from collgrad.checkpoint import commit, hashes, storage
from collgrad.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint, Placement, read_deepspeed_checkpoint
from collgrad.checkpoint.manifest import MANIFEST_NAME, STATE_DIR, Manifest, ParamGroup, manifest_path
from collgrad.checkpoint.match import io_costs
from collgrad.checkpoint.plan import WHOLE, Files, Held, Holding, Ranges, WriteItem, in_whole, lay_out, write_items
from collgrad.checkpoint.safetensors import INDEX_NAME, Entry
from collgrad.checkpoint.save import DEFAULT_MAX_SHARD_BYTES, checked_shard_bytes
from collgrad.checkpoint.training import file_names, put_in_place, weights_index
from collgrad.errors import CheckpointError, CollgradError

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
    checked_shard_bytes(max_shard_bytes)
    source = read_deepspeed_checkpoint(checkpoint_dir, tag)
    path = os.fspath(out_dir)
    generation = secrets.token_hex(8)
    entries = _entries(source)
    files = lay_out(entries, max_shard_bytes, file_names(generation, entries))
    manifest = _manifest(source, files, generation)
    manifest.to_json()  # a value JSON cannot hold refused before anything is written
    holdings, memory = _held(source, files)
    total, done = files.data_bytes(), 0

    def written(item: WriteItem) -> None:
        nonlocal done
        done += item.nbytes
        if progress is not None and item.held is not None:
            progress(done, total)

    hasher = hashes.Hasher({commit.temporary(os.path.join(path, f)): f for f in files.names()})
    writer = storage.Writer(hasher, io_costs(path).joined_below)
    renames: list[tuple[str, str]] = []
    try:
        os.makedirs(os.path.join(path, STATE_DIR), exist_ok=True)
        items = write_items(files, holdings, 0, 1)

        def temporary(file: str) -> str:
            return commit.temporary(os.path.join(path, file))

        storage.write(writer, items, storage.in_memory(memory), files.headers(), temporary, written)
        writer.finish()
        if writer.error is not None:
            raise writer.error
        renames = [(commit.temporary(os.path.join(path, f)), os.path.join(path, f)) for f in files.names()]
        renames.append(weights_index(path, files))
        name = hashes.hash_file_name(generation, 0)
        hashed = commit.hash_file(writer, path, name)  # what was written, hashed as it went out
        if hashed is None:  # its write failed (kept in writer.error): the headers were written, so hashed
            assert isinstance(writer.error, OSError)
            raise writer.error
        renames.append(hashed[0])
        manifest = replace(manifest, hashes={name: hashed[1]})
        renames.append(commit.write_small(manifest_path(path), manifest.to_json()))
        put_in_place(path, renames)
    except OSError as error:
        commit.discard(writer, renames)
        raise CollgradError(
            f"{path}: writing the converted checkpoint failed ({error.strerror or error}); what was written is "
            "removed, and a checkpoint already there is as it was"
        ) from error
    return Converted(
        path,
        (*files.names(), INDEX_NAME, MANIFEST_NAME),
        source.tag,
        source.layout,
        source.world,
        len(files.placed),
        total,
        time.perf_counter() - start,
    )


def _entries(source: DeepSpeedCheckpoint) -> dict[str, list[Entry]]:
    """Each file stem's tensors: the module's (tied names once), the masters, each per-element state;
    a tensor-parallel shard as its whole tensor."""
    trainable = {p.name: p for p in source.trainable}
    frozen = {p.name: p for p in source.frozen}
    whole = {name: split.whole for name, split in source.splits.items()}
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
        model.append(Entry(name, whole.get(name, shape), tensor.dtype))
    out = {"model": model}
    for stem, key in (("fp32", None), *((f"optimizer-{k}", key) for k, key in enumerate(source.keys))):
        out[stem] = [Entry(p.name, whole.get(p.name, p.shape), _flat(source, p, key).dtype) for p in source.trainable]
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


def _held(source: DeepSpeedCheckpoint, files: Files) -> tuple[list[Holding], list[storage.Memory]]:
    """Every tensor's values as this one process holds them: per tensor, its pieces in the ranks' mapped
    flat tensors (each a ``Memory`` of one tensor), or the whole tensor in rank 0's file (the weights
    below ZeRO-3, the buffers); under tensor parallelism every part's, each shard's elements placed in
    its whole tensor (``plan.in_whole``), what no part splits from the first. The holdings in the
    files' order; none a replica (one process)."""
    memory: list[storage.Memory] = []
    at: dict[int, int] = {}  # a flat tensor's index in ``memory``, by identity

    def of(tensor: torch.Tensor) -> int:
        found = at.get(id(tensor))
        if found is None:
            found = at[id(tensor)] = len(memory)
            memory.append(storage.Memory(whole=[tensor]))
        return found

    def pieces(part: DeepSpeedCheckpoint, stem: str, placement: Placement, key: str | None) -> Iterator[Holding]:
        done = 0
        for piece in placement.pieces:
            flat = _flat(part, placement, key, piece.rank)
            held = Held(of(flat), WHOLE, 0, piece.start)
            yield Holding(stem, placement.name, Ranges(done, piece.numel), held)
            done += piece.numel

    def placed(part: DeepSpeedCheckpoint, holdings: Iterable[Holding]) -> Iterator[Holding]:
        """A part's holdings in their whole tensors; of a tensor no part splits, the first part's only."""
        for holding in holdings:
            split = part.splits.get(holding.tensor)
            if split is not None:
                yield from in_whole(holding, split)
            elif part is parts[0]:
                yield holding

    parts = source.parts or (source,)
    out: list[Holding] = []
    for part in parts:
        by_name = {p.name: p for p in (*part.trainable, *part.frozen)}
        for entry in (e for _, shard in files.shards.get("model", ()) for e in shard.entries):
            placement = by_name.get(entry.name)
            if part.layout == "zero3" and placement is not None:  # the masters (or frozen fragments), cast
                out.extend(placed(part, pieces(part, "model", placement, None)))
            else:  # whole in the part's file: the weights below ZeRO-3, the buffers
                whole = part.module[entry.name]
                held = Holding("model", entry.name, Ranges(0, whole.numel()), Held(of(whole), WHOLE, 0))
                out.extend(placed(part, [held]))
        for stem, key in (("fp32", None), *((f"optimizer-{k}", key) for k, key in enumerate(part.keys))):
            for placement in part.trainable:
                out.extend(placed(part, pieces(part, stem, placement, key)))
    return out, memory


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
            "layout": f"deepspeed-checkpoint:{source.layout}" + (f"+autotp{len(source.parts)}" if source.parts else ""),
            "world_size": source.world * max(1, len(source.parts)),
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
