"""collgrad: the partitioned training state of DeepSpeed ZeRO and FSDP2, whole and model-wide, in one
collective per bucket; and coalesced collectives on any mix of backends.

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
from collgrad.checkpoint.background import PendingSave, async_save_training_state
from collgrad.checkpoint.convert import Converted, convert_deepspeed_checkpoint
from collgrad.checkpoint.load import LoadedModel, load_full_model
from collgrad.checkpoint.save import SavedModel, save_full_model
from collgrad.checkpoint.training import (
    LoadedTrainingState,
    SavedTrainingState,
    load_training_state,
    save_training_state,
)
from collgrad.core.dispatch import Dispatcher, default_dispatcher
from collgrad.core.record import BucketRecord, CallRecord
from collgrad.errors import (
    AgreementError,
    ArgumentMismatchError,
    CheckpointError,
    CollgradError,
    CollgradTimeoutError,
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
from collgrad.state.hook import PreStepHook, register_pre_step_hook
from collgrad.state.read import FullGrads, FullState, FullStateStream, iter_full_model_grads, safe_get_full_model_grads
from collgrad.state.record import StateRecord
from collgrad.state.state import (
    iter_full_model_fp32_params,
    iter_full_model_optimizer_states,
    safe_get_full_model_fp32_params,
    safe_get_full_model_optimizer_states,
    safe_set_full_model_fp32_params,
    safe_set_full_model_optimizer_states,
)
from collgrad.state.stats import GradStat, GradStats, safe_get_full_model_grad_stats
from collgrad.state.write import safe_set_full_model_grads, safe_update_full_model_grads

__version__ = "0.1.0"

__all__ = [
    # Gradients, between the boundary backward() and step()
    "safe_get_full_model_grads",
    "iter_full_model_grads",
    "safe_set_full_model_grads",
    "safe_update_full_model_grads",
    "safe_get_full_model_grad_stats",
    "register_pre_step_hook",
    # The rest of the training state, at any time outside step()
    "safe_get_full_model_fp32_params",
    "iter_full_model_fp32_params",
    "safe_set_full_model_fp32_params",
    "safe_get_full_model_optimizer_states",
    "iter_full_model_optimizer_states",
    "safe_set_full_model_optimizer_states",
    # Consolidated checkpoints: written, and read back into any layout
    "save_full_model",
    "load_full_model",
    # The whole training state: saved once, resumed at any world size, stage or framework
    "save_training_state",
    "async_save_training_state",
    "load_training_state",
    "convert_deepspeed_checkpoint",
    # What those calls return
    "FullState",
    "FullGrads",
    "FullStateStream",
    "StateRecord",
    "GradStats",
    "GradStat",
    "PreStepHook",
    "SavedModel",
    "LoadedModel",
    "SavedTrainingState",
    "LoadedTrainingState",
    "PendingSave",
    "Converted",
    # Coalesced collectives
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "capabilities",
    "Dispatcher",
    "Policy",
    "Op",
    "Primitive",
    "CallRecord",
    "BucketRecord",
    # Errors: every one a CollgradError, raised on every rank together
    "CollgradError",
    "InvalidArgumentError",
    "UnknownParameterError",
    "ArgumentMismatchError",
    "NotReadyError",
    "NotInitializedError",
    "LayoutChangedError",
    "PreStepHookError",
    "RankFailedError",
    "CollgradTimeoutError",
    "CheckpointError",
    "NoBackendError",
    "NoPrimitiveError",
    "AgreementError",
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
    bucket, without that copy. Waits are bounded (COLLGRAD_TIMEOUT) and raise CollgradTimeoutError.
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
