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

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple

import torch

from collgrad import _compat
from collgrad.backends.agreement import Field
from collgrad.backends.ops import Op
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher
from collgrad.core.record import CallRecord
from collgrad.errors import InvalidArgumentError, RankFailedError
from collgrad.state import adapters, stat_reduce
from collgrad.state.adapters.base import Source
from collgrad.state.call import OpenCall
from collgrad.state.execute import accessor_bytes
from collgrad.state.layout import LayoutGroup, Partitioning
from collgrad.state.plan import PlanKind
from collgrad.state.record import GroupRecord, StateRecord
from collgrad.state.whole import LOCAL, whole_order, whole_stat_rows

__all__ = ["GradStat", "GradStats", "safe_get_full_model_grad_stats", "module_of"]


class GradStat(NamedTuple):
    """Statistics of one gradient (or of a group of them): L2 norm, max |g|, count of non-finite
    elements (NaN or +-Inf), element count. ``norm`` and ``max_abs`` are NaN if any element is NaN.
    (A named tuple: a call builds one per parameter, cheaper than a frozen dataclass.)"""

    norm: float
    max_abs: float
    nonfinite: int
    numel: int

    @staticmethod
    def combine(stats: Iterable[GradStat]) -> GradStat:
        every = list(stats)
        return GradStat(
            math.sqrt(math.fsum(s.norm * s.norm for s in every)),
            max((s.max_abs for s in every), default=0.0, key=lambda v: math.inf if math.isnan(v) else v),
            sum(s.nonfinite for s in every),
            sum(s.numel for s in every),
        )


@dataclass(frozen=True)
class GradStats:
    """What ``safe_get_full_model_grad_stats`` returns: identical on every rank."""

    global_norm: float
    params: Mapping[str, GradStat]
    groups: Mapping[str, GradStat]
    #: Names of tensor- or expert-parallel shards: their statistics are of this rank's shard.
    model_parallel: frozenset[str]
    record: StateRecord


def module_of(name: str) -> str:
    """The module path of a parameter name: ``layers.3.attn.q.weight`` -> ``layers.3.attn.q``; a
    parameter of the root module -> ``""`` (the root's name in ``named_modules()``)."""
    return name.rpartition(".")[0]


def safe_get_full_model_grad_stats(
    model: object,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    by: str | Callable[[str], str] = "param",
    unscale: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
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
    group_of = _group_of(by)

    def extra(_source: Source) -> list[Field]:
        if group_of is None:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: by must be 'param', 'module' or a function name -> group, got {by!r}"
            )
        return []

    name = "safe_get_full_model_grad_stats"
    call = OpenCall(
        adapters.enter(model),
        name=name,
        params=params,
        unscale=unscale,
        policy=policy,
        dispatcher=dispatcher,
        extra=extra,
        meanwhile=_local_partials,
        model_parallel=model_parallel,
    )
    assert group_of is not None  # else extra() raised
    layout = call.source.layout
    scale = call.local.loss_scale if call.unscale else 1.0
    records: tuple[GroupRecord, ...] = ()
    per_param_collectives = per_param_sent = 0
    if call.source.accessor is not None:  # no known layout: DeepSpeed's accessor, one call per parameter
        by_param = {name: _full_stat(call.source.accessor(call.source.params[name]), scale) for name in layout.order}
        per_param_collectives = len(layout.order)
        group = layout.groups[0]
        per_param_sent = sum(accessor_bytes(call.source, group, slot.numel) for slot in group.params)
    else:
        by_param, records = _combined(call, scale)
    order: Iterable[str] = layout.order
    whole_calls: list[CallRecord] = []
    if call.whole:  # shards' partials combined over their tensor-parallel group, experts by global name
        named = [n for n in layout.order if n in by_param]
        rows = torch.tensor(
            [[s.norm * s.norm, s.max_abs, s.nonfinite, s.numel] for s in map(by_param.__getitem__, named)]
        )
        combined = whole_stat_rows(call.source, named, rows.double(), call.run, whole_calls)
        by_param = {n: GradStat(math.sqrt(r[0]), float(r[1]), int(r[2]), int(r[3])) for n, r in combined.items()}
        order = whole_order(call.source, layout.order)
    ordered = {name: by_param[name] for name in order if name in by_param}
    record = StateRecord(
        layout.variant,
        records,
        per_param_collectives,
        call.local.loss_scale,
        call.unscale,
        call.cached,
        call.layout_cached,
        per_param_sent,
        tuple(whole_calls),
    )
    return GradStats(
        global_norm=math.sqrt(math.fsum(s.norm * s.norm for s in ordered.values())),
        params=ordered,
        groups=dict(ordered) if by == "param" else _grouped(ordered, group_of),
        model_parallel=frozenset() if call.whole else call.source.model_parallel,
        record=record,
    )


