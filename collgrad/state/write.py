"""Writing full gradients back: ``safe_set_full_model_grads`` and ``safe_update_full_model_grads``.

Every rank passes the same full values; each writes only the elements it owns, where the optimizer
will step from (the source knows where: sources/), so writing needs no bulk collective::

    grads = {name: full gradient}     (the same on every rank; checked by checksum with check=True)
        |  readiness, arguments and checksums agreed in one small all-gather
    rank r: owned fragments of each parameter  ->  copied in place, times the loss scale (fp16)
        |  derived state refreshed (ZeRO-1/2 CPU offload: the per-parameter norms it clips with)
    next engine.step() clips, checks overflow and updates from the new values

``safe_update_full_model_grads`` streams: read a bucket of full gradients, hand each to ``fn``, write the
results back, next bucket; about two buckets of extra memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterable, Sequence

import torch

from collgrad import _compat
from collgrad.backends import agreement
from collgrad.backends.agreement import Field, ranks_by_value, stable_hash
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.errors import ArgumentMismatchError, InvalidArgumentError, NotReadyError, UnknownParameterError
from collgrad.state import adapters
from collgrad.state.adapters.base import Problem, Source
from collgrad.state.call import OpenCall, source_of
from collgrad.state.execute import Executor
from collgrad.state.kinds import GRAD, StateKind
from collgrad.state.record import StateRecord

__all__ = ["safe_set_full_model_grads", "safe_update_full_model_grads", "checksums", "set_full", "write_here"]


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Per tensor, a number that differs, with high probability, when any element differs bit for bit:
    the sum, wrapping in int64, of its bytes read as 64-bit words (order-free integer arithmetic: the
    same on every rank and device for equal tensors; two elements swapped within a word change it too).
    One reduction per tensor and one transfer for all, rather than a read back per tensor (measurements:
    docs/notes/)."""
    sums = []
    with torch.no_grad():
        for t in tensors:
            if t.numel() * t.element_size() % 8 == 0 and t.is_contiguous():
                try:  # the usual case, in three calls
                    sums.append(t.view(-1).view(torch.int64).sum())
                    continue
                except RuntimeError:
                    pass  # not 8-byte aligned in its storage
            sums.append(_word_sum(t))
    out = [0] * len(sums)
    for device in {x.device for x in sums}:  # one read back per device
        at = [i for i, x in enumerate(sums) if x.device == device]
        for i, value in zip(at, torch.stack([sums[i] for i in at]).tolist()):
            out[i] = value & ((1 << 62) - 1)  # fits in the int64 the exchange carries
    return out


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """``checksums``' number for any tensor: a copy where it is not 8-byte aligned (same values, same
    number), the elements that do not fill a word widened one by one."""
    flat = t.reshape(-1)
    cut = flat.numel() - flat.numel() * flat.element_size() % 8 // flat.element_size()
    try:
        words = flat[:cut].view(torch.int64)
    except RuntimeError:
        flat = flat.clone()
        words = flat[:cut].view(torch.int64)
    total = words.sum()
    if cut < flat.numel():
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        total = total + flat[cut:].contiguous().view(bits).sum(dtype=torch.int64) * 1_000_003
    return total


def _checked(source: Source, grads: object, argument: str = "grads") -> dict[str, torch.Tensor]:
    """``grads`` (the ``argument`` of the call) as {name: tensor} in layout order, each shaped like its
    parameter (a shard for model-parallel names). Raises InvalidArgumentError / UnknownParameterError
    on this rank."""
    if not isinstance(grads, Mapping):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {argument} must be a mapping name -> tensor, got {type(grads).__name__}"
        )
    slots = {s.name: s for g in source.layout.groups for s in g.params}
    out = {}
    for name, value in grads.items():
        slot = slots.get(name)
        if slot is None:
            raise UnknownParameterError(
                f"rank {_compat.rank()}: {name!r} is not a trainable parameter of this call (see params=); "
                "pass names from model.named_parameters()"
            )
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"rank {_compat.rank()}: {argument}[{name!r}] is a {type(value).__name__}")
        if tuple(value.shape) != slot.shape and value.numel() != slot.numel:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {argument}[{name!r}] has shape {tuple(value.shape)}; the parameter "
                f"has shape {slot.shape}"
            )
        out[name] = value
    return {name: out[name] for name in source.layout.order if name in out}


def safe_set_full_model_grads(
    model: object,
    grads: Mapping[str, torch.Tensor],
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    check: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
) -> StateRecord:
    """Make ``grads`` (name -> full gradient, any dtype and device; a subset of the trainable parameters
    allowed) the gradients the next ``engine.step()`` uses: clipping, overflow checks and the update
    see the new values. True (unscaled) values: under fp16 they are multiplied by the current loss
    scale before they are stored.

    When and where: on every rank of the data-parallel group, after the boundary ``backward()`` and
    before ``step()``, with the same names and values on every rank. Each rank writes only what it owns:
    no bulk collective, only the readiness check, in which (``check=True``) a checksum of the values is
    compared so that ranks passing different values raise together (ArgumentMismatchError) instead of
    training on a mix.
    """
    return set_full(model, grads, params, check, policy, dispatcher, "safe_set_full_model_grads")


