"""One implementation per primitive that runs over torch.distributed. Each method issues its
collective calls asynchronously and returns one handle per call issued, so the dispatcher can count
collectives and keep two buckets in flight. mpi4py's channel lives in backends/mpi.py (the only module
that imports mpi4py); ``make_channel`` builds every channel, that one included.

Every tensor handed to these is contiguous (the dispatcher guarantees it): Gloo's plain collectives
on a strided view with gaps read and write the wrong memory (backends/gloo.py), and XCCL's coalesced
call does not check (backends/ccl.py).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from collgrad import _compat
from collgrad.backends.mpi import Mpi4pyChannel, MpiComm, MpiLink
from collgrad.backends.ops import Primitive
from collgrad.backends.waits import wait_work
from collgrad.errors import CollgradError

__all__ = ["Handle", "TorchHandle", "Channel", "FlatChannel", "CoalescedChannel", "PerTensorChannel", "make_channel"]


class Handle(Protocol):
    def wait(self, timeout_s: float, what: str, watch: Callable[[], None] | None = None) -> None:
        """Block until the call completes, at most ``timeout_s``; raise CollgradTimeoutError naming ``what``.
        ``watch`` may be run while waiting and raises to abandon the wait."""


class TorchHandle:
    """A torch.distributed Work, waited on with a bound."""

    __slots__ = ("work", "sliced")

    def __init__(self, work: dist.Work, sliced: bool) -> None:
        self.work = work
        self.sliced = sliced  # the backend tolerates waiting again after a timed-out wait (Gloo)

    def wait(self, timeout_s: float, what: str, watch: Callable[[], None] | None = None) -> None:
        wait_work(self.work, timeout_s, what, watch if self.sliced else None)


class Channel(Protocol):
    primitive: Primitive

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> Sequence[Handle]: ...

    def all_gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Sequence[Handle]: ...


class _TorchChannel:
    def __init__(self, group: ProcessGroup, backend: str) -> None:
        self.group = group
        self.sliced = backend == "gloo"

    def _handle(self, work: dist.Work) -> TorchHandle:
        return TorchHandle(work, self.sliced)


class FlatChannel(_TorchChannel):
    """One call on one packed buffer (``tensors``/``inputs`` hold exactly one tensor)."""

    primitive = Primitive.FLAT

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> list[TorchHandle]:
        (flat,) = tensors
        return [self._handle(_compat.all_reduce(flat, op, self.group))]

    def all_gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[TorchHandle]:
        (out,), (inp,) = outputs, inputs
        return [self._handle(_compat.all_gather_flat(out, inp, self.group))]


class CoalescedChannel(_TorchChannel):
    """The backend's coalesced call over the bucket's tensors, unpacked: one call."""

    primitive = Primitive.COALESCED

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> list[TorchHandle]:
        return [self._handle(_compat.allreduce_coalesced(self.group, tensors, op))]

    def all_gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[TorchHandle]:
        return [self._handle(_compat.all_gather_coalesced(self.group, outputs, inputs))]


class PerTensorChannel(_TorchChannel):
    """The reference path: one call per tensor, all issued before any is waited on."""

    primitive = Primitive.PER_TENSOR

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: ReduceOp.RedOpType) -> list[TorchHandle]:
        return [self._handle(_compat.all_reduce(t, op, self.group)) for t in tensors]

    def all_gather(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[TorchHandle]:
        world = self.group.size()
        return [
            self._handle(_compat.all_gather_list(list(out.view(world, -1).unbind(0)), inp, self.group))
            for out, inp in zip(outputs, inputs)
        ]


_TORCH_CHANNELS: dict[Primitive, Callable[[ProcessGroup, str], Channel]] = {
    Primitive.FLAT: FlatChannel,
    Primitive.COALESCED: CoalescedChannel,
    Primitive.PER_TENSOR: PerTensorChannel,
}


def make_channel(
    primitive: Primitive, group: ProcessGroup, backend: str, mpi: MpiLink | None = None, mpi_comm: MpiComm | None = None
) -> Channel:
    """The one place channels are built: torch.distributed primitives over ``group``'s ``backend``, or
    mpi4py over ``mpi_comm`` (the communicator the registry built for the group)."""
    if primitive is Primitive.MPI4PY:
        if mpi is None or mpi_comm is None:
            raise CollgradError(f"rank {_compat.rank()}: mpi4py was chosen but no MPI communicator was built")
        return Mpi4pyChannel(mpi, mpi_comm)
    return _TORCH_CHANNELS[primitive](group, backend)
