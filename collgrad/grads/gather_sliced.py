"""ZeRO-3 / FSDP2 gather: a step's slices gathered and laid out parameter-major (each parameter's
``world`` slices end to end), in one of three ways, as the group agreed:

  coalesced   the agreed primitive is coalesced (NCCL, XCCL, or a policy forcing it): per-parameter
              gathers in one call, each straight into its place in the result
  strided     the agreed primitive is a flat gather and the backend lays a coalesced gather out into
              strided outputs itself (``Capabilities.strided_gather``, Gloo on CPU): one call whose
              outputs are strided views of the result, per run of equal slices; no staging, no reorder
  reordered   otherwise (a policy forcing ``flat`` too): rank-major into a staging buffer kept between
              calls, in a few chunks, each laid out by one strided copy per run of equal slices as
              soon as it has arrived, while the next is in flight
"""

from __future__ import annotations

from typing import Callable

import torch

from collgrad.backends.ops import Op, Primitive
from collgrad.core.buffers import Pieces
from collgrad.core.record import CallRecord
from collgrad.grads.runner import Result, Step, all_converted, shaped
from collgrad.grads.steps import SlicesStep, slices_step

__all__ = ["gather_sliced"]


def gather_sliced(step: Step) -> Result:
    """Step ``step`` of a sliced gather: the batch's full gradients."""
    call, group, buffer, batch = step.call, step.group, step.buffer, step.batch
    assert isinstance(buffer, Pieces)
    key = (group.index, batch, buffer.dtype)
    plan = call.plans.slices_steps.get(key)
    if plan is None:  # pure layout: cached with the source
        plan = call.plans.slices_steps[key] = slices_step(group, batch, buffer.pieces[0].element_size())
    device = call.source.device
    local = buffer.range(plan.lo, plan.span).to(device)  # a view of the source's flat buffer, or one move
    result = torch.empty(group.world * plan.span, dtype=group.wire_dtype, device=device)
    out: Result = []

    def shape() -> None:  # each parameter's view of the result, made while its data is in flight
        parts = result.split_with_sizes(list(plan.gathered))
        out.extend(zip(plan.names, parts))
        for k in plan.trimmed:  # padded (ZeRO-3's last slices), or not 1-D
            slot = group.params[batch[k]]
            out[k] = (slot.name, shaped(parts[k][: slot.numel], slot))

    if call.primitive(group, Op.ALL_GATHER, group.wire_dtype) is Primitive.COALESCED:
        _coalesced(step, plan, local, result, shape)
    elif _strided(step):
        _laid_out_by_backend(step, plan, local, result, shape)
    else:
        _reordered(step, plan, local, result, shape)
    return all_converted(call, out, result.dtype, group.out_dtype)


def _strided(step: Step) -> bool:
    """Whether this group's gathers hand the backend strided outputs: the agreed choice is a flat
    gather, and every rank's backend lays a coalesced gather out into strided views itself with the
    coalesced primitive allowed (a policy forcing ``flat`` or forbidding ``coalesced`` keeps the flat
    gather and its reorder copy)."""
    caps = step.call.capabilities(step.group)
    dtype = step.group.wire_dtype
    return caps.choice(Op.ALL_GATHER, dtype).primitive is Primitive.FLAT and caps.strided_gather(dtype)


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
        rows = outs[i].view(world, chunk.span)
        for run in chunk.runs:
            start, n, count = run.start, run.numel, run.count
            src = rows[:, start - chunk.lo : start - chunk.lo + count * n].view(world, count, n).transpose(0, 1)
            result[world * start : world * (start + count * n)].view(count, world, n).copy_(src)

    cap = world * max(chunk.span for chunk in plan.chunks) * local.element_size()  # gathered bytes
    step.run(Op.ALL_GATHER, ins, outs, bucket_bytes=cap, done=reorder, meanwhile=shape)


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
