"""MPI, twice: torch's own ``mpi`` backend (a table of what it can do) and mpi4py (a primitive of its
own that runs beside any torch backend). This is the only module that imports mpi4py.

torch's ``mpi`` backend (ProcessGroupMPI; pip wheels of torch are built without it):
- no ``allreduce_coalesced`` ("not supported with MPI", every version) and no coalescing;
- ``_allgather_base`` exists in some versions only, so all-gathers use the list form;
- counts are C ``int`` filled from ``numel()`` without a check: above 2**31-1 elements the count
  goes negative and MPI fails, at 2**32+k only k elements are reduced *silently*. Buckets and
  chunks are therefore limited to INT32_MAX elements;
- fp16/bf16 (and AVG) fail with "IndexError: map::at" unless the build maps MPIX types (pytorch
  issue #139178, PR #170074), so they are offered to mpi4py or upcast instead.

mpi4py (docs/notes/backend-capabilities.md, measured here with MPICH 5):
- one ``Allreduce`` of a flat host buffer is the fastest CPU primitive measured (faster than Gloo's
  ring on two ranks; figures in docs/notes/timings.md);
- MPICH 5 defines ``MPI.FLOAT16_T`` but ``MPI.BFLOAT16_T`` is MPI_DATATYPE_NULL: a bf16 buffer then
  fails with "Invalid MPI_Op", so bf16 is only offered where the library defines the type;
- MPI-4 libraries take large counts (``MPI_Allreduce_c``); older ones raise rather than truncate,
  so collgrad limits them to INT32_MAX elements;
- CUDA buffers need a CUDA-aware MPI and mpi4py cannot ask the library: set
  ``COLLGRAD_MPI_CUDA_AWARE=1`` to allow them;
- importing mpi4py initializes MPI, so it is imported only in processes started by an MPI launcher.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.distributed import ReduceOp

from collgrad.backends.base import INT32_MAX, UNLIMITED, LocalFinding, Reason
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.waits import poll_until

#: mpi4py's objects enter untyped: mpi4py is optional, imported lazily (only under an MPI launcher) and
#: not installed where mypy runs. The module, its communicators, requests and datatypes:
MpiModule = Any  # mpi4py.MPI
MpiComm = Any  # an MPI.Intracomm: COMM_WORLD, or one built for a torch group (MpiLink.communicator)
MpiRequest = Any  # an MPI.Request of a nonblocking collective
MpiDatatype = Any  # an MPI.Datatype

NAME = "mpi"
ENV_CUDA_AWARE = "COLLGRAD_MPI_CUDA_AWARE"
#: (rank, size) variables that MPI launchers set in the processes they start: MPICH/Intel MPI hydra,
#: Open MPI, PMIx launchers such as srun --mpi=pmix, MVAPICH. Every launcher fact of collgrad is here.
RANK_SIZE_VARS = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
LAUNCHER_VARS = tuple(rank for rank, _ in RANK_SIZE_VARS)
#: The rank within the node: MPICH/Intel MPI hydra, Open MPI, MVAPICH.
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")


def rank_and_size(env: Mapping[str, str]) -> tuple[str, str] | None:
    """The (rank, world size) an MPI launcher gave this process, or None if none started it."""
    for rank_var, size_var in RANK_SIZE_VARS:
        if rank_var in env and size_var in env:
            return env[rank_var], env[size_var]
    return None


def local_rank(env: Mapping[str, str]) -> str:
    """This process's rank on its node as the MPI launcher says, "0" if it says nothing."""
    return next((env[v] for v in LOCAL_RANK_VARS if v in env), "0")


_TORCH_MPI_DTYPES = frozenset({torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64})


def torch_mpi_finding(device_type: str, op: Op, primitive: Primitive, dtype: torch.dtype) -> LocalFinding:
    """What torch's own ``mpi`` backend can carry."""
    if device_type != "cpu":
        return LocalFinding(Reason.DEVICE_UNSUPPORTED, detail="torch's mpi backend: cpu tensors only here")
    if primitive is Primitive.COALESCED:
        return LocalFinding(Reason.BACKEND_LACKS, detail="allreduce_coalesced is not supported with MPI")
    if primitive is Primitive.FLAT and op is Op.ALL_GATHER:
        return LocalFinding(Reason.BACKEND_LACKS, detail="_allgather_base exists in some torch versions only")
    if dtype not in _TORCH_MPI_DTYPES:
        return LocalFinding(Reason.DTYPE_UNSUPPORTED, detail="fp16/bf16 raise 'map::at' (pytorch #139178)")
    return LocalFinding(Reason.OK, max_elements=INT32_MAX)


