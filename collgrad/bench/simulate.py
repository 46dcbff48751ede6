"""``python -m collgrad simulate``: every job's plan for one rank of a simulated world, built by the
planners the jobs themselves run, in one process, without a process group and without the model's
memory: what a rank of 4,096 would plan, and what it would read, write and send.

    python -m collgrad simulate --framework zero2 --world 1024 --layers 5000 --hidden 256 [--rank R] [--json]

The model is a synthetic transformer: L layers of 8 tensors (two norms of h; q, k, v, o of h x h; an
up projection 4h x h and a down projection h x 4h), laid out as each framework lays it out
(``layouts``):

    zero1, zero2   DeepSpeed's flat buffer of bf16 weights, padded to 2 x world elements and cut into
                   world equal partitions (fp32 masters and Adam's two states alike); the module's
                   weights whole on every rank, views of one flat buffer
    zero3          every tensor cut into world slices of ceil(numel / world), bf16 weights, fp32 masters
                   and states, each kind one flat buffer a rank
    fsdp2          every tensor cut on dim 0 into world slices of ceil(rows / world) rows, fp32 weights
                   (the masters), each tensor its own storage

Per job it reports the planning time (median over ``reps``), the peak of the memory planning took
(tracemalloc, one more run), and the I/O and network figures of the plan: ``io_calls`` (the positional
writes and reads of the safetensors files, headers included: a header written is one call, a header
read one call of its 8 + N bytes), ``bytes_read`` and ``bytes_written`` (those calls' bytes),
``bytes_sent`` (what this rank puts into collectives: its input of each all-gather, all-reduce and
all-to-all) and ``files`` (the safetensors files it opens). The JSON around them (a training state's
manifest, an index, hash files) and a verified load's hashing of mapped files are not counted. The
plans are the jobs' own (``plan_grads``, ``plan_full_model``, ``write_items``, ``exchanged_writes``,
``split_reads``: small slices exchanged, what every rank holds alike read once between the ranks where
``IoCosts`` say so: a network file system's costs, IoCosts' defaults, or the environment's ``COLLGRAD_*``
costs as a real job's). The calls follow
storage.py's rules, applied to a model of each framework's memory (``_Memory``): a write joins the one
before it where its bytes follow on in the file and its values in memory, or where both are small
(``IoCosts.joined_below``: copied into the writer's buffer, at most ``JOINED_WRITE_BYTES``); a read goes straight
into place where the place is contiguous and of the stored dtype, and joins the run before it where
both follow on (or both go through a buffer, together at most ``MAX_RUN_BYTES``); an exchanged or
shared turn is a call a run. tests/fsdp/test_simulate.py compares these figures with the calls and
bytes counted inside real ranks.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import statistics
import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

from collgrad._compat import uncollected
from collgrad.checkpoint.match import io_costs, shared_min_bytes
from collgrad.checkpoint.plan import (
    WHOLE,
    Files,
    Held,
    Holding,
    ReadItem,
    WriteItem,
    exchanged_writes,
    holdings,
    lay_out,
    small_slices,
    split_reads,
    turn_runs,
    write_items,
)
from collgrad.checkpoint.safetensors import Entry, MetadataFiles, Stored
from collgrad.checkpoint.save import DEFAULT_MAX_SHARD_BYTES, plan_full_model
from collgrad.checkpoint.storage import JOINED_WRITE_BYTES, MAX_RUN_BYTES, reads
from collgrad.checkpoint.training import file_names
from collgrad.state.layout import LayoutGroup, ParamSlot, Partitioning, StateLayout, gathered_runs
from collgrad.state.plan import GradCall, PlanKind, plan_grads
from collgrad.state.steps import ReduceStep, SlicesStep, flat_views

__all__ = ["FRAMEWORKS", "JOBS", "synthetic", "Simulated", "Figures", "simulate", "main", "add_arguments"]

FRAMEWORKS = ("zero1", "zero2", "zero3", "fsdp2")
JOBS = ("grads", "grads_stream", "save_full_model", "load_full_model", "save_training_state", "load_training_state")

#: The bucket the jobs' streams and all-reduces take by default (``bucket_bytes=None``).
BUCKET_BYTES = 64 * 2**20
#: A training state's files: the module's weights, the fp32 masters, Adam's two states.
STEMS = ("model", "fp32", "optimizer-0", "optimizer-1")
#: The most one pwrite or preadv moves (storage.py's ``_MOST``).
_MOST = 0x7FFFF000


def synthetic(layers: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """The synthetic transformer's tensors in order: L layers of 8 (see the module's docstring)."""
    h = hidden
    layer = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (h, h)),
        ("self_attn.k_proj.weight", (h, h)),
        ("self_attn.v_proj.weight", (h, h)),
        ("self_attn.o_proj.weight", (h, h)),
        ("mlp.up_proj.weight", (4 * h, h)),
        ("mlp.down_proj.weight", (h, 4 * h)),
        ("post_attention_layernorm.weight", (h,)),
    ]
    return [(f"layers.{i}.{name}", shape) for i in range(layers) for name, shape in layer]


class _Memory(NamedTuple):
    """Where a kind's holdings lie, as storage.py would find them: a partition's local buffer one storage
    (DeepSpeed's flat partitions) or one per parameter (FSDP2: ``starts``, each parameter's first
    element in the buffer); a tensor held whole where ``whole`` says; the dtype they are kept in."""

    dtype: torch.dtype
    starts: tuple[int, ...]
    whole: Callable[[int], tuple[object, int]]

    def place(self, held: Held) -> tuple[object, int]:
        """The storage an element of ``held`` lies in, and its element offset there."""
        if held.group == WHOLE or held.param >= 0:
            storage, at = self.whole(held.param)
            return storage, at + held.offset
        if not self.starts:
            return ("flat", held.source), held.offset
        k = bisect.bisect_right(self.starts, held.offset) - 1
        return ("param", held.source, k), held.offset - self.starts[k]


@dataclass(frozen=True)
class Simulated:
    """One rank (``rank``) of a world of ``world`` ranks training the synthetic transformer under
    ``framework``: its layouts, as the framework's adapter would build them. Pure."""

    framework: str
    world: int
    rank: int
    layers: int
    hidden: int

    @functools.cached_property
    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        return synthetic(self.layers, self.hidden)

    @property
    def model_dtype(self) -> torch.dtype:
        return torch.float32 if self.framework == "fsdp2" else torch.bfloat16

    @property
    def keeps_masters(self) -> bool:
        """The optimizer keeps fp32 masters apart from the module's weights, so a load writes both (the
        adapters' ``load_kinds``: DeepSpeed's ZeRO optimizers); FSDP2 steps the weights themselves."""
        return self.framework != "fsdp2"

    def layout(self, stem: str) -> StateLayout:
        """The layout of a kind: ``grads``, or a training state's stem (``model``: the module's weights),
        as the framework's adapter builds it once (not part of any plan's time)."""
        found = self._layouts.get(stem)
        if found is None:
            wire = self.model_dtype if stem in ("grads", "model") else torch.float32
            out = torch.float32 if stem != "model" else wire
            if self.framework in ("zero1", "zero2") and stem == "model":
                group = _replicated(self.tensors, self.world, wire)
            elif self.framework in ("zero1", "zero2"):
                group = _flat(self.tensors, self.world, wire, out)
            else:
                group = _sliced(self.tensors, self.world, wire, out, by_rows=self.framework == "fsdp2")
            found = self._layouts[stem] = StateLayout(self.framework, (group,), tuple(n for n, _ in self.tensors))
        return found

    @functools.cached_property
    def _layouts(self) -> dict[str, StateLayout]:
        return {}

    def memory(self, stem: str) -> _Memory:
        """Where the kind ``stem`` lies on this rank: ZeRO's partitions one flat buffer a kind, FSDP2's
        a tensor a parameter; ZeRO-1/2's weights views of one flat buffer (at their flat offsets),
        ZeRO-3's and FSDP2's whole tensors each its own (a stream's)."""
        group = self.layout(stem).groups[0]
        starts = tuple(p.offset for p in group.params) if self.framework == "fsdp2" else ()
        if self.framework in ("zero1", "zero2"):
            offsets = [p.offset for p in self.layout("grads").groups[0].params]
            return _Memory(group.wire_dtype, starts, lambda k: ("flat weights", offsets[k]))
        return _Memory(group.wire_dtype, starts, lambda k: (("whole", k), 0))

    @functools.cached_property
    def saved_model(self) -> Files:
        """The files ``save_full_model`` lays out: what a load finds on the disk (not part of its plan)."""
        return lay_out({"model": _entries(self, "model")}, DEFAULT_MAX_SHARD_BYTES)

    @functools.cached_property
    def saved_training_state(self) -> Files:
        """The files ``save_training_state`` lays out: what a load finds on the disk."""
        return _training_layout(self)

    def prepare(self) -> None:
        """Every layout built: what the adapters hold before any job plans; the files the loads find."""
        for stem in ("grads", *STEMS):
            self.layout(stem)
        _ = self.saved_model, self.saved_training_state


