"""Every torch-version difference collgrad depends on, each with the reason it exists; and the one
CPython behaviour it works around (``uncollected``).

collgrad requires torch 2.13 (pyproject.toml), the release every leg of its test matrix runs. The
checks here also keep what releases back to 2.1 need (the first whose ``_coalescing_manager`` fast
path and ``ProcessGroup.allreduce_coalesced`` work for NCCL as well as Gloo, pytorch PR #98793),
untested: widen the requirement only when a leg tests such a release. Nothing outside this module
looks at ``torch.__version__`` or probes torch for an attribute.
"""

from __future__ import annotations

import functools
import gc
from typing import Any, Callable, Iterable, ParamSpec, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch._C._distributed_c10d import PrefixStore as PrefixStore  # re-exported: launch's rendezvous
from torch._C._distributed_c10d import Store as Store  # re-exported: the type of default_store()
from torch.distributed import ProcessGroup, ReduceOp

from collgrad.errors import NotInitializedError

__all__ = [
    "default_group_or_none",
    "TORCH_VERSION",
    "torch_version_at_least",
    "rank",
    "default_group",
    "group_ranks",
    "backend_name",
    "agreement_device",
    "all_reduce",
    "all_gather_flat",
    "all_gather_list",
    "all_to_all",
    "allreduce_coalesced",
    "all_gather_coalesced",
    "gloo_has_all_gather_coalesced",
    "default_store",
    "group_key",
    "xccl_available",
    "xpu_available",
    "vector_norms",
    "uncollected",
    "maker",
]


def _parse_version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION: tuple[int, int] = _parse_version(torch.__version__)


def torch_version_at_least(major: int, minor: int) -> bool:
    return TORCH_VERSION >= (major, minor)


def rank() -> int:
    """This process's global rank, or 0 before ``init_process_group`` (for error messages)."""
    return dist.get_rank() if dist.is_initialized() else 0


def default_group() -> ProcessGroup:
    """The WORLD group. ``dist.group.WORLD`` is the public spelling; it is None before init."""
    group = dist.group.WORLD
    if group is None:
        raise NotInitializedError(
            f"rank {rank()}: torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(or collgrad.launch.init_from_environment()) on every rank first"
        )
    return group


def default_group_or_none() -> ProcessGroup | None:
    """The WORLD group, or None where torch.distributed is not initialized (one process)."""
    return dist.group.WORLD if dist.is_initialized() else None


def group_ranks(group: ProcessGroup) -> list[int]:
    """Global ranks of ``group`` in group-rank order (``get_process_group_ranks`` exists since 2.0)."""
    return list(dist.get_process_group_ranks(group))


def backend_name(group: ProcessGroup, device_type: str) -> str | None:
    """Name of the backend that serves ``device_type`` in ``group``, or None if there is none.

    Since 2.0 a ProcessGroup holds one Backend per device type (pytorch PR #88330), so a group made
    with ``"cpu:gloo,cuda:nccl"`` answers differently per device. ``_get_backend`` raises
    RuntimeError("No backend type associated with device type ...") where there is none.
    ``pg._get_backend_name()`` returns one name for the whole group, so it is not used.
    """
    try:
        backend = group._get_backend(torch.device(device_type))
    except RuntimeError:
        return None
    try:
        return str(backend.name()).lower()
    except (AttributeError, RuntimeError):
        pass
    # Older Backend bindings without name(): parse "cpu:gloo,cuda:nccl" (or a bare "gloo").
    spec = str(dist.get_backend(group)).lower()
    if ":" not in spec:
        return spec
    for part in spec.split(","):
        dev, _, name = part.partition(":")
        if dev.strip() == device_type:
            return name.strip()
    return None


def xccl_available() -> bool:
    """torch's native XCCL backend (XPU builds from 2.8); ``is_xccl_available`` is missing before."""
    return bool(getattr(dist, "is_xccl_available", lambda: False)())


def xpu_available() -> bool:
    """An XPU device is usable; ``torch.xpu`` itself is missing from some older builds."""
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def agreement_device(device_type: str) -> torch.device:
    """The device on which a small collective of ``device_type``'s backend can run on this rank.

    NCCL and XCCL need the rank's *current* device, not device 0, or two ranks on one host would
    both use GPU 0.
    """
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device_type == "xpu":
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device(device_type)


def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType, group: ProcessGroup) -> dist.Work:
    work: dist.Work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return work


# torch 2.13 renamed all_gather_into_tensor to all_gather_single; the old name still works but emits a
# FutureWarning on every call (pytorch PR #186123), so use the new name where it exists.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_flat(output: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> dist.Work:
    """One all-gather of ``inp`` into ``output`` (world_size * inp.numel() elements, rank-major)."""
    work: dist.Work = _all_gather_single(output, inp, group=group, async_op=True)
    return work


def all_to_all(
    output: torch.Tensor, inp: torch.Tensor, received: Sequence[int], sent: Sequence[int], group: ProcessGroup
) -> dist.Work:
    """One all-to-all of 1-D ``inp`` (``sent[d]`` elements to rank d of ``group``, back to back) into
    ``output`` (``received[s]`` from rank s, back to back), started: the caller waits on the Work. Gloo
    (CPU), NCCL, MPI and XCCL all take split sizes (``alltoall_base``)."""
    work: dist.Work | None = dist.all_to_all_single(output, inp, list(received), list(sent), group=group, async_op=True)
    assert work is not None, "async_op returns a Work"
    return work


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup) -> dist.Work:
    """``tensor`` from global rank ``src`` to every rank of ``group``, started: the caller waits on the
    Work. Every backend implements it."""
    work: dist.Work | None = dist.broadcast(tensor, src=src, group=group, async_op=True)
    assert work is not None, "async_op returns a Work"
    return work


