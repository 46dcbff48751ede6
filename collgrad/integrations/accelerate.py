"""Hugging Face Accelerate: ``accelerator.backward(loss)`` runs DeepSpeed's ``backward()`` and ``step()``
in one call, so full gradients are only reachable from a pre-step hook on the engine it prepared.
Nothing here imports accelerate: the accelerator is read by attribute."""

from __future__ import annotations

from typing import Any, Callable

from collgrad import _compat
from collgrad.errors import InvalidArgumentError
from collgrad.grads.hook import PreStepHook
from collgrad.grads.hook import register_pre_step_hook as _register

__all__ = ["register_pre_step_hook"]


def register_pre_step_hook(accelerator: Any, fn: Callable[[Any], Any], *, every: int = 1) -> PreStepHook:
    """``collgrad.register_pre_step_hook`` on the DeepSpeed engine of ``accelerator``: ``fn(engine)``
    runs inside ``accelerator.backward(loss)`` at every ``every``-th accumulation boundary (where
    ``accelerator.sync_gradients`` is true), before DeepSpeed clips and steps.

    When and where: on every rank, after ``accelerator.prepare(model, optimizer, ...)`` with a DeepSpeed
    plugin. Local: no communication.
    """
    wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapper is None:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: this Accelerator has no DeepSpeed engine: call accelerator.prepare(model, "
            "optimizer, ...) first, with a DeepSpeed plugin or config. Without DeepSpeed, backward() and step() "
            "are separate calls: use collgrad's functions between them"
        )
    return _register(wrapper.engine, fn, every=every)