def _local_partials(call: OpenCall) -> list[torch.Tensor] | Exception | None:
    """This rank's partials of every group (None where the accessor reads), or what raised."""
    # This rank's reductions (most of a call's time) overlap the readiness check's round trip, so
    # they end after the ranks agreed to go on: a failure here is told in the statistics' own
    # gather (a flag), and every rank raises, instead of the others waiting for this one.
    if call.source.accessor is not None:
        return None
    try:
        return [
            stat_reduce.partials(call.source.plans, g, call.local.buffers[i])
            for i, g in enumerate(call.source.layout.groups)
        ]
    except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the others
        return exc


def _group_of(by: str | Callable[[str], str]) -> Callable[[str], str] | None:
    """The function name -> group name ``by`` asks for; None where ``by`` is invalid."""
    if by == "param":
        return str
    if by == "module":
        return module_of
    return by if callable(by) else None


def _grouped(stats: Mapping[str, GradStat], group_of: Callable[[str], str]) -> dict[str, GradStat]:
    """``stats`` combined by group name, in the order each group first appears."""
    grouped: dict[str, list[GradStat]] = {}
    for name, stat in stats.items():
        grouped.setdefault(group_of(name), []).append(stat)
    return {g: s[0] if len(s) == 1 else GradStat.combine(s) for g, s in grouped.items()}


def _combined(call: OpenCall, scale: float) -> tuple[dict[str, GradStat], tuple[GroupRecord, ...]]:
    """Every rank's partials of every group, combined (one small gather per group whose ranks hold
    parts); raises on every rank if any rank's reductions failed."""
    failure = call.early if isinstance(call.early, Exception) else None
    failed: set[int] = set()  # ranks whose reductions raised, as told in the gathers
    by_param: dict[str, GradStat] = {}
    records = []
    for position, group in enumerate(call.source.layout.groups):
        mine = torch.zeros(3, len(group.params), dtype=torch.float64) if failure else call.early[position]
        calls: list[CallRecord] = []
        if group.kind is not Partitioning.REPLICATED and group.world > 1:
            mine, told = _gather(call, position, group, mine, calls, failure is not None)
            failed.update(told)
        kind = PlanKind.ALL_GATHER if calls else PlanKind.LOCAL
        records.append(GroupRecord(group.index, group.kind, kind, group.group_ranks, len(group.params), tuple(calls)))
        sumsq, max_abs, nonfinite = mine
        norms = (sumsq.sqrt() / scale).tolist()
        peaks = (max_abs / scale).tolist()
        for slot, norm, peak, count in zip(group.params, norms, peaks, nonfinite.long().tolist()):
            by_param[slot.name] = GradStat(norm, peak, count, slot.numel)
    if failure is not None:
        raise failure
    if failed:
        raise RankFailedError(
            f"rank(s) {sorted(failed)} failed reducing their gradients (their own errors say why); "
            f"safe_get_full_model_grad_stats returns nothing [seen by rank {_compat.rank()}]"
        )
    return by_param, tuple(records)


def _gather(
    call: OpenCall, position: int, group: LayoutGroup, mine: torch.Tensor, calls: list[CallRecord], failed: bool
) -> tuple[torch.Tensor, list[int]]:
    """Every rank's partials, combined in rank order: the same result on every rank; and the ranks
    that said (``failed``, one more number each) that they have none."""
    pg = call.source.groups.get(group.index)
    device = _compat.agreement_device(call.source.device.type)
    row = torch.cat([mine.reshape(-1), torch.tensor([float(failed)], dtype=mine.dtype)]).to(device)
    gathered = torch.empty(group.world * row.numel(), dtype=row.dtype, device=device)
    calls.append(call.run(("stats", position), Op.ALL_GATHER, [row], [gathered], pg))
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
