"""ZeRO-3 / FSDP2 gather: a step's slices gathered and laid out parameter-major (each parameter's
``world`` slices end to end), in one of four ways, as the group agreed:

  coalesced   the agreed primitive is coalesced (NCCL, XCCL, or a policy forcing it): per-parameter
              gathers in one call, each straight into its place in the result
  strided     the agreed primitive is a flat gather, the backend lays a coalesced gather out into
              strided outputs itself (``Capabilities.strided_gather``, Gloo on CPU), and the step's
              slices are one run of equal slices (a model of equal layers): one call whose input is
              this rank's slices as they lie and whose output is a strided view of the result; no
              staging, no reorder
  direct      a flat gather with slices of at least ``steps.DIRECT_SLICE_BYTES`` (large models): each
              such slice gathered alone straight into its place, the small rest concatenated into one
              gather into staging and laid out by a copy each
  reordered   otherwise (a model's mix of sizes, a policy forcing ``flat``): rank-major into a staging
              buffer kept between calls, in a few chunks, each laid out by one strided copy per run of
              equal slices equally spaced (a model's repeated layers) as soon as it has arrived, while
              the next is in flight
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from collgrad.backends.ops import Op
from collgrad.core.buffers import Pieces
from collgrad.core.record import CallRecord
from collgrad.state.runner import Result, Step, all_converted, viewed
from collgrad.state.steps import SlicesStep

__all__ = ["gather_sliced"]


def gather_sliced(step: Step) -> Result:
    """Step ``step`` of a sliced gather: the batch's full gradients."""
    call, group, buffer = step.call, step.group, step.buffer
    assert isinstance(buffer, Pieces)
    plan = step.gplan.steps[step.b]  # made with the call's plan
    assert isinstance(plan, SlicesStep), "a sliced gather step without its layout"
    assert buffer.dtype == group.wire_dtype, "a rank's slices in another dtype than the layout's"
    device = call.source.device
    local = buffer.range(plan.lo, plan.span).to(device)  # a view of the source's flat buffer, or one move
    result = torch.empty(group.world * plan.span, dtype=group.wire_dtype, device=device)
    out: Result = []

    def shape() -> None:  # each parameter's view of the result, made while its data is in flight
        made = viewed(result, plan.views, len(plan.names))
        out.extend((name, view) for name, view in zip(plan.names, made) if view is not None)
        assert len(out) == len(plan.names), "a parameter without its view"

    route = step.gplan.route
    if route.coalesced:
        _coalesced(step, plan, local, result, shape)
    elif route.laid_out_by_backend and _one_input(plan):
        _laid_out_by_backend(step, plan, local, result, shape)
    elif plan.direct:
        _direct(step, plan, local, result, shape)
    else:
        _reordered(step, plan, local, result, shape)
    return all_converted(call, out, result.dtype, group.out_dtype)


def _one_input(plan: SlicesStep) -> bool:
    """Whether the step's slices are one run of equal slices back to back (a model of equal layers):
    then the backend's layout takes one contiguous input per rank. With several runs (a model's mix of
    matrices, biases and norms) it would concatenate them first, and that copy plus its copy out cost
    more than a flat gather and one reorder copy of ours (docs/notes/perf-profile.md)."""
    return len(plan.strided) <= 1 and all(r.count == 1 or r.stride == r.numel for r in plan.strided)


def _coalesced(
    step: Step, plan: SlicesStep, local: torch.Tensor, result: torch.Tensor, shape: Callable[[], None]
) -> None:
    """Per-parameter gathers in one coalesced call, each straight into its parameter-major output."""
    world, lo = step.group.world, plan.lo
    slots = [step.group.params[k] for k in step.batch]
    ins = [local[s.offset - lo : s.offset - lo + s.slice_numel] for s in slots]
    outs = [result[world * (s.offset - lo) : world * (s.offset - lo + s.slice_numel)] for s in slots]
    step.run(Op.ALL_GATHER, ins, outs, meanwhile=shape)


