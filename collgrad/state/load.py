"""``load_full_model``: a checkpoint's tensors put back where the model keeps them, each rank reading only
the bytes it holds, with no collective carrying a weight.

    check    every rank: the model resolved, the sources of what a load writes opened (the module's
             weights; the fp32 masters where an optimizer keeps its own), every header and the index
             checked (files.py), names and shapes matched with the model's state_dict
             -> one agreement: a refusal on any rank raises on every rank, before any value changes
    plan     per source, this rank's fragments of each tensor (the layout's owned_fragments), each a
             range of one file; what a rank holds whole (replicated weights, ZeRO-3's persistent
             parameters, buffers) one range of the whole tensor
    execute  each range read from its file straight into a buffer of its own size and copied into
             place (converted to the target's dtype): one read buffer at a time
    agree    one more agreement: an I/O error on any rank raises on every rank

dtypes: a 16-bit file into fp32 masters is an exact upcast; the module's weights get the file's values
in their own dtype, as the step's cast of the masters would give them.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from collgrad import _compat
from collgrad.backends.agreement import stable_hash
from collgrad.core.buffers import Pieces, adjacent_view
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.errors import CheckpointError, CollgradError, LayoutChangedError
from collgrad.state import adapters
from collgrad.state.adapters.base import LocalGrads, Problem, Source, rank_in, select
from collgrad.state.call import source_of
from collgrad.state.files import Checkpoint, RangeReader, Stored, open_checkpoint
from collgrad.state.kinds import FP32
from collgrad.state.layout import Partitioning, owned_fragments
from collgrad.state.outcome import agree_outcome
from collgrad.state.save import persistent_buffers
from collgrad.state.shards import bytes_of

__all__ = [
    "load_full_model",
    "LoadedModel",
    "LoadPlan",
    "Run",
    "Copy",
    "Target",
    "read_plan",
    "reads",
    "joined_runs",
    "with_moves",
]


@dataclass(frozen=True)
class LoadedModel:
    """What ``load_full_model`` did, on this rank."""

    path: str
    files: tuple[str, ...]
    #: tensors of the checkpoint loaded (a tied weight once)
    tensors: int
    #: data bytes this rank read (headers apart)
    bytes_read: int
    #: header and index bytes this rank read
    header_bytes: int
    seconds: float
    #: ``strict=False``: the model's keys the checkpoint lacks, and the checkpoint's the model lacks
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Into:
    """One source a load writes, this rank's view of its local tensors, and the stored tensor each of
    its names takes (a load of the training state reads the weights and the masters of one parameter
    from different files)."""

    source: Source
    local: LocalGrads
    stored: Mapping[str, Stored]


@dataclass(frozen=True)
class _Matched:
    """The checkpoint's tensor for each name the model keeps (by the model's name), and what did not match."""

    stored: Mapping[str, Stored]
    buffers: Mapping[str, torch.Tensor]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def load_full_model(
    model: object,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    params: Iterable[str | torch.Tensor] | None = None,
    dispatcher: Dispatcher | None = None,
) -> LoadedModel:
    """Load the safetensors checkpoint at ``path`` (a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards, as ``save_pretrained`` and ``save_full_model``
    write them, or one ``.safetensors`` file) into ``model``: its module's weights (the replicated copy
    under ZeRO-0/1/2, each rank's partitions under ZeRO-3, FSDP2's local shards; frozen parameters and
    persistent buffers too) and the fp32 master weights, so that the next forward and the next step
    both start from the file. Optimizer states are left as they are. Names are the module's
    ``state_dict()`` names; a tied weight is found under any of its names.

    Each rank reads only the bytes of the parts it holds (ZeRO-3 partitions, FSDP2 shards, ZeRO-1/2
    master partitions), straight from the files; what it holds whole (ZeRO-0/1/2's replicated weights,
    ZeRO-3's persistent parameters, buffers) it reads whole. No collective carries a weight, only two
    small agreements.

    ``strict=True``: a key the model has and the checkpoint lacks, or the other way round, raises
    CheckpointError naming them; ``strict=False`` loads what matches and returns ``missing_keys`` and
    ``unexpected_keys``. A shape that differs raises either way. ``params``: only these parameters
    (names or tensors), and then no buffers. Files are untrusted: every header is checked against its
    file and the index before anything is read; any refusal raises on every rank and leaves the model
    exactly as it was. An I/O error while reading raises on every rank too.

    When and where: on every rank of the model's data-parallel group, with the same arguments, outside
    ``forward()``/``step()``. Returns a ``LoadedModel``.
    """
    start = time.perf_counter()
    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    resolved, error, group, me = adapters.enter(model)
    opened: list[tuple[Source, LocalGrads]] = []
    checkpoint: Checkpoint | None = None
    matched: _Matched | None = None
    names: list[str] | None = None
    try:
        if resolved is not None:
            names = None if params is None else [n for n, _ in select(resolved.module, params, trainable=False)]
            opened = _sources(resolved, names)
            checkpoint = open_checkpoint(path)
            matched = _match(resolved.module, opened[0][0], checkpoint, names, strict)
    except (CollgradError, OSError, ValueError, TypeError, KeyError) as caught:
        error = caught
    # what every rank must share: its arguments, and the checkpoint as it sees it (names, dtypes, shapes)
    seen = None if matched is None else sorted((n, str(s.dtype), s.shape) for n, s in matched.stored.items())
    agree_outcome(
        group,
        me,
        error,
        call="load_full_model",
        what="check the checkpoint against the model",
        timeout_s=dispatcher.timeout,
        arguments=stable_hash((os.fspath(path), strict, names, seen)),
        compared="arguments or checkpoints (path, strict, params; or the files' names, dtypes and shapes)",
    )
    assert checkpoint is not None and matched is not None  # else an agreement raised
    plan = _plan(
        [Into(source, local, matched.stored) for source, local in opened],
        [(b, matched.stored[n]) for n, b in matched.buffers.items()],
    )
    bytes_read, error = execute(plan)
    what = "read its part of the checkpoint"
    agree_outcome(group, me, error, call="load_full_model", what=what, timeout_s=dispatcher.timeout)
    files = tuple(sorted({s.file for s in matched.stored.values()}))
    return LoadedModel(
        os.fspath(path),
        files,
        len(matched.stored),
        bytes_read,
        checkpoint.header_bytes,
        time.perf_counter() - start,
        matched.missing,
        matched.unexpected,
    )


def execute(plan: LoadPlan) -> tuple[int, BaseException | None]:
    """``plan``'s reads and copies done on this rank: the bytes read, and the error that stopped them (an
    I/O error, a setter's), for the caller to agree on. Local."""
    reader = RangeReader()
    error: BaseException | None = None
    try:
        with torch.no_grad():
            for run in plan.runs:
                if run.into is not None:  # straight into place
                    reader.read_at(run.file, run.offset, run.into)
                    continue
                buffer = torch.empty(run.numel, dtype=run.dtype)
                reader.read_at(run.file, run.offset, buffer)
                for copy in run.copies:
                    copy.target.write(buffer[copy.at : copy.at + copy.target.numel])
                del buffer  # one read buffer at a time
            plan.move()
    except (OSError, CollgradError) as caught:
        error = caught
    finally:
        reader.close()
    return reader.bytes_read, error


def _sources(model: adapters.Model, names: list[str] | None) -> list[tuple[Source, LocalGrads]]:
    """The sources a load writes, each with this rank's view of its local tensors, module weights first
    (every parameter), then the fp32 masters of the trainable ones where the optimizer keeps its own."""
    out: list[tuple[Source, LocalGrads]] = []
    for kind in model.load_kinds():
        selected = names
        if kind == FP32:  # the masters of the trainable parameters only (the weights' source has them all)
            selected = [n for n, p in out[0][0].params.items() if p.requires_grad]
            if not selected:
                continue
        source = source_of(model, kind, params=selected)[0]
        local = source.read()
        if local.problem is not Problem.OK:
            raise LayoutChangedError(
                f"rank {_compat.rank()}: the {kind.describe()} cannot be written here ({local.problem.describe()}"
                f"{'; ' + local.detail if local.detail else ''}); nothing was loaded"
            )
        out.append((source, local))
    return out


def _match(
    module: nn.Module, weights: Source, checkpoint: Checkpoint, names: list[str] | None, strict: bool
) -> _Matched:
    """The checkpoint's tensor of every parameter ``weights`` (the module's weights' source) holds and
    of every persistent buffer, a tied weight found under any of its names; CheckpointError (this rank)
    for a shape that differs, or with ``strict`` for keys on one side only."""
    aliases: dict[str, list[str]] = {}
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical.setdefault(id(p), name), []).append(name)
    buffers = dict(persistent_buffers(module)) if names is None else {}  # as save_full_model writes them
    shapes = {slot.name: slot.shape for group in weights.layout.groups for slot in group.params}
    for name, buffer in buffers.items():
        shapes[name], aliases[name] = tuple(buffer.shape), [name]
    stored, missing, wrong = {}, [], []
    for name, shape in shapes.items():
        found = next((checkpoint.tensors[a] for a in aliases.get(name, [name]) if a in checkpoint.tensors), None)
        if found is None:
            missing.append(name)
        elif found.shape != shape:
            wrong.append(f"{name}: {list(found.shape)} in the checkpoint, {list(shape)} in the model")
        else:
            stored[name] = found
    known = {a for name in shapes for a in aliases.get(name, [name])}
    unexpected = [] if names is not None else [n for n in checkpoint.tensors if n not in known]
    where = checkpoint.directory
    if wrong:
        raise CheckpointError(f"rank {_compat.rank()}: {where}: shapes differ from the model's: {_listed(wrong)}")
    if strict and (missing or unexpected):
        parts = [f"missing from the checkpoint: {_listed(missing)}"] if missing else []
        parts += [f"not in the model: {_listed(unexpected)}"] if unexpected else []
        raise CheckpointError(
            f"rank {_compat.rank()}: {where}: the checkpoint does not match the model ({'; '.join(parts)}); pass "
            "strict=False to load what matches"
        )
    return _Matched(stored, {n: b for n, b in buffers.items() if n in stored}, tuple(missing), tuple(unexpected))


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