def all_gather_list(outputs: list[torch.Tensor], inp: torch.Tensor, group: ProcessGroup) -> dist.Work:
    """The list form of all-gather: every backend implements it, torch's MPI backend included.

    The process group's own ``allgather``, as ``dist.all_gather`` calls it: the wrapper's checks, its
    logging decorators and its group lookup cost ~40-90 us a call (2.13, Gloo, two local ranks;
    ``docs/benchmarks.md``), and every collgrad call makes one such all-gather, its readiness check.
    ``group`` always holds this rank; complex tensors go as real views, as the wrapper sends them."""
    if inp.is_complex():
        inp, outputs = torch.view_as_real(inp), [torch.view_as_real(t) for t in outputs]
    opts = AllgatherOptions()
    if hasattr(opts, "asyncOp"):  # 2.9+: as allreduce_coalesced says
        opts.asyncOp = True
    work: dist.Work = group.allgather([outputs], [inp], opts)
    return work


def allreduce_coalesced(group: ProcessGroup, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> dist.Work:
    """One ``ProcessGroup.allreduce_coalesced`` call.

    This is the call the ``_coalescing_manager`` fast path makes; unlike the deprecated
    ``dist.all_reduce_coalesced`` it returns a Work and emits no FutureWarning (2.13), and
    the c10d maintainers state it will not be deprecated (pytorch PR #151243).
    """
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = op  # type: ignore[assignment]  # the stubs call the field ReduceOp; it takes a RedOpType
    if hasattr(opts, "asyncOp"):  # 2.9+: without it some backends block inside the call.
        opts.asyncOp = True
    return group.allreduce_coalesced(list(tensors), opts)


def all_gather_coalesced(
    group: ProcessGroup, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> dist.Work:
    """One coalesced all-gather into single output tensors.

    2.13 renamed ``allgather_into_tensor_coalesced`` to ``all_gather_single_coalesced`` and kept the
    old name as a deprecated alias (pytorch PRs #186130, #186144).
    """
    opts = AllgatherOptions()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    method = getattr(group, "all_gather_single_coalesced", None) or group.allgather_into_tensor_coalesced
    return method(list(outputs), list(inputs), opts)


def gloo_has_all_gather_coalesced() -> bool:
    """Gloo implements ``allgather_into_tensor_coalesced`` since about 2.3 (pytorch PR #118910)."""
    return torch_version_at_least(2, 3)


def default_store() -> Store:
    """The key-value store the default group was created with: an out-of-band channel between ranks
    that needs no collective. Private in torch (``_get_default_store``) since 1.x, still there in 2.13."""
    store: Store = dist.distributed_c10d._get_default_store()
    return store


def group_key(group: ProcessGroup) -> str:
    """A name for ``group`` that is the same on every rank (``group_name`` since 2.0)."""
    name = getattr(group, "group_name", None)
    return str(name) if name else "-".join(map(str, group_ranks(group)))


def vector_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, accumulated in fp32 at least (as torch's norm of an fp32 gradient
    is), in one call where the tensors share a dtype. ``torch._foreach_norm`` is private
    (``clip_grad_norm_`` calls it); public torch has only the per-tensor ``vector_norm``, a dispatch
    per tensor (docs/notes/timings.md). Its ``dtype`` argument came in 2.3."""
    dtypes = {t.dtype for t in tensors}
    foreach = getattr(torch, "_foreach_norm", None)
    if len(dtypes) == 1 and foreach is not None and torch_version_at_least(2, 3):
        return list(foreach(list(tensors), 2, dtype=torch.promote_types(dtypes.pop(), torch.float32)))
    return [torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def uncollected(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run with CPython's cyclic garbage collector paused (where it was running), for a planner
    that builds hundreds of thousands of small tuples and no reference cycle. CPython (3.11) starts a
    collection every 700 new tuples, and a full one each time the objects that outlived collections
    grow by a quarter, walking every object the process holds: for the plans of a 40,000-tensor
    training state at 1,024 ranks that was half the planning time (1.7 s of 3.3 s, measured with
    ``python -m collgrad simulate``). Also around the synchronous jobs whole (save_training_state,
    load_training_state, save_full_model, load_full_model: their agreements are bounded waits), whose
    adapters, manifests and executors make as many: inside 2 FSDP2 ranks of a 40,000-tensor model,
    whose heap holds 2.4 million objects, ~1,000 collections took 1.5-3.3 s of a 6-12 s save or load
    (not async_save_training_state's thread, which runs beside the training). The collector is
    process-wide: another thread's cycles wait for the planner's return, when it runs again; a thread
    that pauses it while a planner runs finds it running again after (its own pause must be
    ``gc.disable()`` again)."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not gc.isenabled():  # paused already: by an outer planner, or by the program
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


_T = TypeVar("_T", bound=tuple[Any, ...])


def maker(cls: type[_T]) -> Callable[[Iterable[Any]], _T]:
    """What makes a ``cls`` (a NamedTuple) from every one of its fields in order, in C: CPython's
    ``NamedTuple.__new__`` and ``_make`` are Python functions (a frame a tuple, a third of its making),
    and a planner makes one a tensor (160,000 for a 3.9B-parameter training state). Nothing checked:
    the caller gives every field, defaults included."""
    return functools.partial(tuple.__new__, cls)
