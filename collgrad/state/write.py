"""Writing full gradients back: ``safe_set_full_model_grads`` and ``safe_update_full_model_grads``.

Every rank passes the same full values; each writes only the elements it owns, where the optimizer
will step from (the source knows where: sources/), so writing needs no bulk collective::

    grads = {name: full gradient}     (the same on every rank; checked with check=True)
        |  check=True: a checksum of a sample of what rank r reads (its owned parts) and of what
        |  rank r+1 reads, from rank r's values (sampled_checksum)
        |  readiness, arguments and those checksums in one small all-gather; rank r's second must
        |  be rank r+1's first (every part compared by two ranks), else all raise together;
        |  meanwhile the copies are made ready (views)
    rank r: owned parts of each parameter  ->  one torch._foreach_copy_, times the loss scale (fp16)
        |  derived state refreshed (ZeRO-1/2 CPU offload: the per-parameter norms it clips with)
    next engine.step() clips, checks overflow and updates from the new values

``safe_update_full_model_grads`` streams: read a bucket of full gradients, hand each to ``fn``, write the
results back, next bucket; about two buckets of extra memory.
"""

from __future__ import annotations

import array
import functools
import itertools
import operator
from collections.abc import Mapping
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch

from collgrad import _compat
from collgrad.backends import agreement
from collgrad.backends.agreement import Field, ranks_by_value, stable_hash
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.errors import ArgumentMismatchError, InvalidArgumentError, NotReadyError, UnknownParameterError
from collgrad.state import adapters
from collgrad.state.adapters.base import Copies, Problem, Source
from collgrad.state.call import OpenCall, source_of
from collgrad.state.execute import Executor
from collgrad.state.kinds import GRAD, StateKind
from collgrad.state.layout import Partitioning
from collgrad.state.record import StateRecord
from collgrad.state.whole import LOCAL, checked_mode, narrowed

