"""Per-parameter gradient statistics without materializing any full gradient.

Each rank reduces the elements it owns (its fragments, where they lie: no copy, no move off an
offload device) to three numbers per parameter; one small all-gather per gradient group brings every
rank's partials to every rank, and every rank combines them in the same fixed order, so every rank
holds the same numbers::

    rank r, group g    fragments of p0 p1 p2 ...  ->  [ sum of squares | max |g| | non-finite ] x P
    all_gather         world x (3 x P + 1) float64 (24 bytes per parameter per rank, and a flag)
    combine            sum over ranks (rank order), max over ranks, sum over ranks -> GradStat per p

The reductions run while the readiness check is in flight; a rank whose reductions raise sets the
flag, and every rank raises (RankFailedError; that rank its own error) instead of waiting for it.

Groups whose ranks already hold full gradients (BF16_Optimizer, stage 0, single-rank groups) send
nothing. fp16 statistics are of the unscaled gradient.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch

from collgrad import _compat
from collgrad.backends.policy import Policy
from collgrad.core.buffers import Pieces
from collgrad.core.dispatch import Dispatcher
from collgrad.backends.ops import Op
from collgrad.core.record import CallRecord
from collgrad.errors import InvalidArgumentError, RankFailedError
from collgrad.grads.call import OpenCall
from collgrad.grads.plan import PlanKind
from collgrad.grads.record import FullGradRecord, GroupRecord
from collgrad.grads.sources import rank_in
from collgrad.grads.sources.layout import Fragment, GradGroup, Kind, owned_fragments, strided_runs

__all__ = ["GradStat", "GradStats", "model_grad_stats", "module_of"]


class GradStat(NamedTuple):
    """Statistics of one gradient (or of a group of them): L2 norm, max |g|, count of non-finite
    elements (NaN or +-Inf), element count. ``norm`` and ``max_abs`` are NaN if any element is NaN.
    (A named tuple: a call builds one per parameter, at a third of a frozen dataclass's cost.)"""

    norm: float
    max_abs: float
    nonfinite: int
    numel: int

    @staticmethod
    def combine(stats: Iterable[GradStat]) -> GradStat:
        stats = list(stats)
        return GradStat(
            math.sqrt(math.fsum(s.norm * s.norm for s in stats)),
            max((s.max_abs for s in stats), default=0.0, key=lambda v: math.inf if math.isnan(v) else v),
            sum(s.nonfinite for s in stats),
            sum(s.numel for s in stats),
        )


@dataclass(frozen=True)
class GradStats:
    """What ``model_grad_stats`` returns: identical on every rank."""

    global_norm: float
    params: Mapping[str, GradStat]
    groups: Mapping[str, GradStat]
    #: Names of tensor- or expert-parallel shards: their statistics are of this rank's shard.
    model_parallel: frozenset[str]
    record: FullGradRecord


def module_of(name: str) -> str:
    """The module path of a parameter name: ``layers.3.attn.q.weight`` -> ``layers.3.attn.q``; a
    parameter of the root module -> ``""`` (the root's name in ``named_modules()``)."""
    return name.rpartition(".")[0]


def model_grad_stats(
    model: Any,
    *,
    params: Iterable[Any] | None = None,
    by: str | Callable[[str], str] = "param",
    unscale: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
) -> GradStats:
    """Per-parameter L2 norm, max |g|, non-finite count and element count of the full gradients of
    ``model`` (as ``safe_get_full_model_grads`` would return them), and the global L2 norm, computed
    from each rank's owned elements in one small all-gather per gradient group: no full gradient is
    built. ``by``: ``"param"`` (``groups`` holds one entry per parameter), ``"module"`` (grouped by
    module path, e.g. ``layers.3.attn``) or a function name -> group name.

    When and where: as ``safe_get_full_model_grads``: on every rank of the data-parallel group, after
    the boundary ``backward()`` and before ``step()``, with the same arguments; otherwise every rank
    raises the same error before anything moves. Every rank gets the same numbers.
    """
    if by == "param":
        group_of: Callable[[str], str] = str
    elif by == "module":
        group_of = module_of
    elif callable(by):
        group_of = by
    else:
        group_of = None  # type: ignore[assignment]

    def extra(_source: Any) -> list:
        if group_of is None:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: by must be 'param', 'module' or a function name -> group, got {by!r}"
            )
        return []

    def local_partials(call: OpenCall) -> list[torch.Tensor] | Exception | None:
        # This rank's reductions (most of a call's time) overlap the readiness check's round trip, so
        # they end after the ranks agreed to go on: a failure here is told in the statistics' own
        # gather (a flag), and every rank raises, instead of the others waiting for this one.
        if call.source.per_param is not None:
            return None
        try:
            return [_partials(call, g, call.local.buffers[i]) for i, g in enumerate(call.source.layout.groups)]
        except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the others
            return exc

    call = OpenCall(
        model,
        params,
        None,
        "auto",
        unscale,
        policy,
        dispatcher,
        streaming=False,
        name="model_grad_stats",
        extra=extra,
        meanwhile=local_partials,
    )
    layout = call.source.layout
    scale = call.local.loss_scale if call.unscale else 1.0
    per_param: dict[str, GradStat] = {}
    records: list[GroupRecord] = []
    per_param_collectives = 0
    if call.source.per_param is not None:  # no known layout: DeepSpeed's accessor, one call per parameter
        for name in layout.order:
            grad = call.source.per_param(call.source.params[name])
            per_param_collectives += 1
            per_param[name] = _full_stat(grad, scale)
    else:
        failure = call.early if isinstance(call.early, Exception) else None
        failed: set[int] = set()  # ranks whose reductions raised, as told in the gathers
        for position, group in enumerate(layout.groups):
            partials = torch.zeros(3, len(group.params), dtype=torch.float64) if failure else call.early[position]
            calls: list[CallRecord] = []
            if group.kind is not Kind.REPLICATED and group.world > 1:
                partials, told = _gather(call, position, group, partials, calls, failure is not None)
                failed.update(told)
            kind = PlanKind.ALL_GATHER if calls else PlanKind.LOCAL
            records.append(
                GroupRecord(group.index, group.kind, kind, group.group_ranks, len(group.params), tuple(calls))
            )
            sumsq, max_abs, nonfinite = partials
            norms = (sumsq.sqrt() / scale).tolist()
            peaks = (max_abs / scale).tolist()
            for slot, norm, peak, count in zip(group.params, norms, peaks, nonfinite.long().tolist()):
                per_param[slot.name] = GradStat(norm, peak, count, slot.numel)
        if failure is not None:
            raise failure
        if failed:
            raise RankFailedError(
                f"rank(s) {sorted(failed)} failed reducing their gradients (their own errors say why); "
                f"model_grad_stats returns nothing [seen by rank {_compat.rank()}]"
            )
    ordered = {name: per_param[name] for name in layout.order if name in per_param}
    if by == "param":
        groups: dict[str, GradStat] = dict(ordered)
    else:
        grouped: dict[str, list[GradStat]] = {}
        for name, stat in ordered.items():
            grouped.setdefault(group_of(name), []).append(stat)
        groups = {g: s[0] if len(s) == 1 else GradStat.combine(s) for g, s in grouped.items()}
    record = FullGradRecord(
        layout.variant,
        tuple(records),
        per_param_collectives,
        call.local.loss_scale,
        call.unscale,
        call.cached,
        call.layout_cached,
    )
    return GradStats(
        global_norm=math.sqrt(math.fsum(s.norm * s.norm for s in ordered.values())),
        params=ordered,
        groups=groups,
        model_parallel=call.source.model_parallel,
        record=record,
    )


