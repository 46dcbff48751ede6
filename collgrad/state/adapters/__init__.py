"""The door to the framework adapters: ``resolve(model)`` turns what a caller passed into the one
``Model`` adapter of the framework that holds its state.

    resolve(engine | module an engine wraps)  -> deepspeed.DeepSpeedModel
    resolve(fully_shard root)                 -> fsdp2.FSDP2Model
    resolve(any other module)                 -> plain.PlainModel
        .module         the module whose state_dict() the model has
        .target         what sources are cached for (the engine, or the module)
        .control_group  the ranks that must all call (the data-parallel group)
        .open(params, kind, optimizer) -> Source   (local: no communication)
        .load_kinds()                              (what a load writes)
        .hook_step(run) -> undo                    (a DeepSpeed engine's fused step)

Every public entry point resolves once, at its entrance (``enter``); nothing after it looks for the
engine again.
Only ``collgrad.state.adapters.deepspeed`` imports deepspeed, and only when a DeepSpeed engine (or a
module one wraps) is passed; only ``collgrad.state.adapters.fsdp2`` touches FSDP2 internals, when a
``fully_shard`` model is passed.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import LocalGrads, Model, Problem, ReplicatedSource, Source, rank_in, select
from collgrad.state.adapters.plain import PlainModel

__all__ = [
    "Problem",
    "LocalGrads",
    "Source",
    "ReplicatedSource",
    "Model",
    "resolve",
    "Entrance",
    "enter",
    "select",
    "rank_in",
]

ACCEPTED = (
    "a DeepSpeed engine or a torch.nn.Module (the module an engine wraps, a root sharded with "
    "torch.distributed.fsdp.fully_shard, or a plain module)"
)


def resolve(model: object) -> Model:
    """``model`` as collgrad sees it; InvalidArgumentError (this rank), saying what was passed and what
    is accepted, for anything else. Local, and cheap: no scan of memory, DeepSpeed imported only where
    it is loaded already or ``model`` looks like one of its engines, FSDP2 asked only where it is."""
    found: Model | None = None
    if "deepspeed" in sys.modules or _looks_like_engine(model):
        from collgrad.state.adapters import deepspeed as ds_adapter

        found = ds_adapter.adapt_engine(model)
        if found is not None:
            return found
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"rank {_compat.rank()}: expected {ACCEPTED}, got {type(model).__name__}")
    if "torch.distributed.fsdp" in sys.modules:  # imported by whoever called fully_shard
        from collgrad.state.adapters import fsdp2

        found = fsdp2.adapt_sharded(model)
    return found if found is not None else PlainModel(model)


class Entrance(NamedTuple):
    """A call's model resolved at its entrance (None where what was passed is no model), the error to
    agree on if it was not, the group whose ranks must all call, and this rank's global rank."""

    model: Model | None
    error: BaseException | None
    group: ProcessGroup | None
    me: int

    @property
    def model_group(self) -> ProcessGroup | None:
        """Every rank that holds a part of the model (``Model.model_group``: under tensor parallelism,
        every shard's), where a whole-model checkpoint is agreed; ``group`` where no model was resolved."""
        return self.model.model_group if self.model is not None else self.group


def enter(model: object) -> Entrance:
    """``model`` resolved once, at the entrance of a public call; a model of no known kind is kept as
    the error the call's first agreement tells the others (the default group's ranks, then), so that
    they raise with this rank instead of waiting for it. Local."""
    try:
        resolved: Model | None = resolve(model)
        error: BaseException | None = None
    except InvalidArgumentError as caught:
        resolved, error = None, caught
    group = resolved.control_group if resolved is not None else _compat.default_group_or_none()
    return Entrance(resolved, error, group, torch.distributed.get_rank() if group is not None else 0)


def _looks_like_engine(model: object) -> bool:
    return type(model).__name__.endswith("Engine") and hasattr(model, "optimizer")
