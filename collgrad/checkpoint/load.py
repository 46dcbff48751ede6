"""``load_full_model``: a checkpoint's tensors put back where the model keeps them, each rank reading the
bytes it holds, or its turn of what the ranks hold alike or of small slices, the rest brought by the
group's ranks.

    check    every rank: the model resolved, the sources of what a load writes opened (the module's
             weights; the fp32 masters where an optimizer keeps its own), every header and the index
             checked (safetensors.py), names and shapes matched with the model's state_dict (match.py)
             -> one agreement: a refusal on any rank raises on every rank, before any value changes
    plan     this rank's holdings of each source (its fragments of each partitioned tensor; what it
             holds whole: replicated weights, ZeRO-3's persistent parameters, buffers) -> read items,
             each a range of one file (plan.py, pure)
    execute  the items resolved against this rank's memory and read, each range once, straight into
             place where it can be, else into a buffer of its own and copied (storage.py); tensors
             whose slices are small read by one rank each and their slices exchanged (one all-to-all
             a window); what every rank holds alike (ZeRO-1/2's weights) read once between the ranks,
             each its turn, and gathered (one all-gather a window) (agree.read_together)
             -> one more agreement: an I/O error on any rank raises on every rank

dtypes: a 16-bit file into fp32 masters is an exact upcast; the module's weights get the file's values
in their own dtype, as the step's cast of the masters would give them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.checkpoint import storage
from collgrad.checkpoint.agree import Once, Phases, Tally, deferred, metadata_once, position, read_together
from collgrad.checkpoint.hashes import Piece
from collgrad.checkpoint.match import (
    Matched,
    Opened,
    Reads,
    io_costs,
    match,
    opened,
    others,
    persistent_buffers,
    planned_reads,
    reads,
    refuse_layout,
    refuse_unmatched,
    shapes,
)
from collgrad.checkpoint.plan import turn_runs
from collgrad.checkpoint.safetensors import Checkpoint, Stored, open_checkpoint
from collgrad.checkpoint.verify import differing, differs, record_pieces
from collgrad.core.dispatch import Dispatcher
from collgrad.errors import CollgradError
from collgrad.state import adapters
from collgrad.state.adapters.base import select
from collgrad.state.kinds import FP32
from collgrad.state.model_cache import Context

__all__ = ["load_full_model", "LoadedModel", "Checked", "check", "plan"]


@dataclass(frozen=True)
class LoadedModel:
    """What ``load_full_model`` did on this rank: the checkpoint's path and the files it read, how many of
    its tensors it loaded (a tied weight once), the bytes of tensor data this rank read and of its
    metadata (headers, index, the hash files a verified load checks against; none where another rank
    read them for the group), the seconds it took; with ``strict=False`` the model's keys the checkpoint lacks and the
    checkpoint's keys the model lacks; the collectives that moved checkpoint bytes and this rank's bytes
    into them."""

    path: str
    files: tuple[str, ...]
    tensors: int
    bytes_read: int
    header_bytes: int
    seconds: float
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    #: the collectives that brought this rank bytes others read (small slices exchanged, what the ranks
    #: hold alike gathered), and its bytes into them (the two agreements are not counted)
    collectives: int = 0
    bytes_sent: int = 0


@_compat.uncollected  # the whole job: its allocations set off full collections of the heap
def load_full_model(
    model: object,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    params: Iterable[str | torch.Tensor] | None = None,
    verify: bool = True,
    dispatcher: Dispatcher | None = None,
) -> LoadedModel:
    """Load the safetensors checkpoint at ``path`` (a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards, as ``save_pretrained`` and ``save_full_model``
    write them, or one ``.safetensors`` file) into ``model``: its module's weights (the replicated copy
    under ZeRO-0/1/2, each rank's partitions under ZeRO-3, FSDP2's local shards; frozen parameters and
    persistent buffers too) and the fp32 master weights, so that the next forward and the next step
    both start from the file. Optimizer states are left as they are. Names are the module's
    ``state_dict()`` names; a tied weight is found under any of its names.

    Each rank reads the bytes of the parts it holds (ZeRO-3 partitions, FSDP2 shards, ZeRO-1/2 master
    partitions) straight from the files, two small agreements around it; where those parts are small
    (a slice under ``IoCosts.small_below`` bytes: many ranks, or small tensors) each tensor is read whole
    by one rank and its slices sent to their holders over one all-to-all a window. What every rank holds
    whole (ZeRO-0/1/2's replicated weights, ZeRO-3's persistent parameters, buffers) each rank reads in
    its 1/world turn, gathered over one all-gather a window, from 1 MiB in all
    (``COLLGRAD_SHARED_READ_BYTES``); less, every rank reads whole.

    ``strict=True``: a key the model has and the checkpoint lacks, or the other way round, raises
    CheckpointError naming them; ``strict=False`` loads what matches and returns ``missing_keys`` and
    ``unexpected_keys``. A shape that differs raises either way. ``params``: only these parameters
    (names or tensors), and then no buffers. The index and the headers are read by the group's first
    rank (with the hash files a verified load checks against) and broadcast where that pays
    (``IoCosts.shares``: from 12 ranks). Files are untrusted: every
    rank checks every header against its file and the index before anything is read; any refusal
    raises on every rank and leaves the model exactly as it was. An I/O error while reading raises on
    every rank too. ``verify``: where the
    directory records content hashes (``save_full_model`` writes them; ``save_pretrained`` does not),
    the bytes this rank reads are checked against them first, a file that differs refused on every
    rank, naming it.

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``forward()``/``step()``. Returns a ``LoadedModel``.
    """
    start = time.perf_counter()
    ctx = Context.of(dispatcher)
    entrance = adapters.enter(model)
    resolved, error, group, me = entrance
    checked: Checked | None = None
    planned: Reads | None = None
    names: list[str] | None = None
    differ = 0  # where this rank's reads differ from the save's hashes (verify.differing)
    everywhere = entrance.model_group
    index, world = position(everywhere, me)
    # the index and every header read by the group's first rank, sent to the others: each checks them
    moved = Tally()  # the collectives that move checkpoint bytes between the ranks
    metadata = metadata_once(everywhere, me, ctx.dispatcher.timeout, lambda: _metadata(path, verify), moved)
    try:
        if resolved is not None:
            names = None if params is None else [n for n, _ in select(resolved.module, params, trainable=False)]
            checked = check(ctx, resolved, path, names, strict, lambda: metadata.get()[0])
            planned = planned_reads(
                checked.sources,
                checked.buffers,
                _stored(checked),
                index,
                world,
                costs=io_costs(checked.checkpoint.directory),
            )
            if verify:
                differ = _differing(checked, planned, metadata.get()[1].get())
    except (CollgradError, OSError, ValueError, TypeError, KeyError) as caught:
        error = caught
    # what every rank must share: its arguments, and the checkpoint as it sees it (every tensor's name, file,
    # dtype, shape and place, all of them: an expert-parallel rank loads its own experts only)
    seen = None if checked is None else checked.checkpoint.digest
    compared = (
        "arguments or checkpoints (path, strict, params; or the files: their names and headers; or the costs of "
        "its I/O: the file system it lies on, COLLGRAD_IO_CALL_SECONDS, COLLGRAD_NETWORK_BYTES_PER_SECOND, "
        "COLLGRAD_SHARED_READ_BYTES)"
    )
    phases = Phases(everywhere, me, "load_full_model", compared, ctx.dispatcher.timeout)
    arguments = stable_hash((os.fspath(path), strict, names, seen, None if planned is None else planned.fingerprint()))
    rows = phases.agree(error, "check the checkpoint against the model", arguments=arguments, extra=(differ,))
    assert checked is not None and planned is not None  # else the agreement raised
    if any(row[2] for row in rows):  # a file some rank reads differs: every rank names the same one
        raise differs(checked.checkpoint.directory, _relative(checked.checkpoint), [row[2] for row in rows if row[2]])
    bytes_read, error = read_together(checked.sources, checked.buffers, planned, ctx.dispatcher, everywhere, moved)
    phases.agree(error, "read its part of the checkpoint")
    matched = checked.matched
    files = tuple(sorted({s.file for s in matched.stored.values()}))
    return LoadedModel(
        os.fspath(path),
        files,
        len(matched.stored),
        bytes_read,
        metadata.bytes_read,
        time.perf_counter() - start,
        matched.missing,
        matched.unexpected,
        moved.collectives,
        moved.bytes,
    )


@dataclass(frozen=True)
class Checked:
    """A checkpoint checked against the model on this rank: the sources a load writes (the module's
    weights first, then the fp32 masters where an optimizer keeps its own), the checkpoint, its match
    with the model and the persistent buffers it holds."""

    sources: list[Opened]
    checkpoint: Checkpoint
    matched: Matched
    buffers: list[tuple[str, torch.Tensor]]


def check(
    ctx: Context,
    model: adapters.Model,
    path: str | os.PathLike[str],
    names: list[str] | None,
    strict: bool,
    opened_checkpoint: Callable[[], Checkpoint] | None = None,
) -> Checked:
    """The load's check on this rank: its sources opened, the checkpoint's headers and index checked
    (``opened_checkpoint``: from the group's one read of them), its names and shapes matched
    with the model's ``state_dict`` (``names``: those parameters only, and no buffers); CheckpointError
    (this rank) for what is refused. Local."""
    refuse_layout(model)
    sources: list[Opened] = []
    for kind in model.load_kinds():  # the module's weights (every parameter), then the masters
        chosen = names
        if kind == FP32:  # of the trainable parameters only (the weights' source has them all)
            chosen = [n for n, p in sources[0].source.params.items() if p.requires_grad]
            if not chosen:
                continue
        sources.append(opened(ctx, model, kind.label, kind, None, chosen, loading=True))
    checkpoint = open_checkpoint(path) if opened_checkpoint is None else opened_checkpoint()
    buffers = list(persistent_buffers(model.module)) if names is None else []  # as save_full_model writes them
    matched = _matched(model.module, sources[0], buffers, checkpoint, names is not None, strict)
    return Checked(sources, checkpoint, matched, [(n, b) for n, b in buffers if n in matched.stored])


def _relative(checkpoint: Checkpoint) -> list[str]:
    """The checkpoint's files by their names in its directory, sorted (the same on every rank)."""
    return sorted(os.path.relpath(f, checkpoint.directory) for f in checkpoint.files)


@_compat.uncollected
def _metadata(path: str | os.PathLike[str], verify: bool) -> tuple[Checkpoint, Once[list[Piece] | None]]:
    """The checkpoint opened (its index and headers checked) and, for a verified load, the hashes its
    directory records (``verify.record_pieces``; None where it records none): what the group reads once
    (``metadata_once``). Local."""
    checkpoint = open_checkpoint(path)
    directory = checkpoint.directory
    return checkpoint, deferred(lambda: record_pieces(directory) if verify and os.path.isdir(directory) else None)


def _differing(checked: Checked, planned: Reads, pieces: list[Piece] | None) -> int:
    """The bytes this rank reads from the files (``planned.here()``) against ``pieces``, the hashes its
    directory records (none: 0); verify.differing. Local."""
    if pieces is None:
        return 0
    return differing(checked.checkpoint.directory, pieces, _relative(checked.checkpoint), planned.here())


def plan(checked: Checked, index: int = 0, world: int = 1) -> tuple[storage.Run, ...]:
    """The runs of byte ranges this rank's load reads from the files, without reading them, as rank
    ``index`` of a data-parallel group of ``world``: its own (adjacent ones joined, as the load joins
    them), then its turn of the small slices it reads for their holders and of what the ranks hold
    alike (bytes, no place). Local."""
    costs = io_costs(checked.checkpoint.directory)
    planned = planned_reads(checked.sources, checked.buffers, _stored(checked), index, world, costs=costs)
    sliced = (storage.Run(f, at, n, torch.uint8, None, ()) for w in planned.exchanged for f, at, n in w.runs)
    turns = (
        storage.Run(f, at, n, torch.uint8, None, ()) for w in planned.shared for f, at, _, n in turn_runs(w, index)
    )
    return (*reads(checked.sources, checked.buffers, planned).runs, *sliced, *turns)


def _stored(checked: Checked) -> dict[tuple[str, str], Stored]:
    """The stored tensor each source's holdings are read from, by (stem, name)."""
    return {(one.stem, n): s for one in checked.sources for n, s in checked.matched.stored.items()}


def _matched(
    module: torch.nn.Module,
    weights: Opened,
    buffers: list[tuple[str, torch.Tensor]],
    checkpoint: Checkpoint,
    selected: bool,
    strict: bool,
) -> Matched:
    """The checkpoint's tensor of every parameter the module's weights' source holds and of every
    persistent buffer, a tied weight found under any of its names; CheckpointError (this rank) for a
    shape that differs, or with ``strict`` for keys on one side only (none unexpected with ``params``)."""
    aliases: dict[str, list[str]] = {}
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical.setdefault(id(p), name), []).append(name)
    shaped = shapes(weights.source)  # as the unsharded model has them
    shaped.update((name, tuple(buffer.shape)) for name, buffer in buffers)
    # other expert-parallel ranks' experts are in the checkpoint and not here: neither loaded nor unexpected
    found = match(checkpoint.directory, shaped, checkpoint.tensors, aliases, others(weights.source))
    unexpected = () if selected else found.unexpected
    refuse_unmatched(checkpoint.directory, found.missing, unexpected, strict)
    return Matched(found.stored, found.missing, unexpected)
