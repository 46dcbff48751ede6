"""The adapter of a plain module (one process, or replicated by DDP): every rank holds each parameter's
state whole (its ``.grad`` already reduced; its weights; the optimizer's state of each parameter), so
nothing needs communicating but the agreements.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from collgrad import _compat
from collgrad.state.adapters.base import (
    Model,
    ReplicatedSource,
    Source,
    always_ok,
    optimizer_states,
    select,
    whole_values,
)
from collgrad.state.kinds import GRAD, WEIGHTS, StateKind

__all__ = ["PlainModel"]


class PlainModel(Model):
    """A module no framework partitions. Built by ``collgrad.state.adapters.resolve``."""

    framework: ClassVar[str] = "torch"

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.target = module

    def open(self, params: Iterable[object] | None = None, kind: StateKind = GRAD, optimizer: Any = None) -> Source:
        selection = None if params is None else list(params)
        trainable = kind != WEIGHTS
        named = select(self.module, selection, trainable=trainable)
        group = _compat.default_group() if torch.distributed.is_initialized() else None
        module = weakref.ref(self.module)  # sources are cached keyed weakly by the module: never hold it

        def reselect() -> list[tuple[str, nn.Parameter]]:  # parameters can be frozen or replaced between calls
            owner = module()
            return select(owner, selection, trainable=trainable) if owner is not None else []

        if kind == GRAD:
            return ReplicatedSource("torch", named, lambda: [p.grad for _, p in named], group, reselect=reselect)
        held = None if kind.key is None else optimizer_states(optimizer, kind)
        values = whole_values(named, kind, held)
        return ReplicatedSource(f"torch:{kind.label}", named, values, group, problem=always_ok, reselect=reselect)