def _laid_out_by_backend(
    step: Step, plan: SlicesStep, local: torch.Tensor, result: torch.Tensor, shape: Callable[[], None]
) -> None:
    """One coalesced gather whose outputs are strided views of ``result``: per run of equally sized
    slices, rank r's rows land where each parameter's r-th slice goes, so the backend's own copy out
    of its staging is the layout. A step whose slices are all empty sends nothing (the same layout on
    every rank, so the same on every rank)."""
    world = step.group.world
    local = local.to(result.dtype)  # the wire dtype (a copy only where the buffer's differs)
    inputs, outputs = [], []
    for run in plan.strided:
        start, stride, numel, count = run.start, run.stride, run.numel, run.count
        inputs.append(local.as_strided((1, count, numel), (count * stride, stride, 1), local.storage_offset() + start))
        outputs.append(
            result.as_strided(
                (world, count, numel), (numel, world * stride, 1), result.storage_offset() + world * start
            )
        )
    if not inputs:
        shape()
        step.calls.append(CallRecord(Op.ALL_GATHER, step.group.group_ranks, (), ()))
        return
    cap = world * plan.span * local.element_size()  # the whole step: one bucket, one collective
    step.run(Op.ALL_GATHER, inputs, outputs, bucket_bytes=cap, meanwhile=shape, strided=True)


def _reordered(
    step: Step, plan: SlicesStep, local: torch.Tensor, result: torch.Tensor, shape: Callable[[], None]
) -> None:
    """Rank-major into staging, chunk by chunk (one bucket each), each chunk laid out by one strided
    copy per run of equally sized neighbours (a model's repeated layers) as soon as it has arrived,
    while the next one is still being gathered: the copy overlaps the transfer."""
    world = step.group.world
    staging = _staging(step, world * plan.span)
    ins, outs = [], []
    for chunk in plan.chunks:
        ins.append(local[chunk.lo : chunk.lo + chunk.span])
        outs.append(staging[world * chunk.lo : world * (chunk.lo + chunk.span)])

    def reorder(i: int) -> None:
        chunk = plan.chunks[i]
        rows = outs[i]
        for run in chunk.runs:  # rank-major rows of the chunk -> each parameter's slices end to end
            start, stride, n, count = run.start, run.stride, run.numel, run.count
            src = rows.as_strided((world, count, n), (chunk.span, stride, 1), rows.storage_offset() + start - chunk.lo)
            result.as_strided((world, count, n), (n, world * stride, 1), result.storage_offset() + world * start).copy_(
                src
            )

    # whole, bucket_bytes=1: every chunk a bucket of its own, gathered straight into its staging
    step.run(Op.ALL_GATHER, ins, outs, bucket_bytes=1, whole=True, done=reorder, meanwhile=shape)


def _direct(step: Step, plan: SlicesStep, local: torch.Tensor, result: torch.Tensor, shape: Callable[[], None]) -> None:
    """Large slices (``steps.DIRECT_SLICE_BYTES``) each gathered alone, straight into their place: one
    parameter's slices rank-major *are* its slices end to end. The small rest concatenated (biases,
    norms: little), gathered in one collective into staging and laid out by a copy each."""
    world = step.group.world
    starts = [0, *itertools.accumulate(n // world for n in plan.gathered)]
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    rest = sum(plan.gathered[k] // world for k, _ in plan.rest)
    if plan.rest:
        ins.append(torch.cat([local[starts[k] : starts[k + 1]] for k, _ in plan.rest]))
        outs.append(_staging(step, world * rest))
    for k in plan.direct:
        ins.append(local[starts[k] : starts[k + 1]])
        outs.append(result[world * starts[k] : world * starts[k + 1]])

    def lay_out(i: int) -> None:
        if i or not plan.rest:
            return
        rows = outs[0].view(world, rest)
        for k, at in plan.rest:
            n = starts[k + 1] - starts[k]
            result[world * starts[k] : world * starts[k + 1]].view(world, n).copy_(rows[:, at : at + n])

    # whole, bucket_bytes=1: every tensor a collective of its own, straight into its output
    step.run(Op.ALL_GATHER, ins, outs, bucket_bytes=1, whole=True, done=lay_out, meanwhile=shape)


def _staging(step: Step, numel: int) -> torch.Tensor:
    """Scratch for gathered slices, reused across calls (never returned: results are copies). At most
    one bucket, or one parameter's gathered size where that is larger."""
    dtype, device = step.group.wire_dtype, step.call.source.device
    key = ("staging", dtype, device)
    cache = step.call.source.scratch
    found = cache.get(key)
    if found is None or found.numel() < numel:
        found = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return found[:numel]