@dataclass(frozen=True)
class MpiState:
    """This rank's view of MPI, shared with the group in the agreement collective."""

    reason: Reason
    rank: int = -1
    size: int = -1
    #: Random number drawn by MPI rank 0 and broadcast over the MPI job; equal tokens prove that the
    #: ranks of a torch group belong to one MPI job. 0 while unknown.
    token: int = 0
    large_counts: bool = False
    detail: str = ""


class MpiLink:
    """mpi4py on this rank: imported lazily, communicators built per group, calls counted by the caller."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if environ is None else environ
        self._mpi: MpiModule = None  # mpi4py.MPI once _import() succeeded, else None
        self._import_error: str | None = None
        self._token = 0

    # -- local state ------------------------------------------------------------------------------
    def launched(self) -> bool:
        return any(var in self._env for var in LAUNCHER_VARS)

    def _import(self) -> MpiModule | None:
        if self._mpi is None and self._import_error is None:
            try:
                from mpi4py import MPI  # the one import of mpi4py in collgrad
            except Exception as exc:  # ImportError, or the MPI library failing to load
                self._import_error = f"{type(exc).__name__}: {exc}"
            else:
                self._mpi = MPI
        return self._mpi

    def state(self, *, group_is_world: bool, group_size: int) -> MpiState:
        """Local state; may run one MPI broadcast over the MPI job (see ``job_token``)."""
        if not self.launched():
            return MpiState(Reason.NOT_LAUNCHED, detail=f"none of {LAUNCHER_VARS} is set")
        mpi = self._import()
        if mpi is None:
            return MpiState(Reason.NOT_INSTALLED, detail=str(self._import_error))
        comm = mpi.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        if group_is_world and size == group_size:
            self.job_token()
        return MpiState(Reason.OK, rank=rank, size=size, token=self._token, large_counts=mpi.Get_version() >= (4, 0))

    def job_token(self) -> int:
        """A number shared by the whole MPI job, drawn once by MPI rank 0.

        Collective over MPI_COMM_WORLD: only called while the torch WORLD group is being probed and
        has as many ranks as the MPI job, so every process of the job is making the same call.
        """
        if not self._token:
            mpi = self._mpi
            mine = random.SystemRandom().randrange(1, 2**62) if mpi.COMM_WORLD.Get_rank() == 0 else 0
            self._token = int(mpi.COMM_WORLD.bcast(mine, root=0))
        return self._token

    def datatype(self, dtype: torch.dtype) -> MpiDatatype | None:
        mpi = self._mpi
        table = {
            torch.float32: mpi.FLOAT,
            torch.float64: mpi.DOUBLE,
            torch.int8: mpi.INT8_T,
            torch.uint8: mpi.UINT8_T,
            torch.int32: mpi.INT32_T,
            torch.int64: mpi.INT64_T,
            torch.float16: getattr(mpi, "FLOAT16_T", mpi.DATATYPE_NULL),
            torch.bfloat16: getattr(mpi, "BFLOAT16_T", mpi.DATATYPE_NULL),
        }
        found = table.get(dtype, mpi.DATATYPE_NULL)
        return None if found == mpi.DATATYPE_NULL else found

    def finding(self, state: MpiState, device_type: str, op: Op, dtype: torch.dtype) -> LocalFinding:
        if state.reason is not Reason.OK:
            return LocalFinding(state.reason, detail=state.detail)
        if device_type == "cuda":
            if self._env.get(ENV_CUDA_AWARE, "") not in ("1", "true", "yes"):
                return LocalFinding(
                    Reason.DEVICE_UNSUPPORTED,
                    detail=f"CUDA-awareness of the MPI library is unknown; set {ENV_CUDA_AWARE}=1 if it is",
                )
        elif device_type != "cpu":
            return LocalFinding(Reason.DEVICE_UNSUPPORTED, detail="mpi4py: cpu (and CUDA-aware cuda) only")
        if self.datatype(dtype) is None:
            return LocalFinding(Reason.DTYPE_UNSUPPORTED, detail=f"no MPI datatype for {dtype} in this MPI library")
        return LocalFinding(Reason.OK, max_elements=UNLIMITED if state.large_counts else INT32_MAX)

    # -- communicators ------------------------------------------------------------------------------
    def communicator(self, mpi_ranks: Sequence[int], torch_ranks: Sequence[int]) -> MpiComm | None:
        """An MPI communicator whose rank i is the process at torch group rank i, or None.

        Collective over the members only (MPI_Comm_create_group). The result is checked with one
        small allgather of every member's torch global rank: every member sees the same list and so
        reaches the same verdict.
        """
        mpi = self._mpi
        world = mpi.COMM_WORLD
        if list(mpi_ranks) == list(range(world.Get_size())):
            comm = world.Dup()
        else:
            group = world.Get_group().Incl(list(mpi_ranks))
            comm = world.Create_group(group)
            group.Free()
        seen = comm.allgather(torch.distributed.get_rank())
        if seen != list(torch_ranks):
            comm.Free()
            return None
        return comm


_MPI_OPS = {"SUM": "SUM", "MAX": "MAX", "MIN": "MIN", "PRODUCT": "PROD"}


class _MpiHandle:
    """A nonblocking MPI request (and the buffers it uses), polled with a bound: MPI has no wait with
    a timeout, and a blocking call could never give up on a rank that does not join."""

    __slots__ = ("request", "buffers")

    def __init__(self, request: MpiRequest, *buffers: torch.Tensor) -> None:
        self.request = request
        self.buffers = buffers  # alive until the request completes

    def wait(self, timeout_s: float, what: str, watch: Callable[[], None] | None = None) -> None:
        poll_until(self.request.Test, timeout_s, what, watch)


class Mpi4pyChannel:
    """The MPI4PY primitive: one collective on one flat, contiguous buffer.

    One request per bucket (per-tensor Iallreduce + Waitall was the slowest MPI option measured). A
    CUDA buffer is synchronized before MPI reads it (mpi4py cannot do it).
    """

    primitive = Primitive.MPI4PY

    def __init__(self, link: MpiLink, comm: MpiComm) -> None:
        self._link = link
        self._comm = comm
        self._mpi = link._mpi

    def _buf(self, tensor: torch.Tensor) -> list[torch.Tensor | MpiDatatype]:
        """mpi4py's buffer specification: [buffer, datatype]."""
        assert tensor.is_contiguous()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        return [tensor, self._link.datatype(tensor.dtype)]

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> list[_MpiHandle]:
        (flat,) = tensors
        name = _MPI_OPS[_op_name(op)]
        request = self._comm.Iallreduce(self._mpi.IN_PLACE, self._buf(flat), op=getattr(self._mpi, name))
        return [_MpiHandle(request, flat)]

    def all_gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[_MpiHandle]:
        (out,), (inp,) = outputs, inputs
        return [_MpiHandle(self._comm.Iallgather(self._buf(inp), self._buf(out)), inp, out)]


def _op_name(op: ReduceOp.RedOpType) -> str:
    for name in _MPI_OPS:
        if op == getattr(ReduceOp, name):
            return name
    raise ValueError(f"mpi4py path cannot apply {op}")


def publish_address() -> tuple[str, str]:
    """MPI rank 0's host name and a free TCP port, broadcast over MPI_COMM_WORLD.

    Collective over the MPI job: called by ``launch.init_from_environment`` on every rank of a job
    started by an MPI launcher without MASTER_ADDR. ``MASTER_PORT`` from the environment wins.
    """
    import socket

    mpi = MpiLink()._import()
    if mpi is None:
        raise RuntimeError(
            "started by an MPI launcher without MASTER_ADDR, and mpi4py cannot be imported: "
            "pip install 'collgrad[mpi]', or set MASTER_ADDR/MASTER_PORT"
        )
    comm = mpi.COMM_WORLD
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = os.environ.get("MASTER_PORT") or str(sock.getsockname()[1])
        address = (socket.gethostname(), port)
    host, port = comm.bcast(address, root=0)
    return host, port
