"""Executors: run an opened call's GradPlan, one step at a time, and hand back full gradients.

One small function per plan kind; none decides anything (the plan did), each only moves bytes:

  local       copies (or views) of what this rank already holds
  all_gather  ZeRO-1/2: one gather of the partitions as they lie, then views per parameter;
              ZeRO-3 / FSDP2: a batch's slices gathered in a few chunks into a reused staging
              buffer, each chunk laid parameter-major (one strided copy per run of equal layers)
              while the next is in flight (coalesced backends: per-parameter gathers straight
              into those places instead)
  all_reduce  this rank's fragments copied into a zeroed bucket, one sum over the group
  per_param   DeepSpeed's own accessor, one collective per parameter
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple

import torch

from collgrad import _compat
from collgrad.backends import gloo
from collgrad.backends.decide import Choice
from collgrad.backends.agreement import exchange
from collgrad.core.buffers import Pieces
from collgrad.backends.ops import Op, Primitive
from collgrad.core.record import BucketRecord, CallRecord, Decision
from collgrad.backends.waits import wait_work
from collgrad.grads.call import OpenCall
from collgrad.grads.plan import GroupPlan, PlanKind
from collgrad.grads.record import FullGradRecord, GroupRecord
from collgrad.grads.sources import rank_in
from collgrad.grads.sources.layout import (
    Fragment,
    GradGroup,
    Kind,
    ParamSlot,
    gathered_runs,
    owned_fragments,
    strided_runs,
)

__all__ = ["Executor", "Result", "placed_pieces"]

Result = list[tuple[str, torch.Tensor]]


def _cut(where: list[list[tuple[int, int]]], batch: tuple[int, ...], numel: int):
    """How to cut the gathered buffer in one ``split``: the sizes (runs and the gaps between them, in
    buffer order), and for each parameter of ``batch`` the indices of its runs among the pieces."""
    runs = sorted((at, n, k, i) for k in batch for i, (at, n) in enumerate(where[k]))
    sizes, index, at = [], {}, 0
    for lo, n, k, i in runs:
        if lo > at:
            sizes.append(lo - at)
        index[(k, i)] = len(sizes)
        sizes.append(n)
        at = lo + n
    if at < numel:
        sizes.append(numel - at)
    return sizes, [[index[(k, i)] for i in range(len(where[k]))] for k in batch]


def _reduce_step(group: GradGroup, batch: tuple[int, ...], rank: int):
    """For one all-reduce step (its parameters back to back in batch order): the bucket's size, this
    rank's fragments with where each goes, and the ranges no fragment of this rank fills (to be zeroed)."""
    total = 0
    where = {}
    for k in batch:
        where[k] = total
        total += group.params[k].numel
    mine = [(f, where[f.param] + f.param_offset) for f in owned_fragments(group, rank) if f.param in where]
    gaps, at = [], 0
    for f, lo in sorted(mine, key=lambda m: m[1]):
        if lo > at:
            gaps.append((at, lo - at))
        at = max(at, lo + f.numel)
    if at < total:
        gaps.append((at, total - at))
    return total, mine, gaps


class _CopyRows(NamedTuple):
    """``count`` equal fragments, ``src_stride`` apart in this rank's storage span from ``src``, copied
    in one call to ``dst + i * dst_stride`` in the bucket (``dst_stride < 0``: DeepSpeed's ZeRO-1/2
    fragments lie back to front, so the i-th lands below the one before)."""

    src: int
    count: int
    numel: int
    src_stride: int
    dst: int
    dst_stride: int
    #: the rows in reverse (for dst_stride < 0), or None
    reverse: torch.Tensor | None