#: Bytes reduced at a time on a CPU. Norm, min and max each read the gradient; going block by block,
#: the second and third reads come from the core's own cache instead of memory (L2 is 1-2 MiB per core
#: on current x86 servers; measured here at 3.3M fp32 elements: 1.9 -> 1.4 ms warm, 3.8 -> 2.8 ms after
#: other work evicted the gradients). Accelerators reduce whole runs: a block is a kernel launch there.
CPU_BLOCK_BYTES = 1 << 20


class _Rows(NamedTuple):
    """``count`` rows of ``numel`` elements, ``stride`` apart from ``offset`` in the span: one strided 2-D
    view, reduced along its rows in one call per statistic."""

    offset: int
    count: int
    numel: int
    stride: int


#: Spans (offset in the span, numel) reduced one by one (a norm for all in one call).
_Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Arranged:
    """This rank's fragments of a group arranged for reduction, for one placement of its pieces:
    ``blocks`` of the pieces' storage span (rows of repeated blocks, or spans), each a few calls;
    ``loose`` fragments straddle two pieces and are read by range; ``index``: the parameter of each
    result, in reduction order (a parameter cut in spans has several: their partials add up)."""

    placement: tuple[int, ...]
    blocks: tuple[_Rows | _Spans, ...]
    #: results per block, then one per loose fragment
    sizes: tuple[int, ...]
    loose: tuple[Fragment, ...]
    index: torch.Tensor