@dataclass(frozen=True)
class Target:
    """One place a range of a tensor goes: elements ``[at, at + numel)`` of it (flat) into ``dest``, a
    view of where this rank keeps them (any shape of ``numel`` elements; converted on the copy), or,
    where no view can be had (an optimizer collgrad does not read), through ``put`` (DeepSpeed's setter)."""

    at: int
    numel: int
    dest: torch.Tensor | None = None
    put: Callable[[torch.Tensor], None] | None = None

    def write(self, values: torch.Tensor) -> None:
        """Put ``values`` (1-D, contiguous: this target's elements) in place."""
        if self.dest is not None:
            self.dest.copy_(values if self.dest.dim() == 1 else values.view(self.dest.shape))
        else:
            assert self.put is not None
            self.put(values)

    def takes(self, stored: Stored, lo: int, numel: int) -> bool:
        """A read of ``[lo, lo + numel)`` of ``stored`` can land in ``dest`` itself: the same range, dtype
        and a contiguous CPU view (then the others copy from it)."""
        dest = self.dest
        return (
            dest is not None
            and (self.at, self.numel) == (lo, numel)
            and dest.dtype == stored.dtype
            and dest.device.type == "cpu"
            and dest.is_contiguous()
        )


def _targets(source: Source, local: LocalGrads, stored: Mapping[str, Stored], out: dict[Stored, list[Target]]) -> None:
    """Every place this rank keeps a tensor of ``source`` that ``stored`` holds, added to ``out`` by the
    stored tensor it takes: its fragments of each partitioned one (the layout's owned_fragments, as
    views of the pieces), what it holds whole. Local."""
    if source.accessor_set is not None:  # a layout collgrad does not read: DeepSpeed's local setter
        setter = source.accessor_set
        for name, param in source.params.items():
            if name in stored:
                shape = stored[name].shape

                def put(values: torch.Tensor, param: nn.Parameter = param, shape: tuple[int, ...] = shape) -> None:
                    setter(param, values.reshape(shape).to(torch.float32))

                out.setdefault(stored[name], []).append(Target(0, stored[name].numel, put=put))
        return
    for name, targets in _fragment_targets(source, local, stored).items():
        out.setdefault(stored[name], []).extend(targets)
    for name, tensor in source.held_whole().items():
        if name in stored:
            out.setdefault(stored[name], []).append(Target(0, tensor.numel(), tensor))


