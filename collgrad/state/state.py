"""The rest of the training state model-wide: the fp32 master weights and the optimizer's
per-element states (``exp_avg``, ``exp_avg_sq``, ...), read whole in one collective per bucket, and
written back by each rank where it owns them (no bulk collective).

The same machinery as the gradients (call.py, execute.py): the source reads the tensors the optimizer
steps instead of the gradient buffers (adapters/deepspeed.py, adapters/fsdp2.py), laid out as the
gradients are, so every plan, executor and record applies unchanged.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch

from collgrad.backends.agreement import Field, stable_hash
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher
from collgrad.state import adapters
from collgrad.state.adapters.base import Source
from collgrad.state.call import OpenCall
from collgrad.state.kinds import FP32, OptimizerState, StateKind
from collgrad.state.read import FullState, FullStateStream, collected
from collgrad.state.record import StateRecord
from collgrad.state.whole import LOCAL
from collgrad.state.write import set_full

__all__ = [
    "safe_set_full_model_fp32_params",
    "safe_set_full_model_optimizer_states",
    "safe_get_full_model_fp32_params",
    "iter_full_model_fp32_params",
    "safe_get_full_model_optimizer_states",
    "iter_full_model_optimizer_states",
]


def safe_get_full_model_fp32_params(
    model: object,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> FullState:
    """The full fp32 master weight of every trainable parameter of ``model``, in one collective per
    bucket: ``{name: tensor}`` in ``named_parameters()`` order (tied parameters once), each shaped like
    the parameter, in the dtype and on the device ``deepspeed.utils.safe_get_full_fp32_param`` returns
    and bitwise equal to it; ``.record`` says what was done.

    ``model``: a DeepSpeed engine (or the module it wraps), a ``fully_shard`` model (its sharded
    parameters are what FSDP2 steps), or a plain module. Where there is no master copy (stage 0 with a
    torch optimizer, FSDP2 or a plain module in fp32) the module's own weights. ``params`` (names or
    parameters) limits the call to a subset.

    ``model_parallel="whole"``: a tensor- or expert-parallel model's tensors as the unsharded model has
    them (under its names, experts by global index), on every rank of the model, one more collective
    per bucket over the tensor- or expert-parallel group (collgrad/state/whole.py); the default
    ``"local"`` leaves each rank's shards as the framework's accessors give them (``.model_parallel``
    names them). Every read, stream, statistic and setter of the training state takes it.

    When and where: on every rank of the data-parallel group (with ``"whole"``: of the model), with the
    same arguments, at any time outside ``step()`` (no backward is needed). Invalid or different
    arguments raise on every rank together before any value moves. Nothing is modified; the values are
    fresh tensors.
    """
    name = "safe_get_full_model_fp32_params"
    return collected(
        _open(model, name, FP32, False, params, bucket_bytes, plan, policy, dispatcher, None, model_parallel)
    )


def iter_full_model_fp32_params(
    model: object,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> FullStateStream:
    """The same fp32 master weights as ``safe_get_full_model_fp32_params``, as ``(name, tensor)`` pairs
    streamed one bucket of whole parameters at a time (collgrad holds about two buckets). Same calling
    rules, plus: every rank must consume the whole iteration (each bucket is a collective)."""
    name = "iter_full_model_fp32_params"
    opened = _open(model, name, FP32, True, params, bucket_bytes, plan, policy, dispatcher, None, model_parallel)
    return FullStateStream(opened)


def safe_get_full_model_optimizer_states(
    model: object,
    key: str,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> FullState:
    """The optimizer's per-element state ``key`` (``"exp_avg"``, ``"exp_avg_sq"``, ...) of every
    trainable parameter of ``model``, whole, in one collective per bucket: ``{name: tensor}`` shaped
    like the parameter, as ``deepspeed.utils.safe_get_full_optimizer_state(param, key)`` returns it and
    bitwise equal to it.

    ``optimizer``: the optimizer holding the states where the model does not (a ``fully_shard`` model,
    a plain module); a DeepSpeed engine's own optimizer is used for an engine. A key the optimizer does
    not hold, or holds but not one value per element (``"step"``), raises InvalidArgumentError saying
    which keys it holds. Same calling rules as ``safe_get_full_model_fp32_params``; torch optimizers
    create their states in their first ``step()``.
    """
    name, kind = "safe_get_full_model_optimizer_states", OptimizerState(key)
    opened = _open(model, name, kind, False, params, bucket_bytes, plan, policy, dispatcher, optimizer, model_parallel)
    return collected(opened)


def iter_full_model_optimizer_states(
    model: object,
    key: str,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> FullStateStream:
    """The same states as ``safe_get_full_model_optimizer_states``, streamed one bucket of whole
    parameters at a time; every rank must consume the whole iteration."""
    name, kind = "iter_full_model_optimizer_states", OptimizerState(key)
    opened = _open(model, name, kind, True, params, bucket_bytes, plan, policy, dispatcher, optimizer, model_parallel)
    return FullStateStream(opened)


def safe_set_full_model_fp32_params(
    model: object,
    values: Mapping[str, torch.Tensor],
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    check: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> StateRecord:
    """Make ``values`` (name -> full fp32 weight, any dtype and device; a subset allowed) the fp32 master
    weights the optimizer steps from, and the module's own weights with them: ZeRO-1/2's replicated
    low-precision copy, ZeRO-3's partitions and the parameters it holds whole, BF16_Optimizer's bf16
    weights, FSDP2's shards, so that the next forward already uses them (DeepSpeed's
    ``safe_set_full_fp32_param`` leaves those until the next step). Adam's states are left as they are.

    When and where: on every rank of the data-parallel group, at any time outside ``step()`` and not
    between a forward and its backward (the weights change in place: autograd may refuse that backward,
    as after any in-place change of a weight it saved), with the same names and values on every rank.
    Each rank writes what it owns, without a bulk collective: only the agreement, in which
    (``check=True``) checksums of the values are compared, so that ranks passing different values raise
    together (ArgumentMismatchError) instead of training on a mix.
    """
    name = "safe_set_full_model_fp32_params"
    return set_full(model, values, params, check, policy, dispatcher, name, FP32, model_parallel=model_parallel)


def safe_set_full_model_optimizer_states(
    model: object,
    key: str,
    values: Mapping[str, torch.Tensor],
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    check: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    model_parallel: str = LOCAL,
) -> StateRecord:
    """Make ``values`` (name -> full tensor shaped like the parameter) the optimizer's per-element state
    ``key`` (``"exp_avg"``, ...) of those parameters, each rank writing what it owns. ``optimizer``: as
    for ``safe_get_full_model_optimizer_states``. Same calling rules as
    ``safe_set_full_model_fp32_params``."""
    state = OptimizerState(key)
    name = "safe_set_full_model_optimizer_states"
    return set_full(model, values, params, check, policy, dispatcher, name, state, optimizer, model_parallel)


def _open(
    model: object,
    name: str,
    kind: StateKind,
    streaming: bool,
    params: Iterable[str | torch.Tensor] | None,
    bucket_bytes: int | None,
    plan: str,
    policy: Policy | None,
    dispatcher: Dispatcher | None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parallel: str = LOCAL,
) -> OpenCall:
    """The call opened on every rank together (arguments, source, agreement; see OpenCall); nothing to
    unscale: master weights and optimizer states are true values."""
    return OpenCall(
        adapters.enter(model),
        name=name,
        streaming=streaming,
        kind=kind,
        params=params,
        bucket_bytes=bucket_bytes,
        plan=plan,
        policy=policy,
        dispatcher=dispatcher,
        optimizer=optimizer,
        extra=_key_field(kind),
        model_parallel=model_parallel,
    )


def _key_field(state: StateKind) -> Callable[[Source], Sequence[Field]]:
    """The state's key, compared between ranks (and checked: a non-empty string)."""

    def extra(source: Source) -> Sequence[Field]:
        if not isinstance(state, OptimizerState):
            return []
        return [Field("optimizer state key", stable_hash(state.key), shown=False)]

    return extra
