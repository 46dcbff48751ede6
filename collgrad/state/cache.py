"""What a gradient source keeps between calls: plans and steps, typed, one field per kind, bounded.

    PlanCache (one per Source)
      shape(call, policy) -> ShapePlans     per call shape (plan=, bucket_bytes, streaming, policy=):
                                            gradient plan, primitives, bucket plans, steps
                                            LRU: at most MAX_SHAPES shapes, the least recently used
                                            dropped (a caller sweeping bucket_bytes grows nothing)
      placements[group]                     ZeRO-1/2: where every rank's pieces lie, and the cuts
      write_plans[group]                    where this rank's owned fragments are written
      arrangements[group]                   the statistics' blocks for where the pieces lie

Per shape, entries are one per step of that shape's plan (finite: the plan has that many steps);
per group, one entry each. Everything here is rebuilt on a miss: dropping an entry costs planning
time, never a result.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, Hashable, NamedTuple, TypeVar

import torch

from collgrad.backends.ops import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Prepared
from collgrad.state.plan import GradCall, GradPlan
from collgrad.state.stat_blocks import Arranged
from collgrad.state.steps import CopyPlan, Sent, ViewRun

__all__ = ["Lru", "ShapePlans", "PlanCache", "Placements", "HeldCopies", "WritePlan", "MAX_SHAPES"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Call shapes (plan=, bucket_bytes, streaming, policy=) whose plans a source keeps.
MAX_SHAPES = 8


class Lru(Generic[K, V]):
    """A mapping of at most ``bound`` entries; putting one more drops the least recently used."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: K, value: V) -> V:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.bound:
            self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()


class HeldCopies(NamedTuple):
    """An all-reduce step's copy plan, for the pieces where they lay when it was made (``placement``:
    their offsets in the storage span, ``starts``: in the buffer), and per run its reversed row index
    (on the buffer's device) where the run lies back to front."""

    placement: tuple[int, ...]
    starts: tuple[int, ...]
    plan: CopyPlan
    reverse: tuple[torch.Tensor | None, ...]


@dataclass
class ShapePlans:
    """The plans of one call shape: bounded by the number of steps of its gradient plan."""

    gradient_plan: GradPlan | None = None
    #: (group index, op, dtype) -> the agreed primitive under this shape's policy
    primitives: dict[tuple[int, Op, torch.dtype], Primitive | None] = field(default_factory=dict)
    #: (entry point, step, bucket bytes, strided, whole) -> the dispatcher's bucket plan
    bucket_plans: dict[tuple[str, Hashable, int, bool, bool], Prepared] = field(default_factory=dict)
    #: (group index, batch, rank in group, moved off its device) -> its copy plan
    copies: dict[tuple[int, tuple[int, ...], int, bool], HeldCopies] = field(default_factory=dict)


class Placements:
    """ZeRO-1/2: this rank's pieces as sent when the placements were exchanged, per parameter its runs
    in the gathered buffer, the least main run any rank sends (``head``: every rank sends that much as
    it lies), and the results' views derived from them by batch (dropped with them)."""

    def __init__(self, pieces: Sent, where: list[list[tuple[int, int]]], head: int) -> None:
        self.pieces = pieces
        self.where = where
        self.head = head
        self.views: Lru[tuple[int, ...], tuple[ViewRun, ...]] = Lru(MAX_SHAPES)


class WritePlan(NamedTuple):
    """A group's write rows (this rank's owned parts of its parameters, each within one piece of the
    local buffer) for the pieces where they lay (``where``: each piece's (storage span, offset) as
    ``Pieces.storage_spans`` gives them; None: cut piece by piece) and began (``starts``), and per target
    cut (span ``-1 - i``, or piece ``k``) the sizes whose ``split_with_sizes`` gives the rows' views
    (gaps between this rank's parts included, so that they cover it). The rows are columns, in the
    buffer's order, so that a write takes them in C loops."""

    where: tuple[tuple[int, int], ...] | None
    starts: tuple[int, ...]
    cuts: tuple[tuple[int, tuple[int, ...]], ...]
    #: whether each row's view follows the one before it in the buffer, the one before ending its
    #: parameter where this one begins its own: where their values follow each other too, one copy
    #: serves them
    follows: tuple[bool, ...]
    #: per row: its parameter, the first element and the count of its part, where it goes (its cut and
    #: its offset there: a run of rows is cut as one view), and its view of the cuts (each row's view,
    #: where they do not run)
    order: tuple[str, ...]
    los: tuple[int, ...]
    numels: tuple[int, ...]
    places: tuple[tuple[int, int], ...]
    views: tuple[int, ...]


class PlanCache:
    """A source's plans between calls, typed. Per call shape (``shape()``): an LRU of at most
    ``MAX_SHAPES`` (8) shapes, each holding one entry per step of its plan; per gradient group
    (``placements``, ``write_plans``, ``arrangements``): one entry each."""

    def __init__(self) -> None:
        self._shapes: Lru[tuple[GradCall, Policy | None], ShapePlans] = Lru(MAX_SHAPES)
        self.placements: dict[int, Placements] = {}
        self.write_plans: dict[int, WritePlan] = {}
        self.arrangements: dict[int, Arranged] = {}

    def shape(self, call: GradCall, policy: Policy | None) -> ShapePlans:
        """The plans of calls with these arguments (an empty set the first time)."""
        key = (call, policy)
        found = self._shapes.get(key)
        return found if found is not None else self._shapes.put(key, ShapePlans())

    @property
    def shapes(self) -> int:
        return len(self._shapes)