def _fragment_targets(source: Source, local: LocalGrads, stored: Mapping[str, Stored]) -> dict[str, list[Target]]:
    """The views of ``source``'s local tensors each of its tensors in ``stored`` goes to: this rank's
    fragments of the partitioned ones, the whole of the replicated ones. Local."""
    out: dict[str, list[Target]] = {}
    for position, group in enumerate(source.layout.groups):
        buffer = local.buffers[position]
        if group.kind is Partitioning.REPLICATED:
            assert isinstance(buffer, list)
            for k, slot in enumerate(group.params):
                if slot.name in stored:
                    out.setdefault(slot.name, []).append(Target(0, slot.numel, buffer[k]))
            continue
        assert isinstance(buffer, Pieces)
        for fragment in owned_fragments(group, rank_in(group)):
            name = group.params[fragment.param].name
            if fragment.numel and name in stored:
                for view, at in buffer.spans(fragment.local_offset, fragment.numel):
                    out.setdefault(name, []).append(Target(fragment.param_offset + at, view.numel(), view))
    return out


def reads(targets: Sequence[tuple[int, int]], numel: int) -> tuple[tuple[int, int], ...]:
    """The ranges to read of a tensor of ``numel`` elements for ``targets`` (first element, elements):
    the whole tensor once where any target wants it whole, else each distinct range once. Pure."""
    if any(lo == 0 and n == numel for lo, n in targets):
        return ((0, numel),)
    return tuple(sorted(set(targets)))


