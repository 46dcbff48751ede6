"""Where gradient fragments come from: the door that opens the right adapter.

``open_source(model, params)`` inspects a model once and returns a ``Source`` (base.py): the gradient
layout (plain data, the same on every rank) and how to find this rank's buffers. ``Source.read()``
then returns, each call and without communicating, the local buffers and whether reading is valid now.
Sources are cached per model by the caller while ``Source.valid()`` holds, so a second call does no
planning work.

Only ``collgrad.state.adapters.deepspeed`` imports deepspeed, and only when a DeepSpeed engine is passed;
only ``collgrad.state.adapters.fsdp2`` touches FSDP2 internals, when a ``fully_shard`` model is passed.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import (
    FP32,
    GRAD,
    WEIGHTS,
    LocalGrads,
    Problem,
    ReplicatedSource,
    Source,
    State,
    always_ok,
    optimizer_states,
    rank_in,
    select,
    whole_values,
)

__all__ = [
    "Problem",
    "LocalGrads",
    "Source",
    "ReplicatedSource",
    "State",
    "GRAD",
    "FP32",
    "WEIGHTS",
    "open_source",
    "select",
    "control_group_of",
    "module_of",
    "hook_model_step",
    "rank_in",
]


def open_source(model: Any, params: Iterable[Any] | None = None, state: State = GRAD, optimizer: Any = None) -> Source:
    """The Source of ``state`` (default: the gradients) of ``model``: a DeepSpeed engine, the module it
    wraps, a ``fully_shard`` model, or a plain module whose ``.grad`` already holds reduced gradients
    (after DDP, or on one process). ``optimizer``: the one holding optimizer states where the model does
    not (FSDP2, a plain module). Local: no communication."""
    engine = _engine_of(model)
    if engine is not None:
        named = select(engine.module, params, trainable=state != WEIGHTS)
        if state == GRAD:
            from collgrad.state.adapters import deepspeed as ds_source

            return ds_source.open_engine(engine, named)
        from collgrad.state.adapters.deepspeed_state import open_engine_state

        return open_engine_state(engine, named, state)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: expected a DeepSpeed engine or a torch.nn.Module, got {type(model).__name__}"
        )
    if "torch.distributed.fsdp" in sys.modules:  # imported by whoever called fully_shard
        from collgrad.state.adapters import fsdp2

        if fsdp2.is_fsdp2(model):
            return fsdp2.open_fsdp2(model, select(model, params, trainable=state != WEIGHTS), state, optimizer)
    params = None if params is None else list(params)
    if state != GRAD:
        return _plain_state(model, params, state, optimizer)
    named = select(model, params)
    group = _compat.default_group() if torch.distributed.is_initialized() else None
    module = weakref.ref(model)

    def reselect() -> list[tuple[str, nn.Parameter]]:  # trainable parameters can change between calls
        owner = module()
        return select(owner, params) if owner is not None else []

    return ReplicatedSource("torch", named, lambda: [p.grad for _, p in named], group, reselect=reselect)


def _plain_state(model: nn.Module, params: list[Any] | None, state: State, optimizer: Any) -> Source:
    """A plain module (one process, or replicated by DDP): its weights, or ``optimizer``'s state of each
    parameter, are whole on every rank."""
    trainable = state != WEIGHTS
    named = select(model, params, trainable=trainable)
    group = _compat.default_group() if torch.distributed.is_initialized() else None
    module = weakref.ref(model)

    def reselect() -> list[tuple[str, nn.Parameter]]:  # parameters can be frozen or replaced between calls
        owner = module()
        return select(owner, params, trainable=trainable) if owner is not None else []

    held = None if state.key is None else optimizer_states(optimizer, state)
    values = whole_values(named, state, held)
    return ReplicatedSource(f"torch:{state.what}", named, values, group, problem=always_ok, reselect=reselect)


def control_group_of(model: Any) -> ProcessGroup | None:
    """The group whose ranks must all call for ``model`` (its data-parallel group), found without
    inspecting gradients: used to tell the other ranks when this rank's arguments are invalid."""
    if not torch.distributed.is_initialized():
        return None
    engine = _engine_of(model)
    if engine is not None:
        from collgrad.state.adapters import deepspeed as ds_source

        group: ProcessGroup | None = ds_source.control_group(engine)
        return group
    return _compat.default_group()


def module_of(model: Any) -> nn.Module:
    """The module whose ``state_dict`` ``model`` holds: a DeepSpeed engine's ``module`` (the module it
    wraps itself), else ``model``; InvalidArgumentError (this rank) for anything else. Local."""
    engine = _engine_of(model)
    module = engine.module if engine is not None else model
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: expected a DeepSpeed engine or a torch.nn.Module, got {type(model).__name__}"
        )
    return module


def hook_model_step(model: Any, run: Callable[[Any], None]) -> Callable[[], None]:
    """Have ``run(engine)`` called inside ``model``'s fused step (a DeepSpeed engine's ``step()``, at each
    accumulation boundary, before clipping and the update); returns the function that undoes it.
    Raises InvalidArgumentError where there is no such step."""
    engine = _engine_of(model)
    if engine is not None:
        from collgrad.state.adapters import deepspeed as ds_source

        return ds_source.hook_model_step(engine, run)
    raise InvalidArgumentError(
        f"rank {_compat.rank()}: {type(model).__name__} is not a DeepSpeed engine (or a module one wraps): there is "
        "no fused step to hook. With a torch optimizer, call your function between backward() and "
        "optimizer.step() (or register it with optimizer.register_step_pre_hook)"
    )


def _engine_of(model: Any) -> Any:
    """The DeepSpeed engine ``model`` is or wraps, else None; DeepSpeed is imported (through the
    adapter) only where it is loaded already or ``model`` looks like one of its engines."""
    if "deepspeed" not in sys.modules and not _looks_like_engine(model):
        return None
    from collgrad.state.adapters import deepspeed as ds_source

    return ds_source.find_engine(model)


def _looks_like_engine(model: Any) -> bool:
    return type(model).__name__.endswith("Engine") and hasattr(model, "optimizer")
