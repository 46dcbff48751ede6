"""Where gradient fragments come from. ``read`` returns this rank's view of a model's gradients
without communicating: the layout (the same on every rank) and the local buffers.

Only ``collgrad.sources.deepspeed`` imports deepspeed, and only when a DeepSpeed engine is passed.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.sources.layout import GradGroup, GradLayout, Kind, ParamSlot

__all__ = ["Problem", "LocalGrads", "read"]


class Problem(enum.IntEnum):
    """Why the gradients cannot be read now. Codes travel between ranks: never renumber."""

    OK = 0
    NO_BACKWARD = 1
    NOT_BOUNDARY = 2
    UNMANAGED_ACCUMULATION = 3
    NO_GRADIENT_BUFFERS = 4

    def describe(self) -> str:
        return {
            Problem.OK: "ready",
            Problem.NO_BACKWARD: "called before backward() or after step(): the gradient buffers hold no "
            "gradient of this step (call it after engine.backward() and before engine.step())",
            Problem.NOT_BOUNDARY: "called at a micro-step that is not a gradient accumulation boundary: "
            "gradients are not reduced yet (call it after the backward() of the last micro-step)",
            Problem.UNMANAGED_ACCUMULATION: "managed_gradient_accumulation is off: DeepSpeed reduces inside "
            "step(), so there is no moment at which reduced gradients exist before step()",
            Problem.NO_GRADIENT_BUFFERS: "the optimizer holds no reduced gradient buffers",
        }[self]


@dataclass
class LocalGrads:
    """This rank's gradients as read from the model, before any communication."""

    layout: GradLayout
    #: per group: the contiguous local buffer (PARTITIONED_FLAT, PER_PARAM) or one full gradient per
    #: parameter (REPLICATED); empty when ``problem`` is set.
    buffers: list[Any]
    problem: Problem
    control_group: ProcessGroup  # the ranks that must all call, and agree before data moves
    groups: dict[int, ProcessGroup]  # group index -> process group
    device: torch.device  # where results are returned
    loss_scale: float = 1.0  # fp16: gradients are still multiplied by it
    model_parallel: frozenset[str] = field(default_factory=frozenset)
    #: Per-parameter fallback for optimizers without a known layout: name -> full gradient (collective).
    per_param: Callable[[nn.Parameter], torch.Tensor] | None = None
    params: dict[str, nn.Parameter] = field(default_factory=dict)


def _selected(module: nn.Module, params: Iterable[Any] | None) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if params is None:
        return named
    by_id = {id(p): n for n, p in named}
    names = {n for n, _ in named}
    wanted = set()
    for item in params:
        if isinstance(item, str):
            if item not in names:
                raise KeyError(f"rank {_rank()}: {item!r} is not a trainable parameter of this model; "
                               f"pass names from model.named_parameters()")
            wanted.add(item)
        elif isinstance(item, torch.Tensor):
            if id(item) not in by_id:
                raise KeyError(f"rank {_rank()}: a parameter of shape {tuple(item.shape)} is not a trainable "
                               "parameter of this model; pass this model's parameters or their names")
            wanted.add(by_id[id(item)])
        else:
            raise TypeError(f"params must hold parameter names or tensors, got {type(item).__name__}")
    return [(n, p) for n, p in named if n in wanted]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def read(model: Any, params: Iterable[Any] | None = None) -> LocalGrads:
    """This rank's gradients of ``model`` (a DeepSpeed engine, the module it wraps, or a plain module
    whose ``.grad`` already holds reduced gradients, as after DDP). Local: no communication."""
    if "deepspeed" in sys.modules or _looks_like_engine(model):
        from collgrad.sources import deepspeed as ds_source

        engine = ds_source.find_engine(model)
        if engine is not None:
            return ds_source.read(engine, _selected(engine.module, params))
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"rank {_rank()}: expected a DeepSpeed engine or a torch.nn.Module, got {type(model).__name__}"
        )
    return _read_plain(model, _selected(model, params))


def _looks_like_engine(model: Any) -> bool:
    return type(model).__name__.endswith("Engine") and hasattr(model, "optimizer")


def _read_plain(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> LocalGrads:
    """No ZeRO: ``param.grad`` is the full gradient (after DDP's all-reduce, or on one process)."""
    grads = [p.grad for _, p in named]
    problem = Problem.NO_BACKWARD if named and all(g is None for g in grads) else Problem.OK
    return replicated_grads(
        "torch", named, grads, problem, _compat.default_group() if torch.distributed.is_initialized() else None
    )


def replicated_grads(variant, named, grads, problem, group, loss_scale=1.0, model_parallel=frozenset()) -> LocalGrads:
    """LocalGrads for sources where every rank holds every full gradient."""
    device = named[0][1].device if named else torch.device("cpu")
    dtype = next((g.dtype for g in grads if g is not None), torch.float32)
    slots = tuple(ParamSlot(n, tuple(p.shape), p.numel(), 0, p.numel(), n in model_parallel) for n, p in named)
    ranks = tuple(_compat.group_ranks(group)) if group is not None else (0,)
    layout = GradLayout(variant, (GradGroup(0, Kind.REPLICATED, ranks, 0, dtype, dtype, slots),), tuple(n for n, _ in named))
    full = [g if g is not None else torch.zeros_like(p, dtype=dtype) for (_, p), g in zip(named, grads)]
    return LocalGrads(layout, [full] if problem is Problem.OK else [], problem, group, {0: group}, device,
                      loss_scale, frozenset(model_parallel), params=dict(named))
