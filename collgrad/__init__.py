"""collgrad: coalesced collectives and full-model gradients for DeepSpeed ZeRO, one collective per bucket.

Dependency rule: torch is the only hard dependency. Only ``collgrad.backends.mpi`` imports mpi4py
(lazily, under an MPI launcher); only the DeepSpeed adapter imports deepspeed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed import ProcessGroup, ReduceOp

from collgrad.backends.decide import Capabilities
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.backends.registry import Registry
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.core.record import BucketRecord, CallRecord, Decision
from collgrad.errors import (
    AgreementError,
    ArgumentMismatchError,
    CollgradError,
    CollgradTimeout,
    InvalidArgumentError,
    LayoutChangedError,
    NoBackendError,
    NoPrimitiveError,
    NotInitializedError,
    NotReadyError,
    PolicyError,
    PreStepHookError,
    RankFailedError,
    UnknownParameterError,
)
from collgrad.state import (
    FullGradRecord,
    FullGrads,
    FullGradStream,
    GradStat,
    GradStats,
    GroupRecord,
    PreStepHook,
    SavedModel,
    iter_full_model_fp32_params,
    iter_full_model_grads,
    iter_full_model_optimizer_states,
    model_grad_stats,
    register_pre_step_hook,
    safe_get_full_model_fp32_params,
    safe_get_full_model_grads,
    safe_get_full_model_optimizer_states,
    safe_set_full_model_fp32_params,
    safe_set_full_model_grads,
    safe_set_full_model_optimizer_states,
    save_full_model,
    update_full_model_grads,
)

__version__ = "0.1.0"

__all__ = [
    "save_full_model",
    "SavedModel",
    "safe_get_full_model_fp32_params",
    "iter_full_model_fp32_params",
    "safe_get_full_model_optimizer_states",
    "iter_full_model_optimizer_states",
    "safe_set_full_model_fp32_params",
    "safe_set_full_model_optimizer_states",
    "register_pre_step_hook",
    "PreStepHook",
    "PreStepHookError",
    "RankFailedError",
    "NotInitializedError",
    "safe_get_full_model_grads",
    "iter_full_model_grads",
    "model_grad_stats",
    "safe_set_full_model_grads",
    "update_full_model_grads",
    "GradStats",
    "GradStat",
    "FullGrads",
    "FullGradStream",
    "FullGradRecord",
    "GroupRecord",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "capabilities",
    "default_dispatcher",
    "Dispatcher",
    "Registry",
    "Policy",
    "Capabilities",
    "CallRecord",
    "BucketRecord",
    "Decision",
    "Op",
    "Primitive",
    "CollgradError",
    "CollgradTimeout",
    "InvalidArgumentError",
    "UnknownParameterError",
    "ArgumentMismatchError",
    "NotReadyError",
    "LayoutChangedError",
    "NoBackendError",
    "AgreementError",
    "NoPrimitiveError",
    "PolicyError",
]


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    *,
    bucket_bytes: int | None = None,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    atomic: bool = True,
) -> CallRecord:
    """All-reduce ``tensors`` in place, one collective per bucket; returns what it did.

    Call on every rank of ``group`` (default: WORLD) with tensors of the same shapes, dtypes and device
    types in the same order, after ``init_process_group``. Tensors may mix dtypes and devices, be
    non-contiguous or empty. ``bucket_bytes`` caps each bucket's buffer (default 25 MiB). The first
    call for a (group, device type) runs one small collective to agree on capabilities.

    ``atomic`` (default): the tensors are written only after every bucket has completed, so an error
    leaves them as they were (one more copy of each); ``atomic=False`` reduces in place bucket by
    bucket, without that copy. Waits are bounded (COLLGRAD_TIMEOUT) and raise CollgradTimeout.
    """
    return (dispatcher or default_dispatcher()).all_reduce(
        tensors, group, op, bucket_bytes=bucket_bytes, policy=policy, atomic=atomic
    )


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    bucket_bytes: int | None = None,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
    atomic: bool = True,
) -> CallRecord:
    """All-gather each ``inputs[i]`` into ``outputs[i]`` (``world_size * inputs[i].numel()`` elements,
    rank-major, as ``all_gather_into_tensor``), one collective per bucket; returns what it did.

    Same calling rules as ``all_reduce_coalesced``; ``bucket_bytes`` caps the gathered buffer.
    """
    return (dispatcher or default_dispatcher()).all_gather(
        outputs, inputs, group, bucket_bytes=bucket_bytes, policy=policy, atomic=atomic
    )


def capabilities(
    device_type: str = "cpu", group: ProcessGroup | None = None, policy: Policy | None = None
) -> Capabilities:
    """The agreed capabilities of ``group`` for ``device_type`` tensors. Collective on first use."""
    return default_dispatcher().registry.capabilities(device_type, group, policy)
