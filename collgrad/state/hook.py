"""A function run inside DeepSpeed's fused ``step()``, where full gradients are valid: between the
reduction of the boundary ``backward()`` and the overflow check, clipping and optimizer update.

Hugging Face Accelerate and Trainer call ``engine.backward(loss)`` and ``engine.step()`` in one call,
so user code never sees the window between them; a pre-step hook runs in it::

    engine.step()  (yours, Accelerate's or Trainer's), at an accumulation boundary:
        fn(engine) on every rank        <- every collgrad.state function is valid here; edits count
        one small check: did fn raise on any rank?  yes -> every rank raises, no step is taken
        DeepSpeed: overflow check, clipping, optimizer.step(), zero_grad()

A rank whose ``fn`` raised tells the others through the agreement every collgrad call starts with (or
through the hook's own check, if they are not in one), so no rank waits in a collective alone.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends import agreement
from collgrad.core.dispatch import default_dispatcher
from collgrad.errors import InvalidArgumentError, PreStepHookError
from collgrad.state import adapters
from collgrad.state.call import FIELDS, OpenCall

__all__ = ["PreStepHook", "register_pre_step_hook"]


class PreStepHook:
    """The handle ``register_pre_step_hook`` returns: ``remove()`` it to stop the hook."""

    def __init__(self, fn: Callable[[Any], Any], every: int) -> None:
        self.fn = fn
        self.every = every
        #: Accumulation boundaries seen on this rank, and how many of them ran ``fn``.
        self.boundaries = 0
        self.calls = 0
        self._remove: Callable[[], None] | None = None

    def remove(self) -> None:
        """Stop calling the hook (local: no communication). Idempotent."""
        if self._remove is not None:
            self._remove()
            self._remove = None

    @property
    def active(self) -> bool:
        return self._remove is not None


def register_pre_step_hook(model: object, fn: Callable[[Any], Any], *, every: int = 1) -> PreStepHook:
    """Call ``fn(engine)`` on every rank inside ``engine.step()`` at every ``every``-th gradient
    accumulation boundary, after the gradients are reduced and before DeepSpeed's overflow check,
    clipping and optimizer update: inside ``fn`` every collgrad.state function is valid, and gradients
    written there are what DeepSpeed clips and steps with. It fires whoever calls ``step()`` (your
    loop, Accelerate, Trainer), once per boundary, never at other micro-steps.

    If ``fn`` raises on any rank, every rank raises (that rank its own exception, the others
    PreStepHookError) and the step is not taken. ``fn`` must make the same collgrad calls on every
    rank; its own torch.distributed collectives are its responsibility.

    When and where: on every rank of the engine's data-parallel group, with the same ``every``, after
    ``deepspeed.initialize`` (``model``: the engine or the module it wraps). Local: no communication.
    Returns a handle; ``handle.remove()`` stops it.
    """
    if not callable(fn):
        raise InvalidArgumentError(f"rank {_compat.rank()}: fn must be callable, got {type(fn).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidArgumentError(f"rank {_compat.rank()}: every must be a positive int, got {every!r}")
    handle = PreStepHook(fn, every)
    resolved = adapters.resolve(model)
    group = resolved.control_group

    def run(engine: Any) -> None:
        handle.boundaries += 1
        if handle.boundaries % handle.every:
            return
        handle.calls += 1
        _run_checked(handle.fn, engine, group)

    handle._remove = resolved.hook_step(run)
    return handle


def _run_checked(fn: Callable[[Any], Any], engine: Any, group: ProcessGroup | None) -> None:
    """``fn(engine)``, then one small check over ``group`` so that every rank raises if it raised on any.
    Another rank's failure is seen by the collgrad calls ``fn`` makes through the default dispatcher."""
    failures = default_dispatcher().hook_failures
    seen = failures.seen
    try:
        fn(engine)
    except BaseException:
        if group is not None and failures.seen == seen:
            try:  # the others learn it in whatever check they are in
                _tell(group, agreement.HOOK_FAILED)
            except PreStepHookError:
                pass  # this rank's own exception is the one to raise
        raise
    if failures.seen != seen:
        # fn went on after a collgrad call inside it raised because another rank's hook had failed:
        # those ranks are done, so there is no check to join; stop here too.
        raise PreStepHookError(
            f"rank {_compat.rank()}: the pre-step hook raised on another rank; the step is not taken"
        )
    if group is not None:
        _tell(group, 0)


def _tell(group: ProcessGroup, status: int) -> None:
    """One row in the shape of every collgrad call's argument check, so that a rank whose hook raised
    early meets the others' next check wherever they are; raises PreStepHookError if any rank failed."""
    agreement.agree_on_call(
        group,
        [agreement.Field(f"unused {i}", 0) for i in range(len(FIELDS) + OpenCall.EXTRA)],
        timeout_s=default_dispatcher().timeout,
        call="the pre-step hook",
        status=status,
    )
