"""The door to the framework adapters: ``resolve(model)`` turns what a caller passed into one ``Model``.

    resolve(engine | module an engine wraps | fully_shard root | plain module) -> Model
        .framework      "deepspeed", "fsdp2" or "torch"
        .target         what sources are cached for (the engine, or the module)
        .module         the module whose state_dict() the model has
        .control_group  the ranks that must all call (the data-parallel group)
        .open(params, kind, optimizer) -> Source   (local: no communication)
        .hook_step(run) -> undo                    (a DeepSpeed engine's fused step)

Every public entry point resolves once, at its entrance; nothing after it looks for the engine again.
Only ``collgrad.state.adapters.deepspeed`` imports deepspeed, and only when a DeepSpeed engine (or a
module one wraps) is passed; only ``collgrad.state.adapters.fsdp2`` touches FSDP2 internals, when a
``fully_shard`` model is passed.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Iterable, Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import (
    LocalGrads,
    Problem,
    ReplicatedSource,
    Source,
    always_ok,
    optimizer_states,
    rank_in,
    select,
    whole_values,
)
from collgrad.state.kinds import GRAD, WEIGHTS, StateKind

__all__ = ["Problem", "LocalGrads", "Source", "ReplicatedSource", "Model", "resolve", "select", "rank_in"]

Framework = Literal["deepspeed", "fsdp2", "torch"]
ACCEPTED = (
    "a DeepSpeed engine or a torch.nn.Module (the module an engine wraps, a root sharded with "
    "torch.distributed.fsdp.fully_shard, or a plain module)"
)


class Model:
    """What a caller passed, resolved once: which framework holds its state, and the objects it is held
    by. Built by ``resolve``; holds nothing but references the caller already holds."""

    def __init__(self, framework: Framework, module: nn.Module, engine: Any = None) -> None:
        self.framework: Framework = framework
        self.module = module
        #: The DeepSpeed engine (a framework object), or None.
        self.engine: Any = engine
        #: What sources are cached for: the engine, or the module.
        self.target: object = engine if engine is not None else module

    @property
    def control_group(self) -> ProcessGroup | None:
        """The group whose ranks must all call for this model (its data-parallel group); None without
        a process group."""
        if not torch.distributed.is_initialized():
            return None
        if self.engine is not None:
            from collgrad.state.adapters import deepspeed as ds_adapter

            group: ProcessGroup = ds_adapter.control_group(self.engine)
            return group
        return _compat.default_group()

    def open(self, params: Iterable[object] | None = None, kind: StateKind = GRAD, optimizer: Any = None) -> Source:
        """The Source of ``kind`` (default: the gradients) of this model's parameters (``params``: a
        selection). ``optimizer``: the one holding optimizer states where the model does not (FSDP2, a
        plain module). Local: no communication."""
        trainable = kind != WEIGHTS
        if self.engine is not None:
            from collgrad.state.adapters import deepspeed as ds_adapter

            return ds_adapter.open_engine(self.engine, select(self.module, params, trainable=trainable), kind)
        if self.framework == "fsdp2":
            from collgrad.state.adapters import fsdp2

            return fsdp2.open_fsdp2(self.module, select(self.module, params, trainable=trainable), kind, optimizer)
        return _plain(self.module, None if params is None else list(params), kind, optimizer)

    def load_kinds(self) -> tuple[StateKind, ...]:
        """The kinds of state a load writes: the module's weights, and the fp32 master weights where an
        optimizer keeps its own (a DeepSpeed engine's ZeRO and bf16 optimizers); FSDP2 and a plain module
        step their parameters themselves. InvalidArgumentError (this rank) where collgrad cannot write
        the masters. Local."""
        if self.engine is None:
            return (WEIGHTS,)
        from collgrad.state.adapters import deepspeed as ds_adapter

        return ds_adapter.load_kinds(self.engine)

    def hook_step(self, run: Callable[[Any], None]) -> Callable[[], None]:
        """Have ``run(engine)`` called inside this model's fused step (a DeepSpeed engine's ``step()``, at
        each accumulation boundary, before clipping and the update); returns the function that undoes
        it. InvalidArgumentError (this rank) where there is no such step."""
        if self.engine is None:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {type(self.module).__name__} is not a DeepSpeed engine (or a module one "
                "wraps): there is no fused step to hook. With a torch optimizer, call your function between "
                "backward() and optimizer.step() (or register it with optimizer.register_step_pre_hook)"
            )
        from collgrad.state.adapters import deepspeed as ds_adapter

        return ds_adapter.hook_model_step(self.engine, run)


def resolve(model: object) -> Model:
    """``model`` as collgrad sees it; InvalidArgumentError (this rank), saying what was passed and what
    is accepted, for anything else. Local, and cheap: no scan of memory, DeepSpeed imported only where
    it is loaded already or ``model`` looks like one of its engines."""
    engine = None
    if "deepspeed" in sys.modules or _looks_like_engine(model):
        from collgrad.state.adapters import deepspeed as ds_adapter

        engine = ds_adapter.engine_of(model)
    if engine is not None:
        return Model("deepspeed", engine.module, engine)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"rank {_compat.rank()}: expected {ACCEPTED}, got {type(model).__name__}")
    framework: Framework = "torch"
    if "torch.distributed.fsdp" in sys.modules:  # imported by whoever called fully_shard
        from collgrad.state.adapters import fsdp2

        framework = "fsdp2" if fsdp2.is_fsdp2(model) else "torch"
    return Model(framework, model)


def _looks_like_engine(model: object) -> bool:
    return type(model).__name__.endswith("Engine") and hasattr(model, "optimizer")


def _plain(model: nn.Module, params: list[Any] | None, state: StateKind, optimizer: Any) -> Source:
    """A plain module (one process, or replicated by DDP): every rank holds each parameter's state whole
    (its ``.grad`` already reduced; its weights; ``optimizer``'s state of each parameter)."""
    trainable = state != WEIGHTS
    named = select(model, params, trainable=trainable)
    group = _compat.default_group() if torch.distributed.is_initialized() else None
    module = weakref.ref(model)

    def reselect() -> list[tuple[str, nn.Parameter]]:  # parameters can be frozen or replaced between calls
        owner = module()
        return select(owner, params, trainable=trainable) if owner is not None else []

    if state == GRAD:
        return ReplicatedSource("torch", named, lambda: [p.grad for _, p in named], group, reselect=reselect)
    held = None if state.key is None else optimizer_states(optimizer, state)
    values = whole_values(named, state, held)
    return ReplicatedSource(f"torch:{state.label}", named, values, group, problem=always_ok, reselect=reselect)
