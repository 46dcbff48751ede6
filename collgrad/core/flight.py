"""One bucket in flight: copy in, one collective (or one per tensor), copy out.

The dispatcher starts a bucket (``start``), keeps at most two in flight, and finishes each
(``finish``: wait, then unpack). Every tensor a channel is handed is contiguous, except where the
plan is *strided* (``Prepared.strided``): the group agreed that its backend lays a coalesced gather
out into strided outputs itself (``Capabilities.strided_gather``), so those tensors go as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from collgrad import _compat
from collgrad.backends.ops import Op, Primitive
from collgrad.core.buffers import adjacent_view
from collgrad.core.failures import BucketFailures
from collgrad.core.plan import Bucket, Plan
from collgrad.core.primitives import Channel, Handle
from collgrad.core.record import BucketRecord
from collgrad.errors import RankFailedError

__all__ = ["InFlight", "Work", "start", "finish", "record"]


@dataclass
class InFlight:
    bucket: Bucket
    handles: Sequence[Handle]
    buffers: tuple[torch.Tensor, ...]
    in_place: bool = False  # the packed buffer *is* the working memory: nothing to unpack
    fallback: str = ""  # why this bucket went per tensor after its primitive raised on every rank


class Work:
    """A tensor as the dispatcher sees it: a contiguous flat view, or a contiguous copy that is written
    back once all buckets are done: for strided tensors (never hand a gapped view to a backend) and,
    with ``private``, for every tensor (atomic calls). ``fill``: the copy starts with the tensor's values.
    ``strided``: the tensor as it is (``flat`` is None), for a backend that lays strided outputs out."""

    def __init__(self, tensor: torch.Tensor, private: bool = False, fill: bool = True, strided: bool = False) -> None:
        self.tensor = tensor
        self.copied = not strided and (private or not tensor.is_contiguous())
        self.flat: torch.Tensor | None
        if strided:
            self.flat = None
        elif not self.copied:
            self.flat = tensor.view(-1)
        elif fill:  # contiguous() of a strided tensor already copies (reshape could return a gapped view)
            self.flat = tensor.contiguous().view(-1) if not tensor.is_contiguous() else tensor.view(-1).clone()
        else:
            self.flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)

    @property
    def whole(self) -> torch.Tensor:
        """What a channel is handed for the whole tensor."""
        return self.tensor if self.flat is None else self.flat

    def write_back(self) -> None:
        if self.copied:
            assert self.flat is not None
            self.tensor.copy_(self.flat.view(self.tensor.shape))


def start(
    op: Op,
    bucket: Bucket,
    channel: Channel,
    src: list[Work],
    dst: list[Work],
    reduce_op: ReduceOp.RedOpType | None,
    world: int,
) -> InFlight:
    """Issue ``bucket``'s collective(s) on ``channel``; nothing is waited for."""
    if op is Op.ALL_REDUCE:
        return _start_reduce(bucket, channel, src, reduce_op)
    return _start_gather(bucket, channel, src, dst, world)


def _wire(op: ReduceOp.RedOpType | None) -> ReduceOp.RedOpType:
    # AVG travels as SUM and is divided here: torch's MPI backend, oneCCL and mpi4py have no AVG, and one
    # home for the division keeps every primitive's result the same.
    return ReduceOp.SUM if op == ReduceOp.AVG or op is None else op


def _segment_views(bucket: Bucket, works: list[Work]) -> list[torch.Tensor]:
    """The part of its tensor that each segment of ``bucket`` covers (contiguous 1-D views; a strided
    tensor, always whole in its bucket, as it is)."""
    out = []
    for s in bucket.segments:
        flat = works[s.tensor].flat
        if flat is None:
            assert s.tensor_offset == 0 and s.numel == works[s.tensor].tensor.numel(), "a strided tensor was cut"
            out.append(works[s.tensor].tensor)
        else:
            out.append(flat[s.tensor_offset : s.tensor_offset + s.numel])
    return out


def _pack(bucket: Bucket, src: list[Work]) -> tuple[torch.Tensor, bool]:
    """This rank's contribution to a packing primitive as one contiguous buffer.

    A bucket whose pieces already lie back to back in memory, in the wire dtype, is sent as that run
    itself (no copy): a tensor split across buckets, or per-parameter views of one flat buffer
    (DeepSpeed's ZeRO-3 gradient partitions).
    """
    views = _segment_views(bucket, src)
    if bucket.rule.wire_dtype == bucket.dtype:
        run = views[0] if len(views) == 1 else adjacent_view(views)
        if run is not None:
            return run, True
    buf = torch.empty(bucket.numel, dtype=bucket.rule.wire_dtype, device=bucket.device)
    for s, view in zip(bucket.segments, views):
        buf[s.bucket_offset : s.bucket_offset + s.numel].copy_(view)
    return buf, False


def _start_reduce(bucket: Bucket, channel: Channel, src: list[Work], reduce_op: ReduceOp.RedOpType | None) -> InFlight:
    if bucket.primitive.packs:
        buf, in_place = _pack(bucket, src)
        return InFlight(bucket, channel.all_reduce([buf], _wire(reduce_op)), (buf,), in_place)
    views = _segment_views(bucket, src)
    return InFlight(bucket, channel.all_reduce(views, _wire(reduce_op)), tuple(views))