def _copy_plan(mine: list[tuple[Fragment, int]], buffer: Pieces):
    """How this rank's fragments go into an all-reduce bucket, for where its pieces lie now: runs of
    equal fragments equally spaced both where they lie and where they go, one copy each; the others
    (a lone fragment, one that straddles two pieces) one by one: (runs, [(fragment, bucket offset)])."""
    placed, dsts, single = [], [], []
    for f, at in mine:
        src = buffer.span_offset(f.local_offset, f.numel)
        if src is None:
            single.append((f, at))
        else:
            placed.append(Fragment(len(dsts), 0, src, f.numel))
            dsts.append((f, at))
    runs = []
    for run in strided_runs(tuple(placed)):
        to = [dsts[placed[i].param][1] for i in run.frags]
        step = to[1] - to[0] if len(to) > 1 else 0
        if len(to) > 1 and abs(step) >= run.numel and all(t == to[0] + i * step for i, t in enumerate(to)):
            # on the buffer's device: index_select and index_copy_ refuse an index elsewhere (CUDA)
            reverse = torch.arange(run.count - 1, -1, -1, device=buffer.device) if step < 0 else None
            runs.append(_CopyRows(run.local_offset, run.count, run.numel, run.stride, to[0], step, reverse))
        else:
            single += [dsts[placed[i].param] for i in run.frags]
    return runs, single


def _copy_rows(result: torch.Tensor, span: torch.Tensor, run: _CopyRows) -> None:
    src = span.as_strided((run.count, run.numel), (run.src_stride, 1), span.storage_offset() + run.src)
    if run.reverse is None:
        result.as_strided((run.count, run.numel), (run.dst_stride, 1), result.storage_offset() + run.dst).copy_(src)
        return
    lowest = run.dst + (run.count - 1) * run.dst_stride
    dst = result.as_strided((run.count, run.numel), (-run.dst_stride, 1), result.storage_offset() + lowest)
    if src.dtype != dst.dtype:  # index_select and index_copy_ do not convert
        for i in range(run.count):
            dst[run.count - 1 - i].copy_(src[i])
    elif -run.dst_stride == run.numel:  # rows back to back: a gather of rows into place (1.8x a copy per row)
        torch.index_select(src, 0, run.reverse, out=dst)
    else:
        dst.index_copy_(0, run.reverse, src)


#: A ZeRO-3 / FSDP2 gather step goes in this many chunks, so reordering one overlaps gathering the next
#: (2 ranks on this 2-core machine: 21-22 ms for 2 or 4 chunks against 29 ms in one, 25 MB).
PIPELINE_CHUNKS = 4
#: ...but no chunk under this: small steps stay one collective.
MIN_CHUNK_BYTES = 1 << 20


class _SlicesStep(NamedTuple):
    """Pure: how a step of a PER_PARAM group (ZeRO-3, FSDP2) is gathered and laid out, from the layout
    alone (cached with the source). The batch's slices lie back to back from ``lo`` (``span``
    elements) in each rank's buffer; the result holds each parameter's ``world`` slices end to end
    (``gathered`` elements each), of which its first ``numel`` are the gradient."""

    lo: int
    span: int
    names: tuple[str, ...]
    gathered: tuple[int, ...]
    #: positions in the batch whose result needs cutting (padding) or a view in the parameter's shape
    trimmed: tuple[int, ...]
    #: (start relative to ``lo``, elements, runs) per chunk; a run: (start, slice size, count) of
    #: equally sized neighbours, reordered by one strided copy
    chunks: tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]
    #: the whole step as runs of equally sized slices at a constant distance (a model's repeated
    #: layers), (start relative to ``lo``, distance, slice size, count) each: one strided view per run
    #: on each side of a gather whose backend lays the data out itself
    strided: tuple[tuple[int, int, int, int], ...]


