"""Counting the collectives torch itself receives, inside a rank: every collective method of
``torch.distributed.ProcessGroup`` is wrapped for the duration of the block. Whatever issues the
call (``torch.distributed`` functions, collgrad's channels calling the group directly, DeepSpeed),
it passes through here, so a test observes what happened instead of reading what the code under
test says about itself."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["count_collectives", "count_planning", "Calls"]

_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "_allgather_base",
    "all_gather_single",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "recv_anysource",
)


class Calls(Counter):
    """Collective calls by method name; ``log`` holds (method, the first tensor argument's dtype, whether
    the call was made inside collgrad's agreement exchange)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, torch.dtype | None, bool]] = []
        self.in_agreement = False

    @property
    def total(self) -> int:
        return sum(self.values())

    @property
    def agreements(self) -> int:
        """Calls torch received for collgrad's agreements (capabilities, argument and readiness checks)."""
        return sum(1 for *_, agreement in self.log if agreement)

    @property
    def data(self) -> int:
        """Calls torch received for everything else: the data itself."""
        return self.total - self.agreements


def _first_tensor(args) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a:
            found = _first_tensor(a)
            if found is not None:
                return found
    return None


@contextmanager
def count_collectives() -> Iterator[Calls]:
    from collgrad.backends import agreement, registry

    calls = Calls()
    cls = dist.ProcessGroup
    saved = {}
    exchange = agreement.exchange

    def tagged_exchange(*args, **kwargs):  # which of torch's calls serve an agreement, not data
        calls.in_agreement = True
        try:
            return exchange(*args, **kwargs)
        finally:
            calls.in_agreement = False

    agreement.exchange = registry.exchange = tagged_exchange
    for name in _METHODS:
        original = cls.__dict__.get(name)
        if original is None:
            continue
        saved[name] = original

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            first = _first_tensor(args)
            calls.log.append((_name, None if first is None else first.dtype, calls.in_agreement))
            return _original(self, *args, **kwargs)

        setattr(cls, name, wrapped)
    try:
        yield calls
    finally:
        agreement.exchange = registry.exchange = exchange
        for name, original in saved.items():
            setattr(cls, name, original)


@contextmanager
def count_planning() -> Iterator[Counter]:
    """Calls of the two planners inside the block: the gradient plan and the dispatcher's bucket plan."""
    from collgrad.core import planner
    from collgrad.state import call

    counts: Counter = Counter()
    targets = [(planner, "plan_buckets"), (call, "plan_grads")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name, original in saved:

        def wrapped(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, wrapped)
    try:
        yield counts
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