def _start_gather(bucket: Bucket, channel: Channel, src: list[Work], dst: list[Work], world: int) -> InFlight:
    wire = bucket.rule.wire_dtype
    if bucket.primitive.packs:
        buf, _ = _pack(bucket, src)
        (first,) = bucket.segments[:1]
        full = dst[first.tensor].flat
        if (
            len(bucket.segments) == 1
            and full is not None
            and first.numel == src[first.tensor].tensor.numel()
            and wire == bucket.dtype
        ):
            out = full  # the whole tensor in one bucket: gather straight into its output
        else:
            out = torch.empty(world * bucket.numel, dtype=wire, device=bucket.device)
        return InFlight(bucket, channel.all_gather([out], [buf]), (out,))
    # Strided tensors go as they are only to the primitive the group agreed lays them out (a bucket
    # that fell back to one call per tensor gathers into contiguous scratch and copies out).
    as_given = bucket.primitive is Primitive.COALESCED
    inputs, outputs = [], []
    for s, view in zip(bucket.segments, _segment_views(bucket, src)):
        out_work = dst[s.tensor]
        whole = s.numel == src[s.tensor].tensor.numel()
        if out_work.flat is None and not as_given:
            view = view.reshape(-1)  # contiguous (a copy of a strided view) for one call per tensor
        inputs.append(view)
        if whole and (out_work.flat is not None or as_given):
            outputs.append(out_work.whole)
        else:
            outputs.append(torch.empty(world * s.numel, dtype=wire, device=bucket.device))
    return InFlight(bucket, channel.all_gather(outputs, inputs), tuple(outputs))


def finish(
    flight: InFlight,
    op: Op,
    reduce_op: ReduceOp.RedOpType | None,
    src: list[Work],
    dst: list[Work],
    plan: Plan,
    timeout_s: float,
    group: ProcessGroup,
    failures: BucketFailures,
) -> None:
    """Wait for ``flight`` (giving up early if another rank reported it cannot send this bucket), then
    unpack it into the outputs."""
    bucket, world = flight.bucket, plan.world_size
    what = (
        f"{op.value} of bucket {bucket.index} ({bucket.numel} x {bucket.rule.wire_dtype} on {bucket.device}, "
        f"{bucket.primitive.value} over {bucket.rule.backend}, group {_compat.group_ranks(group)})"
    )

    def watch() -> None:  # another rank reported that it cannot send this bucket: stop waiting
        if failures.failed_elsewhere(bucket.index):
            who = failures.acknowledge(bucket.index)
            raise RankFailedError(
                f"rank {dist.get_rank()}: {what} cannot complete: {who}, before sending its data. The group is "
                "no longer usable; no output buffer of this call was written. Stop the job and look at that "
                "rank's error."
            )

    watching: Callable[[], None] | None = None if flight.fallback else watch
    for handle in flight.handles:
        # A bucket that already fell back has its failure notices in the store: nothing to watch.
        handle.wait(timeout_s, what, watching)
    if op is Op.ALL_REDUCE:
        _unpack_reduce(flight, reduce_op, src, world)
    else:
        _unpack_gather(flight, dst, world)


def _unpack_reduce(flight: InFlight, reduce_op: ReduceOp.RedOpType | None, src: list[Work], world: int) -> None:
    bucket = flight.bucket
    if bucket.primitive.packs:
        (buf,) = flight.buffers
        if reduce_op == ReduceOp.AVG:
            buf.div_(world)
        if not flight.in_place:
            for s, view in zip(bucket.segments, _segment_views(bucket, src)):
                view.copy_(buf[s.bucket_offset : s.bucket_offset + s.numel])
    elif reduce_op == ReduceOp.AVG:
        for view in flight.buffers:
            view.div_(world)


def _unpack_gather(flight: InFlight, dst: list[Work], world: int) -> None:
    bucket = flight.bucket
    for i, s in enumerate(bucket.segments):
        work = dst[s.tensor]
        got = flight.buffers[0] if bucket.primitive.packs else flight.buffers[i]
        if got is work.whole:
            continue  # gathered straight into place
        if work.flat is None:  # a strided output gathered into scratch: whole, rank-major
            work.tensor.copy_(got.view(work.tensor.shape))
            continue
        target = work.flat.view(world, -1)[:, s.tensor_offset : s.tensor_offset + s.numel]
        if bucket.primitive.packs:
            target.copy_(got.view(world, bucket.numel)[:, s.bucket_offset : s.bucket_offset + s.numel])
        else:
            target.copy_(got.view(world, s.numel))


def record(bucket: Bucket, collectives: int, fallback: str = "") -> BucketRecord:
    """What was done for ``bucket``: its primitive (per tensor where it fell back), bytes on the wire."""
    wire = bucket.rule.wire_dtype
    return BucketRecord(
        index=bucket.index,
        device=bucket.device,
        dtype=bucket.dtype,
        wire_dtype=wire,
        primitive=Primitive.PER_TENSOR if fallback else bucket.primitive,
        backend=bucket.rule.backend,
        numel=bucket.numel,
        bytes=bucket.numel * torch.empty((), dtype=wire).element_size(),
        tensors=len({s.tensor for s in bucket.segments}),
        collectives=collectives,
        fallback_reason=fallback,
    )
