"""What a full-gradient call did: per gradient group the plan and the collectives' records."""

from __future__ import annotations

from dataclasses import dataclass

from collgrad.core.record import CallRecord
from collgrad.state.layout import Partitioning
from collgrad.state.plan import PlanKind

__all__ = ["GroupRecord", "StateRecord"]


@dataclass(frozen=True)
class GroupRecord:
    group: int
    kind: Partitioning
    plan: PlanKind
    ranks: tuple[int, ...]
    params: int
    calls: tuple[CallRecord, ...]

    @property
    def collectives(self) -> int:
        return sum(c.collectives for c in self.calls)


@dataclass(frozen=True)
class StateRecord:
    """What a full-gradient call did: per gradient group, the plan and the collectives' records."""

    variant: str
    groups: tuple[GroupRecord, ...]
    #: Collectives of DeepSpeed's per-parameter accessor (``plan`` ``accessor``: one per parameter).
    per_param_collectives: int
    loss_scale: float
    unscaled: bool
    #: The gradient plan and every bucket plan were reused from an earlier call: this call planned nothing.
    plan_cached: bool
    #: The model's gradient layout (and where each rank's buffers lie) was reused from an earlier call.
    layout_cached: bool
    #: Bytes this rank sent through DeepSpeed's accessor (its ``per_param_collectives``).
    per_param_bytes: int = 0
    #: ``model_parallel="whole"``: the collectives over the tensor- and expert-parallel groups that made
    #: the shards whole (one per bucket).
    model_parallel_calls: tuple[CallRecord, ...] = ()

    @property
    def collectives(self) -> int:
        every = self.per_param_collectives + sum(g.collectives for g in self.groups)
        return every + sum(c.collectives for c in self.model_parallel_calls)

    @property
    def buckets(self) -> int:
        every = sum(len(c.buckets) for g in self.groups for c in g.calls)
        return every + sum(len(c.buckets) for c in self.model_parallel_calls)

    @property
    def bytes(self) -> int:
        every = self.per_param_bytes + sum(c.bytes for g in self.groups for c in g.calls)
        return every + sum(c.bytes for c in self.model_parallel_calls)
