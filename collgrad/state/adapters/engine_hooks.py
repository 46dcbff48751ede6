"""What collgrad adds to a DeepSpeed engine instance (never to its class, nor to DeepSpeed's source):
a hook inside its fused ``step()``, and the release of cached views before ``offload_states()``.
Written against DeepSpeed 0.19; the engine is passed in, deepspeed itself is never imported here
(deepspeed.py is the one module that does).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from collgrad.state.adapters.base import Source

__all__ = ["hook_model_step", "release_on_offload"]


def hook_model_step(engine: Any, run: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``run(engine)`` inside every ``engine.step()`` that updates the model, before it clips, checks for
    overflow or steps the optimizer; returns a function that undoes it. Relies on DeepSpeed 0.19
    internals (runtime/engine.py): ``step()`` calls ``self._take_model_step(lr_kwargs)`` exactly when
    ``is_gradient_accumulation_boundary()``, after the gradients are reduced (in ``backward()``, or in
    ``step()`` itself under unmanaged accumulation) and before anything else of the update: fp32
    clipping (``clip_fp32_gradients``), ``optimizer.step()`` (ZeRO and the fp16/bf16 optimizers check
    overflow and clip there), ``zero_grad()``. An instance attribute shadows the method; DeepSpeed's
    source is unchanged. Several callers share one wrapper (each run in the order registered)."""
    found: list[Callable[[Any], None]] | None = engine.__dict__.get("_collgrad_pre_step")
    runs: list[Callable[[Any], None]] = found if found is not None else []
    if found is None:
        engine.__dict__["_collgrad_pre_step"] = runs
        take_model_step = type(engine)._take_model_step

        def _take_model_step(*args: Any, **kwargs: Any) -> Any:
            for fn in list(runs):
                fn(engine)
            return take_model_step(engine, *args, **kwargs)

        engine._take_model_step = _take_model_step
    runs.append(run)

    def remove() -> None:
        if run in runs:
            runs.remove(run)
        if not runs and engine.__dict__.get("_collgrad_pre_step") is runs:
            del engine.__dict__["_collgrad_pre_step"], engine.__dict__["_take_model_step"]

    return remove


def release_on_offload(engine: Any, source: Source) -> None:
    """Make ``engine.offload_states()`` release ``source``'s cached tensors first.

    ``offload_states`` moves the optimizer's buffers off the accelerator by replacing their ``.data``
    (``grad_partitions_flat_buffer.data = ...to(cpu)`` in ZeRO-3): views a cached source keeps of the
    old buffers would keep that accelerator memory alive until collgrad's next call. DeepSpeed has no
    hook for it, so the engine's ``offload_states`` is wrapped, once per engine, on the instance (the
    class is untouched). The wrapper holds the engine and the sources weakly: caching a source never
    keeps an engine alive.
    """
    found: weakref.WeakSet[Source] | None = engine.__dict__.get("_collgrad_offload_watch")
    watched: weakref.WeakSet[Source] = found if found is not None else weakref.WeakSet()
    if found is None:
        engine.__dict__["_collgrad_offload_watch"] = watched
        engine_ref = weakref.ref(engine)

        def offload_states(*args: Any, **kwargs: Any) -> Any:
            for cached in list(watched):
                cached.release()
            owner: Any = engine_ref()
            return type(owner).offload_states(owner, *args, **kwargs)

        offload_states.__doc__ = type(engine).offload_states.__doc__
        engine.__dict__["offload_states"] = offload_states
    watched.add(source)
