"""Executors: run an opened call's GradPlan, one step at a time, and hand back full gradients.

One small function per plan kind; none decides anything (the plan and its steps did: plan.py,
steps.py), each only moves bytes:

  local       copies (or views) of what this rank already holds                   (here)
  all_gather  ZeRO-1/2: one gather of the partitions as they lie, then views       gather_flat.py
              ZeRO-3 / FSDP2: the batch's slices, laid out parameter-major          gather_sliced.py
  all_reduce  this rank's fragments copied into a zeroed bucket, one sum            reduce.py
  accessor    DeepSpeed's own accessor, one collective per parameter               (here)
"""

from __future__ import annotations

from typing import Callable, Iterator

from collgrad.core.buffers import Pieces
from collgrad.core.record import CallRecord
from collgrad.state.adapters.base import Source
from collgrad.state.call import OpenCall
from collgrad.state.gather_flat import gather_flat
from collgrad.state.gather_sliced import gather_sliced
from collgrad.state.layout import LayoutGroup, Partitioning, owned_fragments
from collgrad.state.plan import GroupPlan, PlanKind
from collgrad.state.record import GroupRecord, StateRecord
from collgrad.state.reduce import all_reduce
from collgrad.state.runner import Result, Step, converted, no_history, shaped

__all__ = ["Executor", "Result", "accessor_bytes"]


class Executor:
    """Runs ``call.plan``; ``steps()`` yields each step's results, ``record()`` tells what was done."""

    def __init__(self, call: OpenCall, *, copy: bool = True, uncopied: frozenset[str] = frozenset()) -> None:
        """``uncopied``: parameters whose results the caller copies itself (whole mode's shards, copied
        into the model-parallel gather): handed out as held even with ``copy``."""
        self.call = call
        #: False: where this rank holds a gradient whole (no collective), hand out the tensor itself
        self.copy = copy
        self.uncopied = uncopied
        self.group_records: list[GroupRecord] = []
        self.per_param_collectives = 0
        self.accessor_bytes = 0
        self._kinds: dict[PlanKind, Callable[[Step], Result]] = {
            PlanKind.ACCESSOR: self._accessor,
            PlanKind.LOCAL: self._local,
            PlanKind.ALL_GATHER: _gather,
            PlanKind.ALL_REDUCE: all_reduce,
        }

    def record(self) -> StateRecord:
        c = self.call
        return StateRecord(
            c.source.layout.variant,
            tuple(self.group_records),
            self.per_param_collectives,
            c.local.loss_scale,
            c.unscale,
            c.cached,
            c.layout_cached,
            self.accessor_bytes,
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
            run = self._kinds[gplan.kind]
            for b, batch in enumerate(gplan.batches):
                results = run(Step(c, gplan, group, buffer, b, batch, calls))
                self._note(gplan, group, calls)
                yield results
                del results
            if not gplan.batches:
                self._note(gplan, group, calls)

    def _note(self, gplan: GroupPlan, group: LayoutGroup, calls: list[CallRecord]) -> None:
        rec = GroupRecord(group.index, group.kind, gplan.kind, group.group_ranks, len(group.params), tuple(calls))
        if self.group_records and self.group_records[-1].group == group.index:
            self.group_records[-1] = rec
        else:
            self.group_records.append(rec)

    def _accessor(self, step: Step) -> Result:
        """DeepSpeed's own accessor, one collective per parameter."""
        c = self.call
        accessor = c.source.accessor
        assert accessor is not None  # the plan chose it because the source has one
        out = []
        for k in step.batch:
            slot = step.group.params[k]
            grad = accessor(c.source.params[slot.name])
            self.per_param_collectives += 1
            self.accessor_bytes += accessor_bytes(c.source, step.group, slot.numel)
            if c.unscale:
                grad = grad / c.local.loss_scale
            out.append((slot.name, grad))
        return out

    def _local(self, step: Step) -> Result:
        """What this rank already holds: copies, or with ``copy=False`` the tensors themselves."""
        copy, group, batch, buffer = self.copy, step.group, step.batch, step.buffer
        uncopied = self.uncopied
        if group.kind is Partitioning.REPLICATED:
            assert isinstance(buffer, list)
            params, out_dtype = group.params, group.out_dtype
            # copy=False: the optimizer's tensor itself (no autograd history to cut: a .grad, a _hp_grad),
            # not a new tensor object per gradient
            copies = [copy and params[k].name not in uncopied for k in batch]
            grads = [buffer[k].detach().clone() if c else no_history(buffer[k]) for k, c in zip(batch, copies)]
            if self.call.unscale or any(g.dtype is not out_dtype for g in grads):
                grads = [converted(self.call, g, out_dtype, owned=c) for g, c in zip(grads, copies)]
            return [(params[k].name, shaped(g, params[k])) for k, g in zip(batch, grads)]
        assert isinstance(buffer, Pieces)
        out = []
        wanted = set(batch)
        for frag in owned_fragments(group, 0):  # a group of one rank owns everything
            if frag.param in wanted:
                slot = group.params[frag.param]
                piece = buffer.range(frag.local_offset, frag.numel)
                copied = copy and slot.name not in uncopied
                moved = piece.to(self.call.source.device, copy=copied)
                owned = copied or moved.data_ptr() != piece.data_ptr()  # moved, or a concatenation of pieces
                out.append((slot.name, converted(self.call, shaped(moved, slot), group.out_dtype, owned=owned)))
        return out


def accessor_bytes(source: Source, group: LayoutGroup, numel: int) -> int:
    """What DeepSpeed's per-parameter accessor sends for a parameter of ``numel`` elements: ZeRO-1/2
    and BF16_Optimizer all-reduce the whole of it in fp32 (a zero-filled buffer holding this rank's
    fragment), ZeRO-3 all-gathers this rank's fp32 partition."""
    if source.accessor_gathers:
        return -(-numel // group.world) * 4
    return numel * 4


def _gather(step: Step) -> Result:
    if step.group.kind is Partitioning.PARTITIONED_FLAT:
        return gather_flat(step)
    return gather_sliced(step)
