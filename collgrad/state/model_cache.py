"""What collgrad keeps of each model between calls: its sources, per dispatcher, per model, both
weakly; and how many model-wide writes it has had.

    ModelCache.source(dispatcher, model, params, kind, optimizer) -> Source   (reused while Source.valid())
    ModelCache.writes(model) -> int                                (what was read before may be stale)

A dispatcher or a model that goes away takes its sources with it. ``MODELS`` is the default instance
the public functions use; pass another ``ModelCache`` (e.g. in tests) to keep sources apart.
"""

from __future__ import annotations

import weakref
from typing import Hashable, Iterable, NamedTuple

import torch

from collgrad import _compat
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import Model, Source
from collgrad.state.kinds import GRAD, StateKind

__all__ = ["ModelCache", "MODELS", "Context"]

#: A model's sources by ``params=`` selection (None: every trainable parameter).
PerModel = dict[Hashable, Source]


class ModelCache:
    """Sources per dispatcher and per model, both held weakly."""

    def __init__(self) -> None:
        self._by_dispatcher: weakref.WeakKeyDictionary[Dispatcher, weakref.WeakKeyDictionary[object, PerModel]] = (
            weakref.WeakKeyDictionary()
        )
        self._writes: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    def of(self, dispatcher: Dispatcher) -> weakref.WeakKeyDictionary[object, PerModel]:
        """The models ``dispatcher`` has opened sources for, each with its sources by selection."""
        found = self._by_dispatcher.get(dispatcher)
        if found is None:
            found = self._by_dispatcher[dispatcher] = weakref.WeakKeyDictionary()
        return found

    def per_model(self, dispatcher: Dispatcher, model: object) -> PerModel:
        """``model``'s sources under ``dispatcher``; raises TypeError if ``model`` cannot be held weakly
        (then it is no model)."""
        return self.of(dispatcher).setdefault(model, {})

    def source(
        self,
        dispatcher: Dispatcher,
        model: Model,
        params: Iterable[object] | None,
        kind: StateKind,
        optimizer: torch.optim.Optimizer | None,
    ) -> tuple[Source, bool]:
        """The cached Source of ``kind`` of ``model`` for this ``params`` selection (and ``optimizer``)
        if its layout still holds, else a new one (an empty model or selection refused), and whether
        it came from the cache. Local: no communication."""
        params = None if params is None else list(params)
        selection = None if params is None else tuple(p if isinstance(p, str) else id(p) for p in params)
        # the optimizer weakly: equal while alive, and a dead one's key matches no new optimizer
        key = selection if kind == GRAD else (selection, kind, None if optimizer is None else weakref.ref(optimizer))
        per_model = self.per_model(dispatcher, model.target)
        source = per_model.get(key)
        cached = source is not None and source.valid()
        if source is None or not cached:
            source = per_model[key] = model.open(params, kind, optimizer)
        if not source.layout.order:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: no trainable parameter is selected (an empty model, or an empty params=)"
            )
        return source, cached

    def wrote(self, model: object) -> None:
        """A model-wide write into ``model`` begins (counted before it starts: one that fails halfway
        leaves what was read before no more valid). Local."""
        self._writes[model] = self._writes.get(model, 0) + 1

    def writes(self, model: object) -> int:
        """How many model-wide writes ``model`` has had (monotonic while it lives). Local."""
        return self._writes.get(model, 0)


#: The cache behind the public functions.
MODELS = ModelCache()


class Context(NamedTuple):
    """One public call's context, passed down from its entrance: the dispatcher it runs with and the
    cache of models' sources it keeps them in. Nothing below the public function reads a default."""

    dispatcher: Dispatcher
    models: ModelCache = MODELS

    @staticmethod
    def of(dispatcher: Dispatcher | None) -> Context:
        """The context of a call given ``dispatcher=`` (None: the default one)."""
        return Context(dispatcher if dispatcher is not None else default_dispatcher())

    def source(
        self,
        model: Model,
        kind: StateKind = GRAD,
        optimizer: torch.optim.Optimizer | None = None,
        params: Iterable[object] | None = None,
    ) -> tuple[Source, bool]:
        """The cached Source of ``kind`` of ``model``'s trainable parameters (``params``: that selection),
        and whether it came from the cache. Local."""
        return self.models.source(self.dispatcher, model, params, kind, optimizer)
