"""Reading full gradients: ``safe_get_full_model_grads`` and ``iter_full_model_grads``.

Thin entry points: open the call (arguments, source, readiness, plan: call.py), run its plan
(execute.py), hand the results over in ``named_parameters()`` order or as a stream.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

import torch

from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher
from collgrad.state import adapters
from collgrad.state.call import OpenCall
from collgrad.state.execute import Executor
from collgrad.state.kinds import Grad, StateKind
from collgrad.state.record import StateRecord
from collgrad.state.whole import LOCAL, Joiner, whole_order

__all__ = [
    "safe_get_full_model_grads",
    "iter_full_model_grads",
    "FullState",
    "FullGrads",
    "FullStateStream",
    "collected",
]


class FullState(dict[str, torch.Tensor]):
    """``dict[name, Tensor]`` of one kind of state, each tensor whole, plus ``kind`` (which state),
    ``record`` (what was done) and ``model_parallel`` (names of tensor- or expert-parallel shards: whole
    across the data-parallel group, still local across tensor/expert-parallel ranks)."""

    kind: StateKind
    record: StateRecord
    model_parallel: frozenset[str]


class FullGrads(FullState):
    """The full gradients (``kind`` is ``GRAD``): what ``safe_get_full_model_grads`` returns."""


def safe_get_full_model_grads(
    model: object,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    unscale: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    copy: bool = True,
    model_parallel: str = LOCAL,
) -> FullGrads:
    """The full, reduced gradient of every trainable parameter of ``model``, in one collective per
    bucket.

    ``model`` is a DeepSpeed engine, the module it wraps, or a plain module whose ``.grad`` is already
    reduced. Keys are ``named_parameters()`` names (tied parameters once), in that order; values are
    shaped like the parameter, in the dtype and on the device ``deepspeed.utils.safe_get_full_grad``
    returns, and for fp32 and bf16 with fp32 accumulation bitwise equal to it. fp16 gradients are
    divided by the current loss scale unless ``unscale=False``. ``params`` (names or parameters)
    limits the call to a subset.

    When and where: on every rank of the data-parallel group, after ``engine.backward()`` of the last
    micro-step of an accumulation boundary and before ``engine.step()``, with the same arguments on
    every rank. Otherwise every rank raises the same error (NotReadyError, ArgumentMismatchError, or
    InvalidArgumentError on the rank whose arguments were invalid) before any gradient moves. The
    engine is not modified.

    ``model_parallel="whole"``: tensor- and expert-parallel shards whole (see
    ``safe_get_full_model_fp32_params``), on every rank of the model.

    ``copy=False``: where a rank already holds a gradient whole (stage 0, ``BF16_Optimizer``, a
    data-parallel group of one rank) the value is the optimizer's own tensor (that very tensor, or a
    view of it in the parameter's shape) instead of a copy: no memory, ~no time. Everything else is
    fresh either way, as are values that needed a conversion. Read it, do not write it: it is what
    ``step()`` uses.
    """
    call = OpenCall(
        adapters.enter(model),
        name="safe_get_full_model_grads",
        params=params,
        bucket_bytes=bucket_bytes,
        plan=plan,
        unscale=unscale,
        policy=policy,
        dispatcher=dispatcher,
        model_parallel=model_parallel,
    )
    grads = collected(call, copy)
    assert isinstance(grads, FullGrads)
    return grads


def collected(call: OpenCall, copy: bool = True) -> FullState:
    """Every result of the opened ``call``, in ``named_parameters()`` order (``FullGrads`` for gradients;
    whole: the unsharded model's names and order). Collective, as its steps."""
    joiner = _joiner(call)
    executor = Executor(call, copy=copy, uncopied=joiner.members if joiner is not None else frozenset())
    found: dict[str, torch.Tensor] = {}
    for results in executor.steps():
        found.update(results)
    order: Iterable[str] = call.source.layout.order
    if joiner is not None:  # every step done before the first join: no rank waits on a peer mid-gather
        found = dict(joiner.feed(found.items()))
        assert joiner.done(), "every bucket of shards was complete"
        order = whole_order(call.source, order)
    out = FullGrads() if isinstance(call.kind, Grad) else FullState()
    for name in order:
        if name in found:
            out[name] = found[name]
    out.kind = call.kind
    out.record = _record(executor, joiner)
    out.model_parallel = frozenset() if joiner is not None else call.source.model_parallel
    return out


def _joiner(call: OpenCall) -> Joiner | None:
    """What makes ``call``'s tensor- and expert-parallel shards whole, where it asks for them whole."""
    if not call.whole:
        return None
    # the buckets in the order the executor hands results over (its plan's groups and steps: the same
    # names in the same order on every rank of a model-parallel set), so that a bucket completes as soon
    # as its steps ran and what follows is not held back behind it
    groups = call.source.layout.groups
    names = [groups[g.group].params[k].name for g in call.plan.groups for batch in g.batches for k in batch]
    return Joiner(call.source, names, call.run, call.call.bucket_bytes)


def _record(executor: Executor, joiner: Joiner | None) -> StateRecord:
    record = executor.record()
    return record if joiner is None else replace(record, model_parallel_calls=tuple(joiner.calls))


class FullStateStream:
    """``(name, tensor)`` pairs of one kind of state (``kind``), one bucket of whole parameters at a
    time; ``record()`` tells what was done so far. Every rank must consume it to the end (each bucket is
    a collective)."""

    def __init__(self, call: OpenCall, copy: bool = True) -> None:
        self._joiner = _joiner(call)
        self._executor = Executor(call, copy=copy, uncopied=self._joiner.members if self._joiner else frozenset())
        self._iter = self._generate()
        self.kind: StateKind = call.kind
        self.model_parallel = frozenset() if self._joiner is not None else call.source.model_parallel

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iter

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._iter)

    def record(self) -> StateRecord:
        return _record(self._executor, self._joiner)

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        for results in self._executor.steps():
            if self._joiner is not None:  # whole as each bucket of shards is complete
                results = self._joiner.feed(results)
            results.reverse()
            while results:  # hand each tensor over and keep no reference: ~2 buckets alive at most
                yield results.pop()


def iter_full_model_grads(
    model: object,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    unscale: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    copy: bool = True,
    model_parallel: str = LOCAL,
) -> FullStateStream:
    """The same gradients as ``safe_get_full_model_grads``, as ``(name, tensor)`` pairs streamed one
    bucket of whole parameters at a time (in bucket order), so that collgrad holds about two buckets
    at a time whatever the model size (a parameter larger than a bucket is one bucket by itself).

    Same calling rules, plus: every rank must consume the whole iteration (each bucket is a
    collective); a rank that stops early leaves the others waiting. The arguments and readiness are
    checked, on every rank together, when this is called (not at the first ``next``). ``copy``: as
    for ``safe_get_full_model_grads``.
    """
    return FullStateStream(
        OpenCall(
            adapters.enter(model),
            name="iter_full_model_grads",
            streaming=True,
            params=params,
            bucket_bytes=bucket_bytes,
            plan=plan,
            unscale=unscale,
            policy=policy,
            dispatcher=dispatcher,
            model_parallel=model_parallel,
        ),
        copy,
    )
