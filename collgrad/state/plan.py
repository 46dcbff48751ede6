"""The gradient plan: for each gradient group of a layout, how its full gradients are made and in which
steps. Pure: built from the layout, the call's arguments and what the agreed capabilities allow,
without a process group, so every rank builds the same plan and tests need no ranks.

Plan kinds, per gradient group (groups: see sources/layout.py)::

  local       nothing to communicate: every rank holds the full reduced gradients (BF16_Optimizer,
              no ZeRO), or the group has a single rank (expert-parallel experts, AutoTP shards).
  all_gather  ranks own equal contiguous partitions (ZeRO-1/2 flat groups, ZeRO-3 / FSDP2 sliced
              parameters): every rank contributes its partition as it lies and gathers the rest.
              Half the bytes of an all-reduce, and no zero fill.
  all_reduce  zero-padded: every rank writes the elements it owns into a zeroed buffer and the group
              sums it. Adding zeros is exact, so the result is bitwise what DeepSpeed's
              ``safe_get_full_grad`` returns (it does the same, one parameter at a time).
  accessor    DeepSpeed's own accessor, one collective per parameter: optimizers whose layout
              collgrad does not know.

Steps ("batches") are runs of whole parameters, in layout order::

  group params   a b c d e f g           budget: bucket_bytes of results (or gathered slices)
  batches        [a b c] [d] [e f g]     d alone: larger than the budget by itself
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Union

import torch

from collgrad._compat import uncollected
from collgrad.backends.ops import ValueEnum
from collgrad.state.layout import LayoutGroup, Partitioning, StateLayout
from collgrad.state.steps import ReduceStep, SlicesStep, reduce_step, slices_step

__all__ = [
    "PLANS",
    "GATHER_MIN_SHARE",
    "PlanKind",
    "GradCall",
    "Route",
    "StepLayout",
    "step_layouts",
    "GroupPlan",
    "GradPlan",
    "needs_capabilities",
    "choose_kind",
    "batch_params",
    "plan_grads",
]

#: What a caller may ask for with ``plan=``.
PLANS = ("auto", "all_gather", "all_reduce")

#: ``auto`` all-gathers a ZeRO-1/2 flat group only if the call reads at least this share of it: a
#: gather moves every rank's whole partition, an all-reduce only the parameters asked for (twice, as
#: a ring all-reduce sends about twice the bytes of a gather), so below half a gather moves more.
GATHER_MIN_SHARE = 0.5


class PlanKind(ValueEnum):
    LOCAL = "local"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"
    ACCESSOR = "accessor"


@dataclass(frozen=True)
class GradCall:
    """The arguments of one call that decide its plan (every rank passes them alike)."""

    plan: str  # one of PLANS
    bucket_bytes: int
    streaming: bool  # iter_full_model_grads: every step is one bucket of results


@dataclass(frozen=True)
class Route:
    """How a group's collectives run, fixed from the agreed capabilities when the plan is made (so that
    no executor asks the registry). The default: one flat collective per bucket, laid out by a copy of
    collgrad's where the layout is not rank-major already."""

    #: all_gather: the agreed primitive gathers per parameter straight into place (NCCL/XCCL).
    coalesced: bool = False
    #: all_gather: the agreed primitive is a flat gather and every rank's backend lays a coalesced
    #: gather out into strided output views itself (Gloo's copy out of its staging), with the coalesced
    #: primitive allowed by the policy: strided outputs, no reorder copy of collgrad's.
    laid_out_by_backend: bool = False
    #: all_reduce: the group's reductions go one collective per tensor (no bucket primitive agreed),
    #: so the per-parameter views are made before the sum.
    per_tensor: bool = False


#: The layout of one step: an all-reduce's fill, or a sliced gather's slices (collgrad/state/steps.py).
StepLayout = Union[ReduceStep, SlicesStep]


@dataclass(frozen=True)
class GroupPlan:
    group: int  # position in ``layout.groups``
    kind: PlanKind
    #: Indices into the group's ``params`` per step; together every index once, in order.
    batches: tuple[tuple[int, ...], ...]
    #: Bytes one step may take (results, or gathered slices); None where the group is one step.
    budget: int | None
    #: How the group's collectives run.
    route: Route = Route()
    #: Per step, its layout where the kind has one (all_reduce; all_gather of SLICED groups); else empty.
    steps: tuple[StepLayout, ...] = ()


@dataclass(frozen=True)
class GradPlan:
    call: GradCall
    groups: tuple[GroupPlan, ...]

    @property
    def steps(self) -> int:
        return sum(len(g.batches) for g in self.groups)


def needs_capabilities(group: LayoutGroup, call: GradCall, accessor: bool = False) -> bool:
    """Whether ``choose_kind`` looks at ``gather_ok`` for this group: only then must the caller ask
    the registry (collective over the group the first time)."""
    return not (
        accessor
        or group.kind is Partitioning.REPLICATED
        or group.world == 1
        or call.plan != "auto"
        or (call.streaming and group.kind is Partitioning.PARTITIONED_FLAT)
    )


