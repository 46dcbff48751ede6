"""ZeRO-1/2 gather: every rank's partition gathered as it lies in memory, then a view per parameter.

The gathered buffer *is* the result: each parameter is a view of it (made while it is in flight) or,
where it straddles ranks or pieces, one concatenation of its runs (``steps.flat_views``). What a rank sends
is its main run of pieces as it lies (DeepSpeed fills its buffer in backward order), then the few
pieces a gap or another tensor sets apart (``steps.Sent``).

Two ways, as the group agreed:

  laid out   more than one chunk (a rank's pieces apart, or more than a bucket) and the backend lays a
             coalesced gather out into strided outputs itself (Gloo on CPU): one collective per chunk
             (``steps.flat_chunks``), whose outputs are the chunk's columns of the result seen as
             ``world`` rows; the main runs travel as they lie, only the short rest is concatenated, and
             nothing is staged or copied out by collgrad
  flat       otherwise: what this rank sends as one tensor (a view where its pieces tile one span,
             else one concatenation), gathered into the result (in buckets, copied out of a scratch
             bucket each where there are several)
"""

from __future__ import annotations

import torch

from collgrad.backends import agreement
from collgrad.backends.ops import Op
from collgrad.core.buffers import Pieces
from collgrad.state.cache import Placements
from collgrad.state.layout import gathered_runs
from collgrad.state.placements import CHANGED, placed, sent_message
from collgrad.state.runner import Result, Step, all_converted, viewed
from collgrad.state.steps import COPY_FOR_A_COLLECTIVE, flat_chunks, flat_views

__all__ = ["gather_flat"]


def gather_flat(step: Step) -> Result:
    """Step ``step`` of a ZeRO-1/2 gather (one collective per bucket, or per chunk)."""
    call, group, buffer, batch = step.call, step.group, step.buffer, step.batch
    assert isinstance(buffer, Pieces)
    world, numel = group.world, group.partition_numel
    device = call.source.device
    full = torch.empty(world * numel, dtype=group.wire_dtype, device=device)
    held = _placements(step, buffer)  # may exchange placements: before the gather
    runs = held.views.get(batch)
    if runs is None:  # kept with the placements they were made from
        runs = held.views.put(batch, flat_views(held.where, batch, [p.shape for p in group.params]))
    made: list[torch.Tensor | None] = []

    def views() -> None:  # every result that lies in one run, as a view, a call per run of them
        made.extend(viewed(full, runs, len(batch)))

    message = sent_message(buffer)
    capacity = max(1, call.call.bucket_bytes // (world * full.element_size()))
    chunks = flat_chunks(numel, held.head, capacity, COPY_FOR_A_COLLECTIVE // full.element_size())
    if len(chunks) > 1 and step.gplan.route.laid_out_by_backend:
        rows = full.view(world, numel)
        inputs = [message.range(lo, n).to(device).view(1, n) for lo, n in chunks]
        outputs = [rows[:, lo : lo + n] for lo, n in chunks]
        # bucket_bytes=1: every chunk a bucket (one collective) of its own (a strided tensor is never
        # cut, and one larger than a bucket goes alone): two in one call would be concatenated first.
        step.run(Op.ALL_GATHER, inputs, outputs, bucket_bytes=1, meanwhile=views, strided=True, variant=chunks)
    else:
        step.run(Op.ALL_GATHER, [message.whole().to(device)], [full], meanwhile=views)
    results: Result = []
    for k, view in zip(batch, made):
        slot = group.params[k]
        if view is None:  # straddles: its runs end to end, now that they have arrived
            view = torch.cat([full[at : at + n] for at, n in held.where[k]]).view(slot.shape)
        results.append((slot.name, view))
    return all_converted(call, results, full.dtype, group.out_dtype)


def _placements(step: Step, buffer: Pieces) -> Placements:
    """Per parameter, the (offset, numel) runs of the gathered buffer that make it up, from every rank's
    placement of its pieces, and the least main run any rank sends: reused if every rank said, in the
    readiness check, that its cached placements still hold (the same data on every rank of the group,
    so they all decide alike); else exchanged in one small collective, each rank's row (its main run,
    then its pieces) padded to the largest piece count told in the readiness check."""
    call, group = step.call, step.group
    sent = placed(buffer)
    found = call.source.plans.placements.get(group.index)
    if found is not None and all(call.placements.get(r, CHANGED) != CHANGED for r in group.group_ranks):
        return found
    if group.world > 1:
        # every rank of the gradient group told its count in the readiness check (the control group
        # covers it): the exchanged rows are as wide on every rank, and none is read short
        assert all(r in call.piece_counts for r in group.group_ranks), "a rank's piece count was not told"
        width = 1 + 3 * max(call.piece_counts[r] for r in group.group_ranks)
        row = [sent.head] + [v for piece in sent.pieces for v in piece]  # (offset in partition, sent, numel)
        pg = call.source.groups.get(group.index)
        assert pg is not None  # a group of more than one rank has a process group
        rows = agreement.exchange(
            pg,
            row + [-1] * (width - len(row)),
            timeout_s=call.dispatcher.timeout,
            what="where gradient pieces lie",
        )
        # A piece's offsets are never negative: a row's pieces end at its first padding.
        per_rank = [[(r[i], r[i + 1], r[i + 2]) for i in range(1, width, 3) if r[i] != -1] for r in rows]
        head = min(r[0] for r in rows)
    else:
        per_rank, head = [list(sent.pieces)], sent.head
    held = call.source.plans.placements[group.index] = Placements(sent, gathered_runs(group, per_rank), head)
    call.cached = False
    return held