_T = TypeVar("_T")

#: The most bytes of ranges read together into a buffer of their own (ranges read straight into place
#: are joined without a bound: they take no memory).
MAX_RUN_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Copy:
    """Elements ``[at, at + target.numel)`` of a run put in place by ``target``."""

    at: int
    target: Target


@dataclass(frozen=True)
class Run:
    """Adjacent byte ranges of one file, read with one call: ``nbytes`` at ``offset``, ``numel`` elements
    of ``dtype``, straight into ``dest`` where the first place each range goes lies right after the
    previous one's in one storage (a flat view over all of them), else into a buffer of its own; then
    ``copies`` put the run's elements where else they go. ``dest``: flat."""

    file: str
    offset: int
    numel: int
    dtype: torch.dtype
    dest: torch.Tensor | None
    copies: tuple[Copy, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def into(self) -> memoryview | None:
        """``dest``'s bytes, worked out once per run (a kept plan reads into the same ones again)."""
        return bytes_of(self.dest) if self.dest is not None else None


def _plan(into: Sequence[Into], buffers: Sequence[tuple[torch.Tensor, Stored]]) -> LoadPlan:
    """This rank's reads, each range once, joined into runs where they are adjacent in the file and (read
    straight into place) in memory, with every place their elements go. Kept with the first source's
    scratch for the next load of a checkpoint laid out the same into the same tensors. Local."""
    key = _plan_key(into, buffers)
    scratch = into[0].source.scratch
    found = scratch.get("load plan")
    if key is not None and found is not None and found[0] == key:
        kept: LoadPlan = found[1]
        return kept
    plan = with_moves(_planned(into, buffers))
    if key is not None:
        scratch["load plan"] = (key, plan)
    return plan


def _plan_key(into: Sequence[Into], buffers: Sequence[tuple[torch.Tensor, Stored]]) -> tuple[object, ...] | None:
    """What a plan depends on: every matched tensor as stored (file, offset, dtype, shape), and where
    this rank keeps each (the address, size and dtype of every tensor it keeps them in: a kept plan's
    views keep their storage alive, so an address that matches one is the same storage). None where a
    target is a setter (not kept). Local."""
    parts: list[object] = []
    for one in into:
        if one.source.accessor_set is not None:
            return None
        parts.append(tuple(one.stored.items()))
        for buffer in one.local.buffers:
            tensors = buffer.given if isinstance(buffer, Pieces) else buffer
            parts.append(tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
        parts.append(tuple((n, t.data_ptr(), t.dtype) for n, t in one.source.held_whole().items()))
    parts.append(tuple((b.data_ptr(), b.dtype, stored) for b, stored in buffers))
    return tuple(parts)


def _planned(into: Sequence[Into], buffers: Sequence[tuple[torch.Tensor, Stored]]) -> list[Run]:
    """Every place this rank keeps each stored tensor a source takes, the ranges to read for them (each
    once, straight into the first place that can take it where one can), joined into runs. Local."""
    targets: dict[Stored, list[Target]] = {}
    for one in into:
        _targets(one.source, one.local, one.stored, targets)
    for buffer, stored in buffers:
        targets.setdefault(stored, []).append(Target(0, buffer.numel(), buffer))
    single = []
    for stored, wanted in targets.items():
        for lo, numel in reads([(w.at, w.numel) for w in wanted], stored.numel):
            covered = [w for w in wanted if lo <= w.at and w.at + w.numel <= lo + numel]
            direct = next((w for w in covered if w.takes(stored, lo, numel)), None)  # straight into place
            copies = tuple(Copy(w.at - lo, w) for w in covered if w is not direct)
            dest = None if direct is None or direct.dest is None else direct.dest.view(-1)  # contiguous
            single.append(Run(stored.file, stored.byte_offset(lo), numel, stored.dtype, dest, copies))
    return joined_runs(single)


def joined_runs(runs: Iterable[Run]) -> list[Run]:
    """``runs`` in file order, each joined with the next where its bytes follow in the file and its
    elements in memory (``_joined``). Pure."""
    return _folded(sorted(runs, key=lambda r: (r.file, r.offset)), _joined)


def _folded(items: Iterable[_T], together: Callable[[_T, _T], _T | None]) -> list[_T]:
    """``items`` in order, each made one with the one before it where ``together`` can (else None). Pure."""
    out: list[_T] = []
    for item in items:
        merged = together(out[-1], item) if out else None
        if merged is not None:
            out[-1] = merged
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class LoadPlan:
    """A load's reads and, once they are all done, the copies from where they were read straight into
    place to where else those elements go (``moves``: values, target), adjacent ones made one."""

    runs: tuple[Run, ...]
    moves: tuple[tuple[torch.Tensor, Target], ...]

    @functools.cached_property
    def _batched(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, Target]]]:
        """The moves into views on the device of their values, as two lists for one foreach copy (flat
        views), and the rest (setters, another device) one by one."""
        into, values, rest = [], [], []
        for v, target in self.moves:
            dest = target.dest
            if dest is not None and dest.device == v.device and dest.is_contiguous():
                into.append(dest.view(-1))
                values.append(v)
            else:
                rest.append((v, target))
        return into, values, rest

    def move(self) -> None:
        """Every move done: one foreach copy for those it can take, the rest one by one. Local."""
        into, values, rest = self._batched
        if into:
            torch._foreach_copy_(into, values)  # one call, not one per tensor (converting dtypes as copy_)
        for v, target in rest:
            target.write(v)