def _slices_step(group: GradGroup, batch: tuple[int, ...], element_size: int) -> _SlicesStep:
    world = group.world
    slots = [group.params[k] for k in batch]
    lo = slots[0].offset
    span = slots[-1].offset + slots[-1].slice_numel - lo
    count = max(1, min(PIPELINE_CHUNKS, span * element_size // MIN_CHUNK_BYTES))
    chunks = []
    for c_lo, c_span, members in _chunks(slots, lo, count):
        runs = _equal_runs([slots[j] for j in members])
        chunks.append((c_lo, c_span, tuple((r[0].offset - lo, r[0].slice_numel, len(r)) for r in runs)))
    ends = [s.offset for s in slots[1:]] + [lo + span]
    gathered = tuple(world * (end - s.offset) for s, end in zip(slots, ends))  # to the next one's start
    slices = tuple(Fragment(k, 0, s.offset - lo, s.slice_numel) for k, s in enumerate(slots) if s.slice_numel)
    return _SlicesStep(
        lo,
        span,
        tuple(s.name for s in slots),
        gathered,
        tuple(k for k, (s, g) in enumerate(zip(slots, gathered)) if g != s.numel or len(s.shape) != 1),
        tuple(chunks),
        tuple((r.local_offset, r.stride, r.numel, len(r.frags)) for r in strided_runs(slices)),
    )


def _chunks(slots: list[ParamSlot], lo: int, count: int) -> list[tuple[int, int, list[int]]]:
    """``slots`` (back to back from ``lo``) cut at parameter edges into about ``count`` chunks of
    similar size: (start relative to ``lo``, elements, member positions) each."""
    total = slots[-1].offset + slots[-1].slice_numel - lo
    target = -(-total // count)
    chunks: list[tuple[int, int, list[int]]] = []
    start, members = 0, []
    for j, s in enumerate(slots):
        members.append(j)
        end = s.offset + s.slice_numel - lo
        if end - start >= target or j == len(slots) - 1:
            chunks.append((start, end - start, members))
            start, members = end, []
    return chunks


def _equal_runs(slots: list[ParamSlot]) -> list[list[ParamSlot]]:
    """``slots`` (back to back in a ZeRO-3 buffer) cut into runs of equal slice size."""
    runs: list[list[ParamSlot]] = []
    for s in slots:
        if runs and runs[-1][-1].slice_numel == s.slice_numel and runs[-1][-1].offset + s.slice_numel == s.offset:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _no_history(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` itself unless it carries autograd history (then detached from it)."""
    return grad.detach() if grad.requires_grad or grad.grad_fn is not None else grad


def _shaped(grad: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """``grad`` in its parameter's shape (itself where it has it: a view costs ~2 us, 1 ms a call at
    400 tensors); reads no data."""
    return grad if grad.shape == slot.shape else grad.view(slot.shape)


def placed_pieces(buffer: Pieces) -> tuple[tuple[int, int, int], ...]:
    """This rank's pieces as a gather of its partition sends them: (offset in the partition, offset in
    what is sent, numel) each; sent as they lie when they tile one storage span, else concatenated."""
    found = buffer.memo.get("placed pieces")
    if found is None:
        tiling = buffer.tiling()
        sent = tiling[1] if tiling is not None else buffer.starts
        found = buffer.memo["placed pieces"] = tuple(zip(buffer.starts, sent, (p.numel() for p in buffer.pieces)))
    return found


class Executor:
    """Runs ``call.plan``; ``steps()`` yields each step's results, ``record()`` tells what was done."""

    def __init__(self, call: OpenCall, *, copy: bool = True) -> None:
        self.call = call
        #: False: where this rank holds a gradient whole (no collective), hand out the tensor itself
        self.copy = copy
        self.group_records: list[GroupRecord] = []
        self.per_param_collectives = 0

    def record(self) -> FullGradRecord:
        c = self.call
        return FullGradRecord(
            c.source.layout.variant,
            tuple(self.group_records),
            self.per_param_collectives,
            c.local.loss_scale,
            c.unscale,
            c.cached,
            c.layout_cached,
        )

    def steps(self) -> Iterator[Result]:
        """The results one step (one batch of the plan) at a time. Collective: every rank of the
        model's data-parallel group must take every step."""
        c = self.call
        layout = c.source.layout
        for gplan in c.plan.groups:
            group = layout.groups[gplan.group]
            buffer = c.local.buffers[gplan.group] if c.local.buffers else None
            calls: list[CallRecord] = []
            for b, batch in enumerate(gplan.batches):
                results = self._step(gplan, group, buffer, b, batch, calls)
                self._note(gplan, group, calls)
                yield results
                del results
            if not gplan.batches:
                self._note(gplan, group, calls)

    def _note(self, gplan: GroupPlan, group: GradGroup, calls: list[CallRecord]) -> None:
        rec = GroupRecord(group.index, group.kind, gplan.kind, group.group_ranks, len(group.params), tuple(calls))
        if self.group_records and self.group_records[-1].group == group.index:
            self.group_records[-1] = rec
        else:
            self.group_records.append(rec)

    def _step(
        self, gplan: GroupPlan, group: GradGroup, buffer, b: int, batch: tuple[int, ...], calls: list[CallRecord]
    ) -> Result:
        kind = gplan.kind
        if kind is PlanKind.PER_PARAM:
            return self._per_param(group, batch)
        if kind is PlanKind.LOCAL:
            return self._local(group, buffer, batch)
        if kind is PlanKind.ALL_GATHER:
            if group.kind is Kind.PARTITIONED_FLAT:
                return self._gather_flat(gplan, group, buffer, b, batch, calls)
            return self._gather_slices(gplan, group, buffer, b, batch, calls)
        return self._all_reduce(gplan, group, buffer, b, batch, calls)

    # -- shared ---------------------------------------------------------------------------------------
    def _converted(self, grad: torch.Tensor, out_dtype: torch.dtype, *, owned: bool = True) -> torch.Tensor:
        """``grad`` in ``out_dtype``, unscaled; in place only if ``owned`` (collgrad's own buffer) or
        converted (a copy already), never in a tensor of the optimizer's."""
        if grad.dtype is not out_dtype:
            grad, owned = grad.to(out_dtype), True
        if self.call.unscale:
            scale = self.call.local.loss_scale
            grad = grad.div_(scale) if owned else grad / scale
        return grad

    def _all_converted(self, out: Result, dtype: torch.dtype, out_dtype: torch.dtype) -> Result:
        """``out`` (views made while the data was in flight) converted, now that it has arrived."""
        if dtype is out_dtype and not self.call.unscale:
            return out
        return [(name, self._converted(grad, out_dtype)) for name, grad in out]

    def _run(
        self,
        gplan: GroupPlan,
        group: GradGroup,
        b: int,
        op: Op,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor] | None,
        calls: list[CallRecord],
        **run: Any,
    ) -> None:
        """One dispatcher call for step ``b``: its bucket plan is built once and reused across calls.
        Not atomic and not re-checked: these are collgrad's own buffers, and the ranks agreed already."""
        pg = self.call.source.groups.get(group.index)
        calls.append(self.call.run((gplan.group, b), op, inputs, outputs, pg, **run))

    # -- executors ------------------------------------------------------------------------------------
    def _per_param(self, group: GradGroup, batch: tuple[int, ...]) -> Result:
        c = self.call
        out = []
        for k in batch:
            slot = group.params[k]
            grad = c.source.per_param(c.source.params[slot.name])
            self.per_param_collectives += 1
            if c.unscale:
                grad = grad / c.local.loss_scale
            out.append((slot.name, grad))
        return out

    def _local(self, group: GradGroup, buffer, batch: tuple[int, ...]) -> Result:
        copy = self.copy
        if group.kind is Kind.REPLICATED:
            params, out_dtype = group.params, group.out_dtype
            # copy=False: the optimizer's tensor itself (no autograd history to cut: a .grad, a _hp_grad);
            # a new tensor object per gradient would cost ~1 us each
            grads = [buffer[k].detach().clone() for k in batch] if copy else [_no_history(buffer[k]) for k in batch]
            if self.call.unscale or any(g.dtype is not out_dtype for g in grads):
                grads = [self._converted(g, out_dtype, owned=copy) for g in grads]
            return [(params[k].name, _shaped(g, params[k])) for k, g in zip(batch, grads)]
        out = []
        wanted = set(batch)
        for frag in owned_fragments(group, 0):  # a group of one rank owns everything
            if frag.param in wanted:
                slot = group.params[frag.param]
                piece = buffer.range(frag.local_offset, frag.numel)
                moved = piece.to(self.call.source.device, copy=copy)
                owned = copy or moved.data_ptr() != piece.data_ptr()  # moved, or a concatenation of pieces
                out.append((slot.name, self._converted(_shaped(moved, slot), group.out_dtype, owned=owned)))
        return out

    def _gather_flat(self, gplan, group: GradGroup, buffer: Pieces, b: int, batch, calls) -> Result:
        """ZeRO-1/2: every rank's partition gathered as it lies in memory (DeepSpeed fills its buffer in
        backward order: no concatenation first), then each parameter is a view of the gathered buffer
        (the buffer *is* the result: the views are made while it is in flight) or, where it straddles
        ranks or pieces, one concatenation."""
        device, world = self.call.source.device, group.world
        tiling = buffer.tiling()
        local = tiling[0] if tiling is not None else buffer.whole()
        full = torch.empty(world * group.partition_numel, dtype=group.wire_dtype, device=device)
        where, cuts = self._where(group, buffer, tiling)  # may exchange placements: before the gather
        cut = cuts.get(batch)
        if cut is None:  # kept with the placements it was made from
            cut = cuts[batch] = _cut(where, batch, full.numel())
        sizes, take = cut
        out: list[Any] = []  # (name, view), or (name, None) for a parameter that straddles
        parts: list[tuple[torch.Tensor, ...]] = []

        def views() -> None:
            parts.append(full.split(sizes))  # every run of every parameter as a view, in one call
            for k, runs in zip(batch, take):
                slot = group.params[k]
                out.append((slot.name, _shaped(parts[0][runs[0]], slot) if len(runs) == 1 else None))

        self._run(gplan, group, b, Op.ALL_GATHER, [local.to(device)], [full], calls, meanwhile=views)
        for i, (k, runs) in enumerate(zip(batch, take)):
            if len(runs) > 1:  # straddles: its runs end to end, now that they have arrived
                slot = group.params[k]
                out[i] = (slot.name, _shaped(torch.cat([parts[0][r] for r in runs]), slot))
        return self._all_converted(out, full.dtype, group.out_dtype)

    def _where(self, group: GradGroup, buffer: Pieces, tiling) -> tuple[list[list[tuple[int, int]]], dict]:
        """Per parameter, the (offset, numel) runs of the gathered buffer that make it up, in order:
        from every rank's placement of its pieces (told in the readiness check; exchanged, in one more
        small collective, only when some rank's differs from the cached one); and a dict for what is
        derived from them (cached with them, dropped with them)."""
        c = self.call
        pieces = placed_pieces(buffer)
        key = ("placements", group.index)
        found = c.source.plans.get(key)
        # Reused only if every rank said, in the readiness check, that its cached placements still hold
        # (the same data on every rank of the group, so they all decide alike).
        if found is not None and all(c.placements.get(r, -1) != -1 for r in group.group_ranks):
            return found[1], found[2]
        if group.world > 1:
            pg = c.source.groups.get(group.index)
            timeout = c.dispatcher.timeout
            counts = exchange(pg, [len(pieces)], timeout_s=timeout, what="the count of gradient pieces")
            width = 3 * max(row[0] for row in counts)
            row = [v for piece in pieces for v in piece]  # (offset in partition, offset sent, numel) each
            rows = exchange(pg, row + [-1] * (width - len(row)), timeout_s=timeout, what="where gradient pieces lie")
            per_rank = [[tuple(r[i : i + 3]) for i in range(0, 3 * n[0], 3)] for r, n in zip(rows, counts)]
        else:
            per_rank = [list(pieces)]
        where = gathered_runs(group, per_rank)
        c.source.plans[key] = (pieces, where, {})
        self.call.cached = False
        return where, c.source.plans[key][2]

    def _gather_slices(self, gplan, group: GradGroup, buffer: Pieces, b: int, batch, calls) -> Result:
        """ZeRO-3 / FSDP2: gather this batch's slices, rank-major, into a staging buffer kept between
        calls, and lay each parameter's slices end to end (the copy a rank-major gather always needs),
        chunk by chunk as the chunks arrive."""
        device, world = self.call.source.device, group.world
        key = ("slices step", group.index, batch, buffer.dtype)
        step = self.call.source.plans.get(key)
        if step is None:  # pure layout: cached with the source
            step = self.call.source.plans[key] = _slices_step(group, batch, buffer.pieces[0].element_size())
        lo, span = step.lo, step.span
        local = buffer.range(lo, span).to(device)  # a view of DeepSpeed's flat buffer, or one move
        result = torch.empty(world * span, dtype=group.wire_dtype, device=device)
        out: Result = []

        def shape() -> None:  # each parameter's view of the result, made while its data is in flight
            parts = result.split(step.gathered)
            out.extend(zip(step.names, parts))
            for k in step.trimmed:  # padded (ZeRO-3's last slices), or not 1-D
                slot = group.params[batch[k]]
                out[k] = (slot.name, _shaped(parts[k][: slot.numel], slot))

        if self._coalesced(group):
            # NCCL/XCCL (or a policy forcing it): per-parameter gathers in one coalesced call, each
            # straight into its parameter-major output: no staging, no reorder copy.
            slots = [group.params[k] for k in batch]
            ins = [local[s.offset - lo : s.offset - lo + s.slice_numel] for s in slots]
            outs = [result[world * (s.offset - lo) : world * (s.offset - lo + s.slice_numel)] for s in slots]
            self._run(gplan, group, b, Op.ALL_GATHER, ins, outs, calls, meanwhile=shape)
            return self._all_converted(out, result.dtype, group.out_dtype)
        choice = self._laid_out_by_backend(group)
        if choice is not None:
            calls.append(self._gather_strided(group, step, local, result, choice, shape))
            return self._all_converted(out, result.dtype, group.out_dtype)
        # Parameter-major: each parameter's world slices end to end, by one strided copy per run of
        # equally sized neighbours (a model's repeated layers). The step goes as a few chunks, one
        # bucket each, and each chunk is reordered as soon as it has arrived, while the next one is
        # still being gathered: the copy overlaps the transfer.
        staging = self._staging(group.wire_dtype, device, world * span)
        ins, outs = [], []
        for c_lo, c_span, _ in step.chunks:
            ins.append(local[c_lo : c_lo + c_span])
            outs.append(staging[world * c_lo : world * (c_lo + c_span)])

        def reorder(i: int) -> None:
            c_lo, c_span, runs = step.chunks[i]
            rows = outs[i].view(world, c_span)
            for start, n, count in runs:
                src = rows[:, start - c_lo : start - c_lo + count * n].view(world, count, n).transpose(0, 1)
                result[world * start : world * (start + count * n)].view(count, world, n).copy_(src)

        cap = world * max(c_span for _, c_span, _ in step.chunks) * local.element_size()  # gathered bytes
        self._run(gplan, group, b, Op.ALL_GATHER, ins, outs, calls, bucket_bytes=cap, done=reorder, meanwhile=shape)
        return self._all_converted(out, result.dtype, group.out_dtype)

    def _laid_out_by_backend(self, group: GradGroup) -> Choice | None:
        """The agreed choice for this group's gathers, if its backend lays a gather out into strided
        views itself: a flat gather agreed on Gloo over CPU tensors, with the coalesced primitive
        allowed as well (a policy forcing ``flat`` or forbidding ``coalesced`` keeps the flat gather and
        its reorder copy). See ``backends.gloo.copies_gathers_out_strided``."""
        caps = self.call.capabilities(group)
        choice = caps.choice(Op.ALL_GATHER, group.wire_dtype)
        if (
            choice.primitive is Primitive.FLAT
            and choice.backend == gloo.NAME
            and gloo.copies_gathers_out_strided(self.call.source.device.type)
            and caps.status(Op.ALL_GATHER, Primitive.COALESCED, group.wire_dtype).ok
        ):
            return choice
        return None

    def _gather_strided(
        self,
        group: GradGroup,
        step: _SlicesStep,
        local: torch.Tensor,
        result: torch.Tensor,
        choice: Choice,
        meanwhile: Callable[[], None],
    ) -> CallRecord:
        """One coalesced gather whose outputs are strided views of ``result``: per run of equally sized
        slices, rank r's rows land where each parameter's r-th slice goes, so the backend's own copy
        out of its staging is the reorder. No staging of collgrad's, no reorder copy."""
        world, pg = group.world, self.call.source.groups.get(group.index)
        local = local.to(result.dtype)  # the wire dtype (a copy only where the buffer's differs)
        inputs, outputs = [], []
        for start, stride, numel, count in step.strided:
            inputs.append(
                local.as_strided((1, count, numel), (count * stride, stride, 1), local.storage_offset() + start)
            )
            outputs.append(
                result.as_strided(
                    (world, count, numel), (numel, world * stride, 1), result.storage_offset() + world * start
                )
            )
        what = (
            f"the gather of {step.span} x {result.dtype} per rank ({len(inputs)} run(s), coalesced over gloo, "
            f"group {group.group_ranks})"
        )
        if not inputs:  # every slice empty (the same layout, so the same on every rank): nothing to send
            meanwhile()
            return CallRecord(Op.ALL_GATHER, group.group_ranks, (), ())
        work = _compat.all_gather_coalesced(pg, outputs, inputs)
        try:
            meanwhile()
        finally:  # this rank never leaves a collective of its own behind
            wait_work(work, self.call.dispatcher.timeout, what)
        bucket = BucketRecord(
            index=0,
            device=str(result.device),
            dtype=local.dtype,
            wire_dtype=result.dtype,
            primitive=Primitive.COALESCED,
            backend=choice.backend,
            numel=step.span,
            bytes=step.span * result.element_size(),
            tensors=len(step.names),
            collectives=1,
        )
        why = "gloo lays a coalesced gather out into strided views: parameter-major, no reorder copy"
        decision = Decision(result.device.type, local.dtype, Primitive.COALESCED, choice.backend, result.dtype, why)
        return CallRecord(Op.ALL_GATHER, group.group_ranks, (bucket,), (decision,))

    def _coalesced(self, group: GradGroup) -> bool:
        """Whether this group's gathers go through the coalesced primitive (NCCL and XCCL run it as
        grouped per-tensor gathers into the outputs given; Gloo flattens it itself, so it chooses a
        flat buffer)."""
        return self.call.primitive(group, Op.ALL_GATHER, group.wire_dtype) is Primitive.COALESCED

    def _staging(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """Scratch for gathered slices, reused across calls (never returned: results are copies).
        At most one bucket, or one parameter's gathered size where that is larger."""
        key = (dtype, device)
        cache = self.call.source.scratch
        found = cache.get(key)
        if found is None or found.numel() < numel:
            found = cache[key] = torch.empty(numel, dtype=dtype, device=device)
        return found[:numel]

    def _all_reduce(self, gplan, group: GradGroup, buffer: Pieces, b: int, batch, calls) -> Result:
        """This rank's fragments copied into a bucket zeroed elsewhere, one sum over the group."""
        c = self.call
        device = c.source.device
        rank = rank_in(group)
        key = ("all_reduce step", group.index, batch, rank)  # the batch itself: calls batch differently
        step = c.source.plans.get(key)
        if step is None:  # pure layout: cached with the source
            step = c.source.plans[key] = _reduce_step(group, batch, rank)
        total, mine, gaps = step
        result = torch.empty(total, dtype=group.out_dtype, device=device)
        for lo, n in gaps:  # only what no fragment of this rank fills
            result[lo : lo + n].zero_()
        moved = bool(mine) and buffer.device != device
        if moved:  # offloaded: this rank's part moves once per bucket
            lo = min(f.local_offset for f, _ in mine)
            part = buffer.range(lo, max(f.local_offset + f.numel for f, _ in mine) - lo)
            mine = [(Fragment(f.param, f.param_offset, f.local_offset - lo, f.numel), at) for f, at in mine]
            buffer = Pieces([part.to(device)])
        runs, single = [], mine
        placed = buffer.placement() if mine else None
        if placed is not None:  # a run of equal fragments (a model's repeated layers) in one copy
            span, placement = placed
            copies = c.source.plans.get(("all_reduce copies", key, moved))
            if copies is None or copies[0] != (placement, buffer.starts):  # where the pieces lie, their sizes
                copies = ((placement, buffer.starts), *_copy_plan(mine, buffer))
                c.source.plans[("all_reduce copies", key, moved)] = copies
            _, runs, single = copies
            for run in runs:
                _copy_rows(result, span, run)
        for frag, at in single:  # straight from where each fragment lies into the bucket
            result[at : at + frag.numel].copy_(buffer.range(frag.local_offset, frag.numel))
        views = list(result.split([group.params[k].numel for k in batch]))  # back to back, in batch order
        # The bucket as one tensor (one collective, no per-tensor bookkeeping), unless the registry
        # sends one collective per tensor for this group (then it needs the per-parameter views).
        per_tensor = self.call.primitive(group, Op.ALL_REDUCE, group.out_dtype) is Primitive.PER_TENSOR
        out: Result = []

        def shape() -> None:  # made while the sum is in flight
            out.extend((group.params[k].name, _shaped(view, group.params[k])) for k, view in zip(batch, views))

        self._run(gplan, group, b, Op.ALL_REDUCE, views if per_tensor else [result], None, calls, meanwhile=shape)
        return self._all_converted(out, result.dtype, group.out_dtype)
