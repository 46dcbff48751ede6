"""All-reduce step: this rank's fragments copied into a bucket whose other ranges are zeroed, one sum
over the group (adding zeros is exact: the result is bitwise what DeepSpeed's accessor returns).

    bucket   | a . . . . | b . . | c . . . |      this rank's fragments at their place (steps.ReduceStep)
             copies: runs of equal fragments in one strided copy each (steps.CopyPlan), the rest one by one
"""

from __future__ import annotations

import torch

from collgrad.backends.ops import Op
from collgrad.core.buffers import Pieces
from collgrad.state.adapters.base import rank_in
from collgrad.state.cache import HeldCopies
from collgrad.state.layout import Fragment
from collgrad.state.runner import Result, Step, all_converted, viewed
from collgrad.state.steps import CopyRows, ReduceStep, copy_plan

__all__ = ["all_reduce"]


def all_reduce(step: Step) -> Result:
    """Step ``step`` of an all-reduce plan: the batch's full gradients, in batch order."""
    call, group, batch = step.call, step.group, step.batch
    buffer = step.buffer
    assert isinstance(buffer, Pieces)
    device = call.source.device
    rank = rank_in(group)
    key = (group.index, batch, rank)  # the batch itself: calls batch differently
    plan = step.gplan.steps[step.b]  # made with the call's plan
    assert isinstance(plan, ReduceStep), "an all-reduce step without its layout"
    result = torch.empty(plan.total, dtype=group.out_dtype, device=device)
    for lo, n in plan.gaps:  # only what no fragment of this rank fills
        result[lo : lo + n].zero_()
    mine = plan.mine
    moved = bool(mine) and buffer.device != device
    if moved:  # offloaded: this rank's part moves once per bucket
        lo = min(f.local_offset for f, _ in mine)
        part = buffer.range(lo, max(f.local_offset + f.numel for f, _ in mine) - lo)
        mine = tuple((Fragment(f.param, f.param_offset, f.local_offset - lo, f.numel), at) for f, at in mine)
        buffer = Pieces([part.to(device)])
    _fill(step, (*key, moved), result, buffer, mine)
    # The bucket as one tensor (one collective, no per-tensor bookkeeping), unless the registry sends
    # one collective per tensor for this group (then it needs the per-parameter views first).
    per_tensor = step.gplan.route.per_tensor
    out: Result = []

    def shape() -> None:  # made while the sum is in flight (or before, for one collective per tensor)
        if not out:
            made = viewed(result, plan.views, len(batch))
            out.extend((group.params[k].name, view) for k, view in zip(batch, made) if view is not None)
            assert len(out) == len(batch), "a parameter without its view"

    if per_tensor:
        shape()
    step.run(Op.ALL_REDUCE, [view.view(-1) for _, view in out] if per_tensor else [result], None, meanwhile=shape)
    return all_converted(call, out, result.dtype, group.out_dtype)


def _fill(
    step: Step,
    key: tuple[int, tuple[int, ...], int, bool],
    result: torch.Tensor,
    buffer: Pieces,
    mine: tuple[tuple[Fragment, int], ...],
) -> None:
    """This rank's fragments ``mine`` copied from ``buffer`` into ``result`` at their bucket offsets: runs
    of equal fragments (a model's repeated layers) in one copy each, as the copy plan kept for where
    the pieces lie says, the rest one by one."""
    single = mine
    placed = buffer.placement() if mine else None
    if placed is not None:
        span, placement = placed
        copies = step.call.plans.copies.get(key)
        if copies is None or (copies.placement, copies.starts) != (placement, tuple(buffer.starts)):
            copies = step.call.plans.copies[key] = _copies(placement, buffer, mine)
        single = copies.plan.single
        for run, reverse in zip(copies.plan.runs, copies.reverse):
            _copy_rows(result, span, run, reverse)
    for frag, at in single:  # straight from where each fragment lies into the bucket
        result[at : at + frag.numel].copy_(buffer.range(frag.local_offset, frag.numel))


def _copies(placement: tuple[int, ...], buffer: Pieces, mine: tuple[tuple[Fragment, int], ...]) -> HeldCopies:
    """The copy plan of ``mine`` for where ``buffer``'s pieces lie now, with each back-to-front run's
    reversed row index made on the buffer's device (CUDA's index_select and index_copy_ refuse an
    index elsewhere)."""
    plan = copy_plan(mine, [buffer.span_offset(f.local_offset, f.numel) for f, _ in mine])
    reverse = tuple(
        torch.arange(run.count - 1, -1, -1, device=buffer.device) if run.dst_stride < 0 else None for run in plan.runs
    )
    return HeldCopies(placement, tuple(buffer.starts), plan, reverse)


def _copy_rows(result: torch.Tensor, span: torch.Tensor, run: CopyRows, reverse: torch.Tensor | None) -> None:
    """One run of equal fragments from the storage span into the bucket, in one call."""
    src = span.as_strided((run.count, run.numel), (run.src_stride, 1), span.storage_offset() + run.src)
    if reverse is None:
        result.as_strided((run.count, run.numel), (run.dst_stride, 1), result.storage_offset() + run.dst).copy_(src)
        return
    lowest = run.dst + (run.count - 1) * run.dst_stride
    dst = result.as_strided((run.count, run.numel), (-run.dst_stride, 1), result.storage_offset() + lowest)
    if src.dtype != dst.dtype:  # index_select and index_copy_ do not convert
        for i in range(run.count):
            dst[run.count - 1 - i].copy_(src[i])
    elif -run.dst_stride == run.numel:  # rows back to back: one gather of rows into place
        torch.index_select(src, 0, reverse, out=dst)
    else:
        dst.index_copy_(0, reverse, src)
