"""Hugging Face Accelerate: ``accelerator.backward(loss)`` runs DeepSpeed's ``backward()`` and ``step()``
in one call, so full gradients are only reachable from a pre-step hook on the engine it prepared; and
``save_model``, where ``accelerator.save_model`` consolidates the whole model on one rank first
(``accelerator.get_state_dict``). Nothing here imports accelerate: the accelerator is read by attribute."""

from __future__ import annotations

from typing import Any, Callable

from collgrad import _compat
from collgrad.checkpoint.save import SavedModel, save_full_model
from collgrad.errors import InvalidArgumentError
from collgrad.state.hook import PreStepHook
from collgrad.state.hook import register_pre_step_hook as _register

__all__ = ["register_pre_step_hook", "save_model"]


# The accelerator, the model and the DeepSpeed engine are framework objects: they enter untyped (Any).
def register_pre_step_hook(accelerator: Any, fn: Callable[[Any], object], *, every: int = 1) -> PreStepHook:
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


def save_model(accelerator: Any, model: Any, directory: str, **kwargs: Any) -> SavedModel:
    """``accelerator.save_model(model, directory)`` through ``collgrad.save_full_model``: the prepared
    model's weights as safetensors shards and their index (streamed, never the whole model on one rank),
    and, for a Transformers model, its config and generation config, so that ``from_pretrained`` loads
    the directory. ``kwargs`` go to ``save_full_model``.

    When and where: on every rank, after ``accelerator.prepare``, outside ``accelerator.backward``.
    """
    wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    saved = save_full_model(wrapper.engine if wrapper is not None else model, directory, **kwargs)
    module = accelerator.unwrap_model(model)
    # after every collective (a failure here raises on this rank alone, with nothing left to wait for)
    if saved.first_writer and hasattr(module, "config"):
        from collgrad.integrations.transformers import save_pretrained_files

        save_pretrained_files(module, directory)  # a Transformers model: what from_pretrained needs besides
    return saved