def set_full(
    model: object,
    given: Mapping[str, torch.Tensor],
    params: Iterable[str | torch.Tensor] | None,
    check: bool,
    policy: Policy | None,
    dispatcher: Dispatcher | None,
    name: str,
    state: StateKind = GRAD,
    optimizer: torch.optim.Optimizer | None = None,
) -> StateRecord:
    """``given`` (name -> full value of ``state``, the same on every rank) written where this rank owns
    it, checked and agreed as ``safe_set_full_model_grads`` says; ``name``: the public function called."""
    argument = "grads" if state == GRAD else "values"
    values: dict[str, torch.Tensor] = {}
    sums: list[tuple[str, int]] = []
    opened: list[Source] = []

    def extra(source: Source) -> list[Field]:
        opened.append(source)
        values.update(_checked(source, given, argument))
        # Tensor/expert-parallel shards legitimately differ between the ranks of the data-parallel group
        # (each holds its own shard or experts): only the replicated parameters are compared.
        if check:
            compared = [name for name in values if name not in source.model_parallel]
            sums.extend(zip(compared, checksums([values[name] for name in compared])))
        return [
            Field(f"names in {argument}=", stable_hash([state.key, *values]), shown=False),
            Field(_CHECKSUM, stable_hash(sums) if check else -1, shown=False),
        ]

    dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
    try:
        call = OpenCall(
            adapters.enter(model),
            name=name,
            kind=state,
            params=params,
            unscale=state.scaled,  # only gradients are stored scaled (fp16)
            policy=policy,
            dispatcher=dispatcher,
            optimizer=optimizer,
            extra=extra,
        )
    except ArgumentMismatchError as error:
        if error.fields != (_CHECKSUM,):
            raise
        # Only the values differ, so every rank holds the same names: one more small exchange (on this
        # error path only) finds which tensors differ, so the error can name them.
        raise _which_differ(opened[0], sums, dispatcher.timeout, error, name) from None
    return _store(call, values)


_CHECKSUM = "values in grads= (checksum)"


def _which_differ(
    source: Source, sums: list[tuple[str, int]], timeout_s: float, error: ArgumentMismatchError, name: str
) -> ArgumentMismatchError:
    """The mismatch ``error`` with the names of the differing tensors, from every rank's per-tensor
    checksums (one all-gather over the control group; every rank reaches the same message)."""
    group = source.control_group
    assert group is not None  # a mismatch was seen, so there is more than one rank
    rows = agreement.exchange(
        group, [c for _, c in sums], timeout_s=timeout_s, what="the per-tensor checksum comparison"
    )
    ranks = _compat.group_ranks(group)
    differ = []
    for k, (param, _) in enumerate(sums):
        by_value = ranks_by_value(rows, k, ranks)
        if len(by_value) > 1:
            differ.append(f"{param!r} (ranks grouped by value: {sorted(by_value.values())})")
    shown = "; ".join(differ[:5]) + (f"; and {len(differ) - 5} more" if len(differ) > 5 else "")
    return ArgumentMismatchError(
        f"ranks passed different values to {name} for {len(differ)} tensor(s): {shown} "
        f"[seen by rank {_compat.rank()}]: pass the same values on every rank (compute them from values "
        "every rank holds, e.g. read by collgrad's safe_get_ functions, with the same operations)",
        error.fields,
    )


def _store(call: OpenCall, values: Mapping[str, torch.Tensor]) -> StateRecord:
    call.models.wrote(call.model.target)  # what the drop-in read before is stale from now on
    source = call.source
    if source.accessor_set is not None:  # an optimizer collgrad does not know: DeepSpeed's setter
        for name, value in values.items():  # (local: each rank writes its own fragment or partition)
            source.accessor_set(source.params[name], value.to(torch.float32))
        source.after_write(values)
    else:
        with torch.no_grad():
            source.write(call.local, values, call.local.loss_scale)
    return StateRecord(source.layout.variant, (), 0, call.local.loss_scale, False, call.cached, call.layout_cached)


def write_here(model: object, state: StateKind, values: Mapping[str, torch.Tensor]) -> bool:
    """``values`` (name -> full value of ``state``, as held: a gradient scaled as the optimizer holds it)
    written where this rank owns them, now, with no collective and no check between ranks: what
    DeepSpeed's own setters do, for the drop-in that serves them. False, writing nothing, where collgrad
    knows no layout for the model; NotReadyError (this rank) where there is nothing to write into."""
    source, _ = source_of(model, state)
    if source.accessor_set is not None:
        return False
    local = source.read()
    if local.problem is not Problem.OK:
        raise NotReadyError(f"rank {_compat.rank()}: {local.problem.describe()}")
    with torch.no_grad():
        source.write(local, values, 1.0)
    return True


def safe_update_full_model_grads(
    model: object,
    fn: Callable[[str, torch.Tensor], torch.Tensor | None],
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
) -> StateRecord:
    """Stream every full gradient through ``fn(name, grad)`` and write the results back: ``fn`` returns a
    new tensor, or None after editing ``grad`` in place. Bucket by bucket, as ``iter_full_model_grads``
    reads, so about two buckets of extra memory whatever the model size. Gradients are true values
    (unscaled under fp16); what ``fn`` returns is stored as ``safe_set_full_model_grads`` stores it.

    When and where: as ``safe_set_full_model_grads``; ``fn`` must compute the same result on every rank
    (it sees the same input everywhere). Returns what was done (the reads' collectives).
    """
    if not callable(fn):
        raise InvalidArgumentError(f"rank {_compat.rank()}: fn must be callable, got {type(fn).__name__}")
    call = OpenCall(
        adapters.enter(model),
        name="safe_update_full_model_grads",
        streaming=True,
        params=params,
        bucket_bytes=bucket_bytes,
        unscale=True,
        policy=policy,
        dispatcher=dispatcher,
    )
    executor = Executor(call)
    for results in executor.steps():
        edited, grad, out = {}, None, None
        for name, grad in results:
            out = fn(name, grad)
            edited[name] = grad if out is None else out
        _store(call, edited)
        # Keep nothing of this bucket (not even the loop variables) while the next one is made.
        del results, edited, grad, out
    return executor.record()