__all__ = [
    "safe_set_full_model_grads",
    "safe_update_full_model_grads",
    "checksums",
    "sampled_checksum",
    "sampled_checksums",
    "SAMPLE_BYTES",
    "set_full",
    "write_here",
]


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Per tensor, a number that differs, with high probability, when any element differs bit for bit:
    the sum, wrapping in int64, of its bytes read as 64-bit words (order-free integer arithmetic: the
    same on every rank and device for equal tensors; two elements swapped within a word change it too).
    One reduction per tensor and one transfer for all, rather than a read back per tensor (measurements:
    docs/notes/)."""
    sums = []
    with torch.no_grad():
        for t in tensors:
            if t.numel() * t.element_size() % 8 == 0 and t.is_contiguous():
                try:  # the usual case, in three calls
                    sums.append(t.view(-1).view(torch.int64).sum())
                    continue
                except RuntimeError:
                    pass  # not 8-byte aligned in its storage
            sums.append(_word_sum(t))
    out = [0] * len(sums)
    for device in {x.device for x in sums}:  # one read back per device
        at = [i for i, x in enumerate(sums) if x.device == device]
        for i, value in zip(at, torch.stack([sums[i] for i in at]).tolist()):
            out[i] = value & ((1 << 62) - 1)  # fits in the int64 the exchange carries
    return out


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """``checksums``' number for any tensor: a copy where it is not 8-byte aligned (same values, same
    number), the elements that do not fill a word widened one by one."""
    flat = t.reshape(-1)
    cut = flat.numel() - flat.numel() * flat.element_size() % 8 // flat.element_size()
    try:
        words = flat[:cut].view(torch.int64)
    except RuntimeError:
        flat = flat.clone()
        words = flat[:cut].view(torch.int64)
    total = words.sum()
    if cut < flat.numel():
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        total = total + flat[cut:].contiguous().view(bits).sum(dtype=torch.int64) * 1_000_003
    return total


#: The check's sample: each part's first element and one in every this many bytes after it (a page), so
#: that the check costs a fraction of reading the values once: at 512 bytes the scattered reads (a cache
#: and TLB miss each) cost more than the rest of the check (docs/benchmarks.md, the writes).
SAMPLE_BYTES = 4096

#: An odd 63-bit multiplier (PCG's): the position weights of the sample's words.
_WEIGHT = 0x5851F42D4C957F2D


def sampled_checksum(
    values: Mapping[str, torch.Tensor],
    parts: Sequence[tuple[str, int, int]],
    memo: dict[Hashable, Any] | None = None,
) -> int:
    """A number that differs, with high probability, when the values differ bit for bit in any sampled
    element of ``parts`` ((name, first element, count) of ``values[name]`` flattened). The sample: of
    each part, its first element and every ``SAMPLE_BYTES // element size``-th one after it; their bits
    as integers, each weighted by its position in the parts' samples one after another (so that moved
    values count too), summed wrapping in int64, per dtype. Integer arithmetic on the same elements
    however the values lie in memory: the same on every rank and device for equal values.

    Parts that are views of one buffer (what collgrad's own reads return) are gathered in one indexed
    read for them all; other parts take a strided view each, concatenated once. ``memo``: see
    ``sampled_checksums``. Local."""
    return sampled_checksums(values, (tuple(parts),), memo)[0]


def sampled_checksums(
    values: Mapping[str, torch.Tensor],
    regions: Sequence[tuple[tuple[str, int, int], ...]],
    memo: dict[Hashable, Any] | None = None,
) -> list[int]:
    """``sampled_checksum`` of each of ``regions`` (parts each), in one pass over the values: one
    indexed read per buffer the values view for all regions together (a rank's check reads two: its own
    parts and the next rank's). ``memo``: where the regions' columns are kept between calls (the
    source's scratch: its regions are the same tuples each call). Local."""
    names, los, numels, labels = _columns(regions, memo)
    totals = [0] * len(regions)
    if not names:
        return totals
    held = list(map(values.__getitem__, names))
    dtypes = list(map(_dtype, held))
    by_dtype: dict[torch.dtype, list[int] | None] = {}
    if len(set(dtypes)) == 1:  # the usual case, without a step per part
        by_dtype[dtypes[0]] = None
    else:
        for i, dtype in enumerate(dtypes):
            found = by_dtype.setdefault(dtype, [])
            assert found is not None
            found.append(i)
    with torch.no_grad():
        for dtype, chosen in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            if chosen is None:
                sums = _dtype_sums(held, los, numels, labels, len(regions))
                present = set(labels)
            else:
                these = tuple(labels[i] for i in chosen)
                picked = [held[i] for i in chosen]
                los_, numels_ = tuple(los[i] for i in chosen), tuple(numels[i] for i in chosen)
                sums = _dtype_sums(picked, los_, numels_, these, len(regions))
                present = set(these)
            for region in present:
                totals[region] = totals[region] * 1_000_003 + stable_hash(str(dtype)) + sums[region]
    return [total & ((1 << 62) - 1) for total in totals]  # fits in the int64 the exchange carries


_Columns = tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _columns(regions: Sequence[tuple[tuple[str, int, int], ...]], memo: dict[Hashable, Any] | None) -> _Columns:
    """The parts of ``regions``, one region after another, as columns: names, first elements, counts,
    and each part's region. Kept in ``memo`` for regions passed as the same tuples again, by their
    identity (held there, so an id is never another tuple's): a few passes over every part, ~0.1 ms a
    write in the ranks, otherwise."""
    kept_here = memo.setdefault("checksum columns", {}) if memo is not None else None
    key = tuple(map(id, regions))
    found = kept_here.get(key) if kept_here is not None else None
    if found is not None and all(map(operator.is_, found[0], regions)):
        kept: _Columns = found[1]
        return kept
    parts = [part for region in regions for part in region]
    columns: _Columns = (
        tuple(map(_name, parts)),
        tuple(map(_lo, parts)),
        tuple(map(_count, parts)),
        _labels(tuple(map(len, regions))),
    )
    # kept only for what cannot change in place
    if kept_here is not None and all(type(r) is tuple for r in regions) and all(type(p) is tuple for p in parts):
        if len(kept_here) >= 8:  # a few kinds of state written, each its own regions
            kept_here.pop(next(iter(kept_here)))
        kept_here[key] = (tuple(regions), columns)
    return columns


@functools.lru_cache(maxsize=8)
def _labels(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Each part's region, for regions of ``lengths`` parts one after another."""
    return tuple(itertools.chain.from_iterable(itertools.repeat(r, n) for r, n in enumerate(lengths)))


def _dtype_sums(
    held: list[torch.Tensor], los: tuple[int, ...], numels: tuple[int, ...], labels: tuple[int, ...], regions: int
) -> list[int]:
    """``sampled_checksums``' sum of each region for ``held`` of one dtype, the parts of them that start
    at ``los`` and hold ``numels`` elements (``labels``: each part's region, regions one after another)."""
    dtype = held[0].dtype
    step = max(1, SAMPLE_BYTES // held[0].element_size())
    counts, first = _sample_sizes(numels, step, labels)
    # per part, the buffer its value views where it is a contiguous view of one, and where the part
    # starts in that buffer's storage (C loops, not one by one)
    bases = list(map(_base, held))
    viewing = list(map(torch.Tensor.is_contiguous, held))
    starts = tuple(map(operator.add, map(torch.Tensor.storage_offset, held), los))
    by_base: dict[int, list[slice]] = {}  # runs of parts viewing one buffer, every region's together
    alone: list[int] = []
    at = 0
    for _, run in itertools.groupby(bases, key=id):  # parts one after another viewing one buffer
        n = len(list(run))
        base = bases[at]
        if base is not None and base.dtype is dtype and all(viewing[at : at + n]):
            by_base.setdefault(id(base), []).append(slice(at, at + n))
        else:
            alone += range(at, at + n)
        at += n
    sums = [0] * regions
    for runs in by_base.values():
        # (what collgrad's reads return, a bucket's values in one buffer): one indexed read for them all
        starts_, counts_, first_, labels_ = (_picked(whole, runs) for whole in (starts, counts, first, labels))
        found = _gathered(held[runs[0].start], starts_, counts_, first_, labels_, step, regions)
        sums = list(map(operator.add, sums, found))
    if alone:
        samples = []
        for i in alone:
            value, lo, numel = held[i], los[i], numels[i]
            if value.is_contiguous():  # one call: the strided elements where they lie
                samples.append(torch.as_strided(value, (counts[i],), (step,), value.storage_offset() + lo))
            else:
                samples.append(value.reshape(-1)[lo : lo + numel : step])
        device = samples[0].device
        sample = torch.cat([s.to(device) for s in samples])
        part, within = _spread([counts[i] for i in alone], device)
        weights = _weights([first[i] for i in alone], part, within)
        found = _weighed(sample, weights, _int64([labels[i] for i in alone], device)[part], regions)
        sums = list(map(operator.add, sums, found))
    return sums


def _picked(whole: tuple[int, ...], runs: list[slice]) -> tuple[int, ...]:
    """The items of ``whole`` in ``runs``, one run after another."""
    return whole[runs[0]] if len(runs) == 1 else sum((whole[run] for run in runs), ())


_base = operator.attrgetter("_base")
_dtype = operator.attrgetter("dtype")
_name = operator.itemgetter(0)
_lo = operator.itemgetter(1)
_count = operator.itemgetter(2)


@functools.lru_cache(maxsize=8)
def _sample_sizes(
    numels: tuple[int, ...], step: int, labels: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For parts of ``numels`` elements, how many elements of each the sample takes (every ``step``-th
    from its first), and where each part's sample starts in its region's sample (``labels``: each part's
    region, regions one after another), part after part."""
    counts = tuple(-(-numel // step) for numel in numels)
    first: list[int] = []
    for _, run in itertools.groupby(zip(labels, counts), key=operator.itemgetter(0)):
        first += itertools.accumulate((count for _, count in run), initial=0)
        first.pop()  # the region's total
    return counts, tuple(first)


def _gathered(
    value: torch.Tensor,
    starts: tuple[int, ...],
    counts: tuple[int, ...],
    first: tuple[int, ...],
    labels: tuple[int, ...],
    step: int,
    regions: int,
) -> list[int]:
    """The weighed sum, per region, of the sample of parts of ``value``'s storage that start at
    ``starts``: one indexed read of the storage (where to read kept while the parts lie where they did,
    ``_gather_plan``). ``index_select``, not ``storage[where]``: the same elements, ~0.22 instead of ~0.31
    ms for the bench's 6,300 samples out of cache (advanced indexing goes through a general kernel)."""
    storage = torch.as_strided(value, (value.untyped_storage().nbytes() // value.element_size(),), (1,), 0)
    where, weights, region = _gather_plan(starts, counts, first, labels, step, value.device)
    # as signed integers of the element's size (what _weighed reads them as): index_select has no kernel
    # for uint16/32/64 (2.13)
    return _weighed(storage.view(_BITS[value.element_size()]).index_select(0, where), weights, region, regions)


@functools.lru_cache(maxsize=8)
def _gather_plan(
    starts: tuple[int, ...],
    counts: tuple[int, ...],
    first: tuple[int, ...],
    labels: tuple[int, ...],
    step: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where in one buffer the sampled elements of parts starting at ``starts`` (``counts`` of them, every
    ``step``-th) lie, the weights of their places in the sample (from ``first``), and each one's region
    (from ``labels``): worked out once while the values lie where they did (collgrad's reads lay them
    out the same way every call)."""
    part, within = _spread(list(counts), device)
    where = _int64(list(starts), device)[part].add_(within * step)
    return where, _weights(list(first), part, within), _int64(list(labels), device)[part]


def _spread(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``counts[k]`` elements of part k, part after part: each element's part, and its place in its
    part (int64 tensors; a few calls however many parts)."""
    many = _int64(counts, device)
    part = torch.repeat_interleave(torch.arange(len(counts), device=device), many)
    begins = many.cumsum(0).sub_(many)
    return part, torch.arange(part.numel(), dtype=torch.int64, device=device).sub_(begins[part])


def _weights(first: list[int], part: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """Each sampled element's weight: an odd number of its place in the sample (its part's ``first``
    place plus its place in the part, ``_spread``'s)."""
    return _int64(first, part.device)[part].add_(within).mul_(_WEIGHT).bitwise_or_(1)


def _int64(numbers: list[int], device: torch.device) -> torch.Tensor:
    """``numbers`` as an int64 tensor on ``device``: through an ``array`` (torch.tensor of a list takes
    ~0.2 us a number)."""
    found = (
        torch.frombuffer(array.array("q", numbers), dtype=torch.int64) if numbers else torch.zeros(0, dtype=torch.int64)
    )
    return found.to(device)


#: The integer type each element size is read as.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _weighed(sample: torch.Tensor, weights: torch.Tensor, region: torch.Tensor, regions: int) -> list[int]:
    """Per region, the sum (int64, wrapping) of ``sample``'s elements as integers of their own size, each
    times its weight (an odd number of its place in the sample); ``region``: each element's region."""
    words = sample.contiguous().view(_BITS[sample.element_size()]).to(torch.int64).mul_(weights)
    if regions == 1:
        return [int(words.sum())]
    return words.new_zeros(regions).index_add_(0, region, words).tolist()


def _checked(source: Source, grads: object, argument: str = "grads") -> dict[str, torch.Tensor]:
    """``grads`` (the ``argument`` of the call) as {name: tensor} in layout order, each shaped like its
    parameter (a shard for model-parallel names). Raises InvalidArgumentError / UnknownParameterError
    on this rank."""
    if not isinstance(grads, Mapping):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {argument} must be a mapping name -> tensor, got {type(grads).__name__}"
        )
    shapes: dict[str, tuple[torch.Size, int]] | None = source.scratch.get("shapes")
    order = source.layout.order
    if shapes is None:  # once per source: a torch.Size compares with a tensor's shape at C speed
        slots = (s for g in source.layout.groups for s in g.params)
        shapes = source.scratch["shapes"] = {s.name: (torch.Size(s.shape), s.numel) for s in slots}
        source.scratch["numels in order"] = [shapes[name][1] for name in order]
    if tuple(grads) == order:  # every parameter, in layout order: checked in C loops, not one by one
        given = list(grads.values())
        if all(map(isinstance, given, itertools.repeat(torch.Tensor))):
            # the parameter's number of elements is what the loop below asks for too (a value of another
            # shape is taken as it is flattened); a numel is an int, where a shape is a new torch.Size
            if list(map(torch.Tensor.numel, given)) == source.scratch["numels in order"]:
                return dict(grads)
    for name, value in grads.items():
        found = shapes.get(name)
        if found is None:
            raise UnknownParameterError(
                f"rank {_compat.rank()}: {name!r} is not a trainable parameter of this call (see params=); "
                "pass names from model.named_parameters()"
            )
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"rank {_compat.rank()}: {argument}[{name!r}] is a {type(value).__name__}")
        if value.shape != found[0] and value.numel() != found[1]:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {argument}[{name!r}] has shape {tuple(value.shape)}; the parameter "
                f"has shape {tuple(found[0])}"
            )
    return {name: grads[name] for name in order if name in grads}


def safe_set_full_model_grads(
    model: object,
    grads: Mapping[str, torch.Tensor],
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    check: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> StateRecord:
    """Make ``grads`` (name -> full gradient, any dtype and device; a subset of the trainable parameters
    allowed) the gradients the next ``engine.step()`` uses: clipping, overflow checks and the update
    see the new values. True (unscaled) values: under fp16 they are multiplied by the current loss
    scale before they are stored.

    When and where: on every rank of the data-parallel group, after the boundary ``backward()`` and
    before ``step()``, with the same names and values on every rank. Each rank writes only what it owns:
    no bulk collective, only the readiness check, in which (``check=True``) a checksum of the values is
    compared so that ranks passing different values raise together (ArgumentMismatchError) instead of
    training on a mix.
    """
    name = "safe_set_full_model_grads"
    return set_full(model, grads, params, check, policy, dispatcher, name, model_parallel=model_parallel)


def set_full(
    model: object,
    given: Mapping[str, torch.Tensor],
    params: Iterable[str | torch.Tensor] | None,
    check: bool,
    policy: Policy | None,
    dispatcher: Dispatcher | None,
    name: str,
    state: StateKind = GRAD,
    optimizer: torch.optim.Optimizer | None = None,
    model_parallel: str = LOCAL,
) -> StateRecord:
    """``given`` (name -> full value of ``state``, the same on every rank) written where this rank owns
    it, checked and agreed as ``safe_set_full_model_grads`` says; ``name``: the public function called.
    ``model_parallel="whole"``: ``given`` holds whole tensors under the unsharded model's names, of
    which each rank writes its own slice (whole.narrowed); every rank of the model agrees first, on the
    names and a checksum of a sample of the whole values as given (the same on every rank)."""
    argument = "grads" if state == GRAD else "values"
    values: dict[str, torch.Tensor] = {}
    opened: list[Source] = []

    def extra(source: Source) -> list[Field]:
        opened.append(source)
        whole = checked_mode(model_parallel)
        values.update(_checked(source, narrowed(source, given) if whole else given, argument))
        if whole:  # every rank of the model was given the same whole values: compared as given
            parts = tuple((n, 0, v.numel()) for n, v in given.items())
            total = sampled_checksum(given, parts, source.scratch) if check else -1
            return [
                Field(f"names in {argument}=", _names_print(state.key, tuple(given)), shown=False),
                Field(_CHECKSUM, total),
                Field("the next rank's values (checksum)", total, compare=False),
            ]
        mine = after = -1
        group = source.control_group
        if check and group is not None and group.size() > 1:
            # Each rank vouches for what it reads of the values (a sample of it) and checks the same of
            # the next rank's: every part any rank reads is compared by two ranks, for a fraction of
            # what reading it costs (README: what the check catches). Tensor/expert-parallel shards
            # legitimately differ between the ranks of the data-parallel group: left out.
            ranks = tuple(_compat.group_ranks(group))
            me = ranks.index(torch.distributed.get_rank())
            here, there = (
                _compared(source, values, ranks, ranks[me]),
                _compared(source, values, ranks, ranks[(me + 1) % len(ranks)]),
            )
            if there == here:
                mine = after = sampled_checksum(values, here, source.scratch)
            else:
                mine, after = sampled_checksums(values, (here, there), source.scratch)
        return [
            Field(f"names in {argument}=", _names_print(state.key, tuple(values)), shown=False),
            Field(_CHECKSUM, mine, compare=False),
            Field("the next rank's values (checksum)", after, compare=False),
        ]

    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    call = OpenCall(
        adapters.enter(model),
        name=name,
        kind=state,
        params=params,
        unscale=state.scaled,  # only gradients are stored scaled (fp16)
        policy=policy,
        dispatcher=dispatcher,
        optimizer=optimizer,
        extra=extra,
        meanwhile=lambda opened_call: _prepared(opened_call, values),
        model_parallel=model_parallel,
    )
    told = call.extras
    if check and any(told[(i + 1) % len(told)][1] != row[2] for i, row in enumerate(told)):
        # Every rank sees the same rows, so all are here: one more small exchange (on this error path
        # only) of whole checksums per tensor finds which differ, so the error can name them.
        compared = [n for n in values if n not in opened[0].model_parallel]
        raise _which_differ(opened[0], compared, values, dispatcher.timeout, name)
    return _store(call, values, call.early)


_CHECKSUM = "values in grads= (checksum)"


@functools.lru_cache(maxsize=8)
def _names_print(key: str | None, names: tuple[str, ...]) -> int:
    """What every rank compares of the names a write was given: their hash (the same names every call,
    so kept: the hash reads every name's repr)."""
    return stable_hash([key, *names])


def _compared(
    source: Source, values: Mapping[str, torch.Tensor], ranks: tuple[int, ...], rank: int
) -> tuple[tuple[str, int, int], ...]:
    """The parts of ``values`` that global rank ``rank`` of the control group ``ranks`` reads
    (``Source.reads``), less the model-parallel ones (each rank holds its own shard). Where some group
    is partitioned over other ranks than the control group's (HSDP: a shard group per replica), this
    rank cannot tell what another reads: then every value whole, on every rank."""
    partitioned = (g for g in source.layout.groups if g.kind is not Partitioning.REPLICATED and g.world > 1)
    if all(g.group_ranks == ranks for g in partitioned):
        parts = source.reads(rank)
    else:
        parts = tuple((slot.name, 0, slot.numel) for g in source.layout.groups for slot in g.params)
    if len(values) == len(source.params) and not source.model_parallel:
        return parts  # everything given: nothing to leave out
    return tuple(p for p in parts if p[0] in values and p[0] not in source.model_parallel)


def _which_differ(
    source: Source, names: list[str], values: Mapping[str, torch.Tensor], timeout_s: float, name: str
) -> ArgumentMismatchError:
    """The mismatch seen in the sampled checksums, with the names of the differing tensors, from every
    rank's whole checksum of each of ``names`` (one all-gather over the control group; every rank
    reaches the same message)."""
    group = source.control_group
    assert group is not None  # a mismatch was seen, so there is more than one rank
    sums = checksums([values[n] for n in names])
    rows = agreement.exchange(group, sums, timeout_s=timeout_s, what="the per-tensor checksum comparison")
    ranks = _compat.group_ranks(group)
    differ = []
    for k, param in enumerate(names):
        by_value = ranks_by_value(rows, k, ranks)
        if len(by_value) > 1:
            differ.append(f"{param!r} (ranks grouped by value: {sorted(by_value.values())})")
    shown = "; ".join(differ[:5]) + (f"; and {len(differ) - 5} more" if len(differ) > 5 else "")
    return ArgumentMismatchError(
        f"ranks passed different values to {name} for {len(differ)} tensor(s): {shown} "
        f"[seen by rank {_compat.rank()}]: pass the same values on every rank (compute them from values "
        "every rank holds, e.g. read by collgrad's safe_get_ functions, with the same operations)",
        (_CHECKSUM,),
    )


def _prepared(call: OpenCall, values: Mapping[str, torch.Tensor]) -> Copies | None:
    """The copies of ``values`` into this rank's buffers, made ready (views only, nothing written) while
    the ranks agree; None where the source writes otherwise (DeepSpeed's own setters)."""
    if call.source.accessor_set is not None:
        return None
    with torch.no_grad():
        return call.source.prepare_write(call.local, values, call.local.loss_scale)


def _store(call: OpenCall, values: Mapping[str, torch.Tensor], copies: Copies | None = None) -> StateRecord:
    call.models.wrote(call.model.target)  # what the drop-in read before is stale from now on
    source = call.source
    if source.accessor_set is not None:  # an optimizer collgrad does not know: DeepSpeed's setter
        for name, value in values.items():  # (local: each rank writes its own fragment or partition)
            source.accessor_set(source.params[name], value.to(torch.float32))
        source.after_write(values)
    else:
        with torch.no_grad():
            source.write(call.local, values, call.local.loss_scale, copies)
    return StateRecord(source.layout.variant, (), 0, call.local.loss_scale, False, call.cached, call.layout_cached)


def write_here(model: object, state: StateKind, values: Mapping[str, torch.Tensor], *, dispatcher: Dispatcher) -> bool:
    """``values`` (name -> full value of ``state``, as held: a gradient scaled as the optimizer holds it)
    written where this rank owns them, now, with no collective and no check between ranks: what
    DeepSpeed's own setters do, for the drop-in that serves them. False, writing nothing, where collgrad
    knows no layout for the model; NotReadyError (this rank) where there is nothing to write into."""
    source, _ = source_of(model, state, dispatcher=dispatcher)
    if source.accessor_set is not None:
        return False
    local = source.read()
    if local.problem is not Problem.OK:
        raise NotReadyError(f"rank {_compat.rank()}: {local.problem.describe()}")
    with torch.no_grad():
        source.write(local, values, 1.0)
    return True


def safe_update_full_model_grads(
    model: object,
    fn: Callable[[str, torch.Tensor], torch.Tensor | None],
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
) -> StateRecord:
    """Stream every full gradient through ``fn(name, grad)`` and write the results back: ``fn`` returns a
    new tensor, or None after editing ``grad`` in place. Bucket by bucket, as ``iter_full_model_grads``
    reads, so about two buckets of extra memory whatever the model size. Gradients are true values
    (unscaled under fp16); what ``fn`` returns is stored as ``safe_set_full_model_grads`` stores it.

    When and where: as ``safe_set_full_model_grads``; ``fn`` must compute the same result on every rank
    (it sees the same input everywhere). Returns what was done (the reads' collectives).
    """
    if not callable(fn):
        raise InvalidArgumentError(f"rank {_compat.rank()}: fn must be callable, got {type(fn).__name__}")
    call = OpenCall(
        adapters.enter(model),
        name="safe_update_full_model_grads",
        streaming=True,
        params=params,
        bucket_bytes=bucket_bytes,
        unscale=True,
        policy=policy,
        dispatcher=dispatcher,
    )
    executor = Executor(call)
    for results in executor.steps():
        edited, grad, out = {}, None, None
        for name, grad in results:
            out = fn(name, grad)
            edited[name] = grad if out is None else out
        _store(call, edited)
        # Keep nothing of this bucket (not even the loop variables) while the next one is made.
        del results, edited, grad, out
    return executor.record()