def _arranged(call: OpenCall, group: GradGroup, buffer: Pieces, placement: tuple[int, ...]) -> _Arranged:
    """The arrangement for ``placement`` (the offset of each piece in its storage span), from the cache
    while the pieces stay where they are (DeepSpeed keeps its buffers: the usual case)."""
    rank = rank_in(group)
    key = ("stats arrangement", group.index, rank)
    found = call.source.plans.get(key)
    if found is not None and found.placement == placement:
        return found
    placed, loose = [], []  # fragments within one piece, at their offset in the span; the others
    for f in _fragments(group, buffer):
        at = buffer.span_offset(f.local_offset, f.numel)
        if at is None:
            loose.append(f)
        else:
            placed.append(Fragment(f.param, f.param_offset, at, f.numel))
    blocks, sizes, owners = _blocks(tuple(placed), _block_elements(buffer))
    found = call.source.plans[key] = _Arranged(
        placement,
        tuple(blocks),
        tuple(sizes) + (1,) * len(loose),
        tuple(loose),
        torch.tensor(owners + [f.param for f in loose], dtype=torch.int64),
    )
    return found


def _fragments(group: GradGroup, buffer: Pieces) -> tuple[Fragment, ...]:
    """This rank's fragments of ``group`` in ``buffer``: its owned ones, or every gradient whole (one
    piece each) where the group is replicated."""
    if group.kind is Kind.REPLICATED:
        return tuple(Fragment(k, 0, start, p.numel()) for k, (start, p) in enumerate(zip(buffer.starts, buffer.pieces)))
    return owned_fragments(group, rank_in(group))


def _block_elements(buffer: Pieces) -> int:
    """``CPU_BLOCK_BYTES`` in elements of ``buffer`` on a CPU; 0 (unlimited) elsewhere."""
    return CPU_BLOCK_BYTES // buffer.pieces[0].element_size() if buffer.device.type == "cpu" else 0


def _blocks(placed: tuple[Fragment, ...], block: int) -> tuple[list, list[int], list[int]]:
    """Pure: ``placed`` fragments as blocks of at most ``block`` elements (0: unlimited): runs of
    equal fragments as rows, as many rows a block as fit; the other fragments, and rows larger than a
    block, as spans cut to ``block``. Returns the blocks, each one's number of results, and the
    parameter of each result."""
    blocks: list[_Rows | _Spans] = []
    sizes: list[int] = []
    owners: list[int] = []
    spans: list[tuple[int, int, int]] = []  # (offset, numel, parameter), reduced one by one
    placed = tuple(f for f in placed if f.numel)  # an empty parameter's partials stay zero
    for run in strided_runs(placed):
        if run.count > 1 and (block == 0 or run.numel <= block):
            per = run.count if block == 0 else max(1, block // run.numel)
            for i in range(0, run.count, per):
                rows = run.frags[i : i + per]
                blocks.append(_Rows(run.local_offset + i * run.stride, len(rows), run.numel, run.stride))
                sizes.append(len(rows))
                owners += [placed[k].param for k in rows]
            continue
        for i, k in enumerate(run.frags):
            offset, left = run.local_offset + i * run.stride, run.numel
            cut = left if block == 0 else block
            while True:
                spans.append((offset, min(cut, left), placed[k].param))
                offset, left = offset + cut, left - cut
                if left <= 0:
                    break
    group: list[tuple[int, int]] = []
    filled = 0
    for offset, numel, param in spans:  # the spans in blocks of about ``block`` elements
        if group and block and filled + numel > block:
            blocks.append(tuple(group))
            sizes.append(len(group))
            group, filled = [], 0
        group.append((offset, numel))
        filled += numel
        owners.append(param)
    if group:
        blocks.append(tuple(group))
        sizes.append(len(group))
    return blocks, sizes, owners


_Reduced = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[int], torch.Tensor]]