def _flat(
    tensors: Sequence[tuple[str, tuple[int, ...]]], world: int, wire: torch.dtype, out: torch.dtype
) -> LayoutGroup:
    """DeepSpeed ZeRO-1/2: the tensors back to back, the flat buffer padded to a multiple of
    2 x world elements (its ``nccl_start_alignment_factor`` of 2 per rank), world equal partitions."""
    slots, offset = [], 0
    for name, shape in tensors:
        numel = math.prod(shape)
        slots.append(ParamSlot(name, shape, numel, offset, numel))
        offset += numel
    padded = -(-offset // (2 * world)) * 2 * world
    ranks = tuple(range(world))
    return LayoutGroup(0, Partitioning.PARTITIONED_FLAT, ranks, padded // world, wire, out, tuple(slots))


def _sliced(
    tensors: Sequence[tuple[str, tuple[int, ...]]], world: int, wire: torch.dtype, out: torch.dtype, by_rows: bool
) -> LayoutGroup:
    """ZeRO-3 (ceil(numel / world) elements a slice) or FSDP2 (``by_rows``: ceil(rows / world) rows)."""
    slots, offset = [], 0
    for name, shape in tensors:
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        per = -(-rows // world) * (numel // max(rows, 1)) if by_rows else -(-numel // world)
        slots.append(ParamSlot(name, shape, numel, offset, per))
        offset += per
    return LayoutGroup(0, Partitioning.SLICED, tuple(range(world)), offset, wire, out, tuple(slots))


def _replicated(tensors: Sequence[tuple[str, tuple[int, ...]]], world: int, dtype: torch.dtype) -> LayoutGroup:
    slots = tuple(ParamSlot(n, s, math.prod(s), 0, math.prod(s)) for n, s in tensors)
    return LayoutGroup(0, Partitioning.REPLICATED, tuple(range(world)), 0, dtype, dtype, slots)


# ------------------------------------------------------------------------------------------ the figures


@dataclass(frozen=True)
class Figures:
    """One job's plan for one rank (the module's docstring says what each counts)."""

    job: str
    framework: str
    world: int
    tensors: int
    rank: int
    plan_ms: float
    peak_mb: float
    io_calls: int
    bytes_read: int
    bytes_written: int
    bytes_sent: int
    files: int


class _Io(NamedTuple):
    calls: int = 0
    read: int = 0
    written: int = 0
    sent: int = 0
    files: int = 0


def _pieces(nbytes: int) -> int:
    """The calls one range of ``nbytes`` takes (storage.py's loops of at most ``_MOST`` each)."""
    return max(1, -(-nbytes // _MOST))


def _written(
    items: Sequence[WriteItem], place: Callable[[Held], tuple[object, int]], kept: bool, joined_below: int
) -> _Io:
    """The pwrites of ``items`` as storage.Writer makes them: a header one call; an item's values joined
    with the write waiting before it where its bytes follow in the file, as one view where its values
    follow in the same storage, else through the writer's buffer where both are small (under
    ``joined_below`` and ``JOINED_WRITE_BYTES``; the waiting one may be in the buffer already) and
    together at most ``JOINED_WRITE_BYTES``; a write waits where its values stay (``kept``) or, copied
    into that buffer, where it is small (a stream's bucket, overwritten by the next)."""
    calls = written = 0
    # the write waiting: (file, its end in it, the storage its values lie in ("buffer": the writer's), their end)
    held: tuple[str, int, object, int] | None = None
    held_bytes = 0
    small = min(joined_below, JOINED_WRITE_BYTES + 1)
    for item in items:
        if item.held is None:  # a header: the write waiting goes first
            if held is not None:
                calls, held = calls + _pieces(held_bytes), None
            calls, written = calls + 1, written + item.ranges.numel
            continue
        nbytes = item.nbytes
        written += nbytes
        storage, at = place(item.held)
        start = at * item.dtype.itemsize
        if held is not None and (held[0], held[1]) == (item.file, item.offset):
            if (held[2], held[3]) == (storage, start):
                held, held_bytes = (item.file, item.offset + nbytes, storage, start + nbytes), held_bytes + nbytes
                continue
            if (
                nbytes < small
                and (held_bytes < small or held[2] == "buffer")
                and held_bytes + nbytes <= JOINED_WRITE_BYTES
            ):
                held, held_bytes = (item.file, item.offset + nbytes, "buffer", 0), held_bytes + nbytes
                continue
        if held is not None:
            calls, held = calls + _pieces(held_bytes), None
        if kept:
            held, held_bytes = (item.file, item.offset + nbytes, storage, start + nbytes), nbytes
        elif nbytes < small:
            held, held_bytes = (item.file, item.offset + nbytes, "buffer", 0), nbytes
        else:
            calls += _pieces(nbytes)
    if held is not None:
        calls += _pieces(held_bytes)
    return _Io(calls, 0, written, 0, len({item.file for item in items}))


def _read(
    items: Sequence[ReadItem], place: Callable[[Held], tuple[object, int]], dtype_of: Callable[[Held], torch.dtype]
) -> _Io:
    """The preadvs of ``items`` as storage.load_plan makes them: each stored tensor's ranges read once
    (``reads``), straight into place where a place takes the whole range in the stored dtype, else
    into a buffer; runs joined where their bytes follow in the file and either both go straight into
    places that follow in one storage or both into buffers of at most ``MAX_RUN_BYTES`` together."""
    wanted: dict[tuple[str, int, torch.dtype, int], list[tuple[int, int, Held]]] = {}
    for item in items:
        start = item.offset - item.ranges.start * item.dtype.itemsize
        key = (item.file, start, item.dtype, math.prod(item.shape))
        wanted.setdefault(key, []).append((item.ranges.start, item.ranges.numel, item.held))
    runs = []  # (file, offset, nbytes, dtype, storage and byte offset or None)
    for (file, start, dtype, numel), targets in wanted.items():
        for lo, n in reads([(at, k) for at, k, _ in targets], numel):
            direct = next((h for at, k, h in targets if (at, k) == (lo, n) and dtype_of(h) == dtype), None)
            dest = None
            if direct is not None:
                storage, at = place(direct)
                dest = (storage, at * dtype.itemsize)
            runs.append((file, start + lo * dtype.itemsize, n * dtype.itemsize, dtype, dest))
    runs.sort(key=lambda r: (r[0], r[1]))
    calls, total, last = 0, 0, None
    for file, offset, nbytes, dtype, dest in runs:
        total += nbytes
        if last is not None and (last[0], last[1] + last[2], last[3]) == (file, offset, dtype):
            if dest is not None and last[4] is not None and last[4][0] == dest[0] and last[4][1] + last[2] == dest[1]:
                last = (file, last[1], last[2] + nbytes, dtype, last[4])
                continue
            if dest is None and last[4] is None and last[2] + nbytes <= MAX_RUN_BYTES:
                last = (file, last[1], last[2] + nbytes, dtype, None)
                continue
        if last is not None:
            calls += _pieces(last[2])
        last = (file, offset, nbytes, dtype, dest)
    if last is not None:
        calls += _pieces(last[2])
    return _Io(calls, total, 0, 0, len({file for file, *_ in runs}))


# ---------------------------------------------------------------------------------------------- the jobs


def _grads(sim: Simulated, streaming: bool) -> _Io:
    """A gradient read's plan (``safe_get_full_model_grads``; ``streaming``: ``iter_full_model_grads``),
    the capabilities agreed with a bucket all-gather: the kinds, the batches, each step's layout, and
    for a gather of ZeRO-1/2 partitions where every gathered run lies (each rank's partition one piece)."""
    layout = sim.layout("grads")
    plan = plan_grads(layout, GradCall("auto", BUCKET_BYTES, streaming), {0: True}, ranks={0: sim.rank})
    group, steps = layout.groups[0], plan.groups[0]
    size = group.wire_dtype.itemsize
    if steps.kind is PlanKind.ALL_GATHER and group.kind is Partitioning.PARTITIONED_FLAT:
        where = gathered_runs(group, [[(0, 0, group.partition_numel)]] * group.world)
        shapes = [p.shape for p in group.params]
        for batch in steps.batches:
            flat_views(where, batch, shapes)
        return _Io(sent=group.partition_numel * size)
    sent = 0
    for step in steps.steps:
        if isinstance(step, ReduceStep):
            sent += step.total * size
        elif isinstance(step, SlicesStep):
            sent += step.span * size
    return _Io(sent=sent)


def _entries(sim: Simulated, stem: str) -> list[Entry]:
    dtype = sim.model_dtype if stem == "model" else torch.float32
    return [Entry(name, shape, dtype) for name, shape in sim.tensors]


def _stored(files: Files) -> tuple[dict[tuple[str, str], Stored], int]:
    """Every file's header parsed as a load parses it (the checks of every entry against the file), by
    (stem, name); and the headers' bytes (the first rank reads them, every rank parses them)."""
    stored: dict[tuple[str, str], Stored] = {}
    header_bytes = 0
    read = MetadataFiles()  # as a load's: a header of the same bytes as the one before parsed once
    for kind, named in files.shards.items():
        for file, shard in named:
            tensors, size = read.parsed(file, shard.header[8:], shard.size)
            header_bytes += size
            stored.update(((kind, name), found) for name, found in tensors.items())
    return stored, header_bytes


def _save_full_model(sim: Simulated) -> _Io:
    """``save_full_model`` in the module's dtype into a shared directory: the stream's plan where the
    weights are partitioned (ZeRO-3, FSDP2), the shards laid out and this rank's turn of them."""
    sent = 0
    layout = sim.layout("model")
    if layout.groups[0].kind is not Partitioning.REPLICATED:
        stream = _grads_of(layout, sim.rank, streaming=True)
        sent = stream.sent
    _, items = plan_full_model(_entries(sim, "model"), DEFAULT_MAX_SHARD_BYTES, sim.rank, sim.world)
    kept = layout.groups[0].kind is Partitioning.REPLICATED  # a stream's bucket: its tensors copied to wait
    return _written(items, sim.memory("model").place, kept, io_costs().joined_below)._replace(sent=sent)


def _grads_of(layout: StateLayout, rank: int, streaming: bool) -> _Io:
    group = layout.groups[0]
    plan = plan_grads(layout, GradCall("auto", BUCKET_BYTES, streaming), {0: True}, ranks={0: rank})
    span = sum(step.span for step in plan.groups[0].steps if isinstance(step, SlicesStep))
    return _Io(sent=span * group.wire_dtype.itemsize)


def _load_full_model(sim: Simulated) -> _Io:
    """``load_full_model`` of what ``save_full_model`` wrote: every header parsed, this rank's holdings of
    the module's weights as read items, and of the masters where the optimizer keeps its own (read from
    the same tensors of the file: load.py's sources, each by its stem)."""
    files = sim.saved_model
    stored, header_bytes = _stored(files)
    held = holdings("model", 0, sim.layout("model"), [sim.rank])
    if sim.keeps_masters:
        held += holdings("fp32", 1, sim.layout("fp32"), [sim.rank])
        stored.update({("fp32", name): stored[("model", name)] for name, _ in sim.tensors})
    stems = ["model", "fp32"] if sim.keeps_masters else ["model"]
    io = _loaded(sim, stored, held, stems, ["model", "fp32"])
    return _with_metadata(sim, io, files, header_bytes)


def _loaded(
    sim: Simulated,
    stored: Mapping[tuple[str, str], Stored],
    held: list[Holding],
    stems: list[str],
    by_source: list[str],
) -> _Io:
    """A load's reads of ``held`` (``by_source[k]``: the stem of source k, whose memory it lies in), as
    match.planned_reads plans them: what every rank holds alike read once between the ranks (each its
    turn, one gather a window), small slices read by one rank each and exchanged (one all-to-all a
    window), the rest read where it lies."""
    memories = [sim.memory(stem) for stem in by_source]
    costs = io_costs()
    small = small_slices([(stem, sim.layout(stem)) for stem in stems], stored, costs, sim.world)
    split = split_reads(stored, held, sim.rank, sim.world, costs.shares(sim.world), shared_min_bytes(), small)
    exchanged = split.exchanged
    io = _read(split.own, lambda h: memories[h.source].place(h), lambda h: memories[h.source].dtype)
    calls, read, sent = io.calls, io.read, 0
    touched = {item.file for item in split.own}
    for window in split.shared:
        runs = turn_runs(window, sim.rank)
        calls += sum(_pieces(n) for *_, n in runs)
        read += sum(n for *_, n in runs)
        sent += window.part_bytes
        touched.update(file for file, *_ in runs)
    for one in exchanged:
        calls += sum(_pieces(n) for *_, n in one.runs)
        read += sum(n for *_, n in one.runs)
        sent += sum(one.sent)
        touched.update(file for file, *_ in one.runs)
    return _Io(calls, read, 0, sent, len(touched))


def _training_layout(sim: Simulated) -> Files:
    entries = {stem: _entries(sim, stem) for stem in STEMS}
    return lay_out(entries, DEFAULT_MAX_SHARD_BYTES, file_names("0" * 16, STEMS))


def _training_files(sim: Simulated, saving: bool) -> tuple[Files, list[list[Holding]]]:
    """The training state's files (laid out: a save's plan; as on the disk: a load's) and this rank's
    holdings of each kind."""
    files = _training_layout(sim) if saving else sim.saved_training_state
    held = [holdings(stem, k, sim.layout(stem), [sim.rank]) for k, stem in enumerate(STEMS)]
    return files, held


def _save_training_state(sim: Simulated) -> _Io:
    """``save_training_state`` into a shared directory: every kind's files laid out, this rank's write
    items (its fragments, its turn of the headers and of what every rank holds whole)."""
    files, held = _training_files(sim, saving=True)
    items = write_items(files, [h for one in held for h in one], sim.rank, sim.world)
    small = small_slices([(stem, sim.layout(stem)) for stem in STEMS], files.placed, io_costs(), sim.world)
    direct, exchanged = exchanged_writes(files, items, small, sim.rank, sim.world)
    memories = [sim.memory(stem) for stem in STEMS]
    io = _written(direct, lambda h: memories[h.source].place(h), True, io_costs().joined_below)
    calls, written, sent = io.calls, io.written, 0
    touched = {item.file for item in direct}
    for one in exchanged:  # its runs, each written at once, then the next window's
        calls += sum(_pieces(n) for *_, n in one.runs)
        written += sum(n for *_, n in one.runs)
        sent += sum(one.sent)
        touched.update(file for file, *_ in one.runs)
    return _Io(calls, 0, written, sent, len(touched))


def _load_training_state(sim: Simulated) -> _Io:
    """``load_training_state`` of what ``save_training_state`` wrote at the same layout: every header
    parsed (the module's weights' files too), this rank's holdings as read items: of the module's
    weights from the fp32 masters' tensors (training.py's ``_match``: trainable weights are the masters
    in the module's dtype; the weights' files are not read), of the masters where the optimizer keeps
    its own, of Adam's two states."""
    files, held = _training_files(sim, saving=False)
    stored, header_bytes = _stored(files)
    stored.update({("model", name): stored[("fp32", name)] for name, _ in sim.tensors})
    stems = [stem for stem in STEMS if stem != "fp32" or sim.keeps_masters]
    io = _loaded(sim, stored, [h for k, stem in enumerate(STEMS) if stem in stems for h in held[k]], stems, list(STEMS))
    return _with_metadata(sim, io, files, header_bytes)


def _with_metadata(sim: Simulated, io: _Io, files: Files, header_bytes: int) -> _Io:
    """A load's reads with its metadata's: every header (a call of 8 + N bytes each; the index or manifest,
    JSON, not counted) read by every rank, or, where the costs say it pays (``IoCosts.shares``), by the
    group's first rank, which broadcasts them (its bytes sent: the headers'), the others reading none
    (agree.metadata_once). Every rank parses them all (the plan's time)."""
    once = io_costs().shares(sim.world)
    if once and sim.rank != 0:
        return io
    headers = len(files.names())
    read, sent = io.read + header_bytes, io.sent + (header_bytes if once else 0)
    return io._replace(calls=io.calls + headers, read=read, sent=sent, files=headers)


_JOBS: Mapping[str, Callable[[Simulated], _Io]] = {
    "grads": lambda sim: _grads(sim, streaming=False),
    "grads_stream": lambda sim: _grads(sim, streaming=True),
    "save_full_model": _save_full_model,
    "load_full_model": _load_full_model,
    "save_training_state": _save_training_state,
    "load_training_state": _load_training_state,
}


def simulate(sim: Simulated, jobs: Iterable[str] = JOBS, reps: int = 3) -> list[Figures]:
    """Each job's ``Figures`` for ``sim``'s rank: its plan built ``reps`` times (the median taken), once
    more under tracemalloc for the peak. Pure: no process group, no file, no model. Call it in a process
    whose native threads do not allocate (not inside a rank with a process group running): before
    CPython 3.12.9 and 3.13.2, starting and stopping tracemalloc races with them (gh-128679, a segfault)."""
    out = []
    sim.prepare()
    for job in jobs:
        # as the jobs plan: with the cyclic collector paused (their planners, begin_save, planned_reads)
        run = uncollected(_JOBS[job])
        times, io = [], _Io()
        for _ in range(reps):
            start = time.perf_counter()
            io = run(sim)
            times.append(time.perf_counter() - start)
        tracemalloc.start()
        try:
            run(sim)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        ms = round(statistics.median(times) * 1e3, 2)
        figures = (io.calls, io.read, io.written, io.sent, io.files)
        out.append(
            Figures(job, sim.framework, sim.world, len(sim.tensors), sim.rank, ms, round(peak / 2**20, 2), *figures)
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=FRAMEWORKS, default="zero2")
    parser.add_argument("--world", type=int, default=8, help="ranks in the simulated world")
    parser.add_argument("--layers", type=int, default=50, help="layers of 8 tensors")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rank", type=int, default=0, help="the rank whose plans are built")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated, of " + ", ".join(JOBS))
    parser.add_argument("--reps", type=int, default=3, help="plans built per job (the median is reported)")
    parser.add_argument("--json", action="store_true", help="one JSON object a line")


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.rank < args.world or args.layers < 1 or args.hidden < 1 or args.reps < 1:
        raise SystemExit("simulate: needs 0 <= --rank < --world, and --layers, --hidden, --reps of at least 1")
    jobs = [j for j in args.jobs.split(",") if j]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        raise SystemExit(f"simulate: unknown jobs {unknown}; choose from {', '.join(JOBS)}")
    sim = Simulated(args.framework, args.world, args.rank, args.layers, args.hidden)
    rows = simulate(sim, jobs, args.reps)
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    print(f"collgrad simulate: {sim.framework}, rank {sim.rank} of {sim.world}, {len(sim.tensors):,} tensors")
    head = ("plan ms", 9), ("peak MB", 8), ("io calls", 9), ("read", 12), ("written", 12), ("sent", 12), ("files", 5)
    print(f"  {'job':<20} " + " ".join(f"{name:>{width}}" for name, width in head))
    for r in rows:
        print(
            f"  {r.job:<20} {r.plan_ms:>9.1f} {r.peak_mb:>8.1f} {r.io_calls:>9,} {r.bytes_read:>12,} "
            f"{r.bytes_written:>12,} {r.bytes_sent:>12,} {r.files:>5}"
        )
    return 0