def choose_kind(group: LayoutGroup, call: GradCall, gather_ok: bool, accessor: bool = False) -> PlanKind:
    """The plan kind of one group. ``gather_ok``: the group's agreed capabilities have a bucket
    primitive (not per-tensor) for an all-gather of its wire dtype. ``accessor``: the source has no
    layout and only DeepSpeed's per-parameter accessor can read it."""
    if accessor:
        return PlanKind.ACCESSOR
    if group.kind is Partitioning.REPLICATED or group.world == 1:
        return PlanKind.LOCAL
    if call.plan != "auto":
        return PlanKind(call.plan)
    if call.streaming and group.kind is Partitioning.PARTITIONED_FLAT:
        return PlanKind.ALL_REDUCE  # a bucket of whole parameters is complete by itself
    if not gather_ok:
        return PlanKind.ALL_REDUCE
    if group.kind is Partitioning.PARTITIONED_FLAT:
        wanted = sum(p.numel for p in group.params)
        if wanted < GATHER_MIN_SHARE * group.world * group.partition_numel:
            return PlanKind.ALL_REDUCE
    return PlanKind.ALL_GATHER


def batch_params(group: LayoutGroup, kind: PlanKind, call: GradCall) -> tuple[tuple[tuple[int, ...], ...], int | None]:
    """The steps of one group, and the byte budget of a step (None: one step).

    Sliced all-gathers (ZeRO-3, FSDP2) go by buckets of gathered bytes (the staging buffer is one bucket); when
    streaming, each step's staging and results together stay within a bucket (half each). Streamed
    all-reduces and streamed local reads (copies) go by buckets of result bytes; accessor reads
    go one parameter at a time. Everything else (unstreamed local reads, ZeRO-1/2 gathers, unstreamed
    all-reduces) is one step.
    """
    indices = tuple(range(len(group.params)))
    if not indices:
        return (), None
    if kind is PlanKind.ACCESSOR:
        return tuple((k,) for k in indices), None
    sliced_gather = kind is PlanKind.ALL_GATHER and group.kind is Partitioning.SLICED
    if not (sliced_gather or (call.streaming and kind in (PlanKind.ALL_REDUCE, PlanKind.LOCAL))):
        return (indices,), None
    itemsize = torch.empty((), dtype=group.out_dtype).element_size()
    budget = call.bucket_bytes // 2 if (call.streaming and sliced_gather) else call.bucket_bytes
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for k, p in enumerate(group.params):
        numel = p.slice_numel * group.world if sliced_gather else p.numel
        if current and (size + numel) * itemsize > budget:
            batches.append(tuple(current))
            current, size = [], 0
        current.append(k)
        size += numel
    batches.append(tuple(current))
    return tuple(batches), budget


@uncollected
def plan_grads(
    layout: StateLayout,
    call: GradCall,
    gather_ok: Mapping[int, bool],
    accessor: bool = False,
    routes: Callable[[int, PlanKind], Route] | None = None,
    ranks: Mapping[int, int] | None = None,
) -> GradPlan:
    """The plan of one call, complete before any data moves. ``gather_ok[i]``: for
    ``layout.groups[i]``, whether the agreed capabilities have a bucket all-gather primitive (see
    ``choose_kind``); ``routes(i, kind)``: how group ``i``'s collectives run, asked only for groups that
    communicate (default: flat); ``ranks[i]``: this rank's position in group ``i``, for the steps'
    layouts (without it, the plan has none: enough to test the choice of kinds and batches)."""
    groups = []
    for i, group in enumerate(layout.groups):
        kind = choose_kind(group, call, gather_ok.get(i, False), accessor)
        batches, budget = batch_params(group, kind, call)
        communicates = kind in (PlanKind.ALL_GATHER, PlanKind.ALL_REDUCE)
        route = routes(i, kind) if routes is not None and communicates else Route()
        steps = step_layouts(group, kind, batches, ranks[i]) if ranks is not None else ()
        groups.append(GroupPlan(i, kind, batches, budget, route, steps))
    return GradPlan(call, tuple(groups))


def step_layouts(
    group: LayoutGroup, kind: PlanKind, batches: tuple[tuple[int, ...], ...], rank: int
) -> tuple[StepLayout, ...]:
    """Each step's layout: an all-reduce's fill for this rank (at position ``rank`` in the group), or a
    sliced gather's slices; none for the other kinds."""
    if kind is PlanKind.ALL_REDUCE:
        return tuple(reduce_step(group, batch, rank) for batch in batches)
    if kind is PlanKind.ALL_GATHER and group.kind is Partitioning.SLICED:
        size = torch.empty((), dtype=group.wire_dtype).element_size()
        return tuple(slices_step(group, batch, size) for batch in batches)
    return ()