def with_moves(runs: Iterable[Run]) -> LoadPlan:
    """``runs`` with the copies of those read straight into place moved after every read (their values
    stay where they were read: each place is written once), each joined with the next where both its
    values and its target follow in one storage (ZeRO-3's weight partitions, one flat buffer, into the
    fp32 partition, another: one copy). The copies of a run read into a buffer of its own stay with it,
    joined the same way by storage. Pure."""
    kept: list[Run] = []
    moves: list[tuple[torch.Tensor, Target]] = []
    for run in runs:
        if run.dest is None:
            copies = _folded(sorted(run.copies, key=lambda c: (_place(c.target.dest)[0], c.at)), _copied_together)
            kept.append(replace(run, copies=tuple(copies)))
            continue
        moves.extend((run.dest[c.at : c.at + c.target.numel], c.target) for c in run.copies)
        kept.append(replace(run, copies=()))
    joined = _folded(sorted(moves, key=lambda m: _place(m[1].dest)), _moved_together)
    return LoadPlan(tuple(kept), tuple(joined))


def _moved_together(
    first: tuple[torch.Tensor, Target], then: tuple[torch.Tensor, Target]
) -> tuple[torch.Tensor, Target] | None:
    """Two moves as one, where ``then``'s values follow ``first``'s and its place follows ``first``'s,
    each in one storage; else None."""
    (first_values, first_target), (then_values, then_target) = first, then
    if first_target.dest is None or then_target.dest is None:
        return None
    values, dest = adjacent_view([first_values, then_values]), adjacent_view([first_target.dest, then_target.dest])
    if values is None or dest is None:
        return None
    return values, Target(first_target.at, dest.numel(), dest)


