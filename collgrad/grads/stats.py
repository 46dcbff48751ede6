"""Per-parameter gradient statistics without materializing any full gradient.

Each rank reduces the elements it owns (its fragments, where they lie: no copy, no move off an
offload device) to three numbers per parameter; one small all-gather per gradient group brings every
rank's partials to every rank, and every rank combines them in the same fixed order, so every rank
holds the same numbers::

    rank r, group g    fragments of p0 p1 p2 ...  ->  [ sum of squares | max |g| | non-finite ] x P
    all_gather         world x 3 x P float64 (24 bytes per parameter per rank)
    combine            sum over ranks (rank order), max over ranks, sum over ranks -> GradStat per p

Groups whose ranks already hold full gradients (BF16_Optimizer, stage 0, single-rank groups) send
nothing. fp16 statistics are of the unscaled gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch

from collgrad import _compat
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher
from collgrad.core.ops import Op
from collgrad.core.record import CallRecord
from collgrad.errors import InvalidArgumentError
from collgrad.grads.call import OpenCall
from collgrad.grads.plan import PlanKind
from collgrad.grads.record import FullGradRecord, GroupRecord
from collgrad.grads.sources.layout import GradGroup, Kind, owned_fragments

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

    call = OpenCall(
        model, params, None, "auto", unscale, policy, dispatcher, streaming=False, name="model_grad_stats", extra=extra
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
        for position, group in enumerate(layout.groups):
            partials = _partials(call, group, call.local.buffers[position])
            calls: list[CallRecord] = []
            if group.kind is not Kind.REPLICATED and group.world > 1:
                partials = _gather(call, position, group, partials, calls)
            kind = PlanKind.ALL_GATHER if calls else PlanKind.LOCAL
            records.append(
                GroupRecord(group.index, group.kind, kind, group.group_ranks, len(group.params), tuple(calls))
            )
            sumsq, max_abs, nonfinite = partials
            norms = (sumsq.sqrt() / scale).tolist()
            peaks = (max_abs / scale).tolist()
            for slot, norm, peak, count in zip(group.params, norms, peaks, nonfinite.long().tolist()):
                per_param[slot.name] = GradStat(norm, peak, count, slot.numel)
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


def _views(call: OpenCall, group: GradGroup, buffer: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's owned pieces of each parameter of ``group``, as views where they lie, and the index
    of the parameter of each (the fragments are pure layout: cached with the source)."""
    if group.kind is Kind.REPLICATED:
        return torch.arange(len(group.params)), [buffer[k].reshape(-1) for k in range(len(group.params))]
    rank = group.group_ranks.index(torch.distributed.get_rank()) if group.world > 1 else 0
    key = ("owned fragments", group.index, rank)
    found = call.source.plans.get(key)
    if found is None:
        frags = owned_fragments(group, rank)
        found = call.source.plans[key] = (torch.tensor([f.param for f in frags], dtype=torch.int64), frags)
    index, frags = found
    return index, [buffer.range(f.local_offset, f.numel) for f in frags]


def _partials(call: OpenCall, group: GradGroup, buffer: Any) -> torch.Tensor:
    """[3, P] float64 on the CPU: sum of squares, max |g| and non-finite count over this rank's
    elements of each parameter."""
    out = torch.zeros(3, len(group.params), dtype=torch.float64)
    index, views = _views(call, group, buffer)
    if not views:
        return out
    with torch.no_grad():
        norms = torch.stack(_compat.vector_norms(views)).double().cpu()
        lows, highs = zip(*(torch.aminmax(v) for v in views))  # one pass each: faster than abs().amax()
        peaks = torch.maximum(-torch.stack(lows), torch.stack(highs)).double().cpu()
        out[0].index_add_(0, index, norms.square())
        out[1].scatter_reduce_(0, index, peaks, reduce="amax")
        finite = torch.isfinite(norms) & torch.isfinite(peaks)
        if not bool(finite.all()):  # count only where something is not finite (an overflowing norm too)
            counts = torch.zeros(len(views), dtype=torch.float64)
            for i in (~finite).nonzero().flatten().tolist():
                counts[i] = float((~torch.isfinite(views[i])).sum())
            out[2].index_add_(0, index, counts)
            nan = torch.isnan(peaks)  # scatter_reduce's amax skips NaN; torch.max gives NaN, so do we
            if bool(nan.any()):
                out[1].index_fill_(0, index[nan], math.nan)
    return out


def _gather(
    call: OpenCall, position: int, group: GradGroup, partials: torch.Tensor, calls: list[CallRecord]
) -> torch.Tensor:
    """Every rank's partials, combined in rank order: the same result on every rank."""
    pg = call.source.groups.get(group.index)
    device = _compat.agreement_device(call.source.device.type)
    mine = partials.reshape(-1).to(device)
    gathered = torch.empty(group.world * mine.numel(), dtype=mine.dtype, device=device)
    calls.append(call.run(("stats", position), Op.ALL_GATHER, [mine], [gathered], pg))
    rows = gathered.cpu().view(group.world, 3, len(group.params))
    sumsq = rows[0, 0].clone()
    for r in range(1, group.world):  # a fixed order: every rank adds the same numbers the same way
        sumsq += rows[r, 0]
    return torch.stack([sumsq, rows[:, 1].amax(0), rows[:, 2].sum(0)])  # amax propagates NaN


def _full_stat(grad: torch.Tensor, scale: float) -> GradStat:
    g = grad.detach().reshape(-1)
    if g.numel() == 0:
        return GradStat(0.0, 0.0, 0, 0)
    norm = float(torch.linalg.vector_norm(g.double()))
    peak = float(g.abs().max())
    return GradStat(norm / scale, peak / scale, int((~torch.isfinite(g)).sum()), g.numel())