def _reduce(call: OpenCall, group: GradGroup, buffer: Any) -> _Reduced:
    """Per result (a fragment, or a span of one): the parameter it belongs to, its L2 norm (accumulated
    in fp32 at least), its min and its max; and the i-th result's view (for the rare count of
    non-finite elements)."""
    if group.kind is Kind.REPLICATED:  # full gradients, often views of one flat buffer (BF16_Optimizer)
        buffer = Pieces([buffer[k] for k in range(len(group.params))])
        if buffer.placement() is None:
            views = buffer.pieces
            return (torch.arange(len(views)), *_one_by_one(views), views.__getitem__)
    placed = buffer.placement()
    if placed is None:  # pieces in different storages: views of each fragment where it lies, in blocks
        block = _block_elements(buffer)
        views, owners = [], []
        for f in _fragments(group, buffer):
            view = buffer.range(f.local_offset, f.numel)
            parts = view.split(block) if block and f.numel > block else (view,)
            views += parts
            owners += [f.param] * len(parts)
        index = torch.tensor(owners, dtype=torch.int64)
        return (index, *_one_by_one(views), views.__getitem__)
    span, placement = placed
    arranged = _arranged(call, group, buffer, placement)
    base = span.storage_offset()
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    views: list[torch.Tensor | list[torch.Tensor]] = []  # per block: its rows (2-D) or its spans
    for block in arranged.blocks:
        if isinstance(block, _Rows):
            rows = span.as_strided((block.count, block.numel), (block.stride, 1), base + block.offset)
            norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.promote_types(rows.dtype, torch.float32))
            # amin and amax along rows beat aminmax(dim=1) on CPU by 5x (torch 2.13)
            parts.append((norms, rows.amin(1), rows.amax(1)))
            views.append(rows)
        else:
            flat = [span[offset : offset + numel] for offset, numel in block]
            parts.append(_one_by_one(flat))
            views.append(flat)
    loose = [buffer.range(f.local_offset, f.numel) for f in arranged.loose]
    if loose:
        parts.append(_one_by_one(loose))
        views += [[v] for v in loose]
    starts = [0]
    for size in arranged.sizes:
        starts.append(starts[-1] + size)

    def view_at(i: int) -> torch.Tensor:
        b = bisect.bisect_right(starts, i) - 1
        return views[b][i - starts[b]]

    norms, lows, highs = (torch.cat(p) for p in zip(*parts)) if parts else _one_by_one([])
    return arranged.index, norms, lows, highs, view_at


def _one_by_one(views: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norms (one foreach call), mins and maxes (aminmax: one pass each) of ``views``."""
    if not views:
        empty = torch.empty(0)
        return empty, empty, empty
    lows, highs = zip(*(torch.aminmax(v) for v in views))
    return torch.stack(_compat.vector_norms(views)), torch.stack(lows), torch.stack(highs)


def _partials(call: OpenCall, group: GradGroup, buffer: Any) -> torch.Tensor:
    """[3, P] float64 on the CPU: sum of squares, max |g| and non-finite count over this rank's
    elements of each parameter."""
    out = torch.zeros(3, len(group.params), dtype=torch.float64)
    with torch.no_grad():
        index, norms, lows, highs, view_at = _reduce(call, group, buffer)
        if len(index) == 0:
            return out
        norms = norms.double().cpu()
        peaks = torch.maximum(-lows, highs).double().cpu()
        out[0].index_add_(0, index, norms.square())
        out[1].scatter_reduce_(0, index, peaks, reduce="amax")
        finite = torch.isfinite(norms) & torch.isfinite(peaks)
        if not bool(finite.all()):  # count only where something is not finite (an overflowing norm too)
            counts = torch.zeros(len(index), dtype=torch.float64)
            for i in (~finite).nonzero().flatten().tolist():
                counts[i] = float((~torch.isfinite(view_at(i))).sum())
            out[2].index_add_(0, index, counts)
            nan = torch.isnan(peaks)  # scatter_reduce's amax skips NaN; torch.max gives NaN, so do we
            if bool(nan.any()):
                out[1].index_fill_(0, index[nan], math.nan)
    return out


def _gather(
    call: OpenCall, position: int, group: GradGroup, partials: torch.Tensor, calls: list[CallRecord], failed: bool
) -> tuple[torch.Tensor, list[int]]:
    """Every rank's partials, combined in rank order: the same result on every rank; and the ranks
    that said (``failed``, one more number each) that they have none."""
    pg = call.source.groups.get(group.index)
    device = _compat.agreement_device(call.source.device.type)
    mine = torch.cat([partials.reshape(-1), torch.tensor([float(failed)], dtype=partials.dtype)]).to(device)
    gathered = torch.empty(group.world * mine.numel(), dtype=mine.dtype, device=device)
    calls.append(call.run(("stats", position), Op.ALL_GATHER, [mine], [gathered], pg))
    every = gathered.cpu().view(group.world, -1)
    told = [group.group_ranks[r] for r in every[:, -1].nonzero().flatten().tolist()]
    rows = every[:, :-1].view(group.world, 3, len(group.params))
    sumsq = rows[0, 0].clone()
    for r in range(1, group.world):  # a fixed order: every rank adds the same numbers the same way
        sumsq += rows[r, 0]
    return torch.stack([sumsq, rows[:, 1].amax(0), rows[:, 2].sum(0)]), told  # amax propagates NaN


def _full_stat(grad: torch.Tensor, scale: float) -> GradStat:
    g = grad.detach().reshape(-1)
    if g.numel() == 0:
        return GradStat(0.0, 0.0, 0, 0)
    norm = float(torch.linalg.vector_norm(g.double()))
    peak = float(g.abs().max())
    return GradStat(norm / scale, peak / scale, int((~torch.isfinite(g)).sum()), g.numel())