def _place(dest: torch.Tensor | None) -> tuple[int, int]:
    """Where ``dest`` lies (its storage, its offset in it): ordering by it puts neighbours side by side."""
    return (dest.untyped_storage().data_ptr(), int(dest.storage_offset())) if dest is not None else (-1, 0)


def _joined(first: Run, then: Run) -> Run | None:
    """``first`` and ``then`` as one run, where ``then``'s bytes follow ``first``'s in the same file and
    either both are read straight into place, ``then``'s right after ``first``'s in one storage, or
    both into buffers of their own, together at most ``MAX_RUN_BYTES``; else None. Pure."""
    if (first.file, first.dtype, first.offset + first.nbytes) != (then.file, then.dtype, then.offset):
        return None
    if first.dest is not None and then.dest is not None:
        dest = adjacent_view([first.dest, then.dest])
        if dest is None:
            return None
    elif first.dest is None and then.dest is None:
        if first.nbytes + then.nbytes > MAX_RUN_BYTES:
            return None
        dest = None
    else:
        return None
    moved = tuple(Copy(first.numel + c.at, c.target) for c in then.copies)
    return Run(first.file, first.offset, first.numel + then.numel, first.dtype, dest, first.copies + moved)


def _copied_together(first: Copy, then: Copy) -> Copy | None:
    """Two copies out of one run's buffer as one, where ``then``'s elements follow ``first``'s in the
    run and its place follows ``first``'s in one storage; else None."""
    a, b = first.target.dest, then.target.dest
    if first.at + first.target.numel != then.at or a is None or b is None:
        return None
    dest = adjacent_view([a, b])
    return Copy(first.at, Target(first.target.at, dest.numel(), dest)) if dest is not None else None


def read_plan(model: object, path: str | os.PathLike[str]) -> tuple[Run, ...]:
    """The runs of byte ranges ``load_full_model(model, path, strict=False)`` reads on this rank, in
    order, without reading them (the benchmark times the same reads raw). Local: no communication."""
    resolved = adapters.resolve(model)
    opened = _sources(resolved, None)
    matched = _match(resolved.module, opened[0][0], open_checkpoint(path), None, strict=False)
    into = [Into(source, local, matched.stored) for source, local in opened]
    return _plan(into, [(b, matched.stored[n]) for n, b in matched.buffers.items()]).runs
