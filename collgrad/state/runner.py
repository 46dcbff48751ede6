"""What every executor of a gradient step shares: the step it runs (``Step``), one dispatcher call for it,
and the last touches of its results (the parameter's shape, the output dtype, unscaling)."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from collgrad.backends.ops import Op
from collgrad.core.record import CallRecord
from collgrad.state.adapters.base import GroupBuffer
from collgrad.state.call import OpenCall
from collgrad.state.layout import LayoutGroup, ParamSlot
from collgrad.state.plan import GroupPlan
from collgrad.state.steps import ViewRun

__all__ = ["Result", "Step", "viewed", "shaped", "no_history", "converted", "all_converted"]

#: A step's results: (parameter name, full gradient) each.
Result = list[tuple[str, torch.Tensor]]


class Step:
    """Step ``b`` of ``gplan`` (its parameters: ``batch``) over ``group``, this rank's ``buffer`` of the
    group, and the records of the dispatcher calls made for the group so far (``calls``)."""

    def __init__(
        self,
        call: OpenCall,
        gplan: GroupPlan,
        group: LayoutGroup,
        buffer: GroupBuffer | None,
        b: int,
        batch: tuple[int, ...],
        calls: list[CallRecord],
    ) -> None:
        self.call, self.gplan, self.group, self.buffer = call, gplan, group, buffer
        self.b, self.batch, self.calls = b, batch, calls

    def run(
        self,
        op: Op,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
        *,
        bucket_bytes: int | None = None,
        done: Callable[[int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
        strided: bool = False,
        whole: bool = False,
        variant: Hashable = None,
    ) -> None:
        """One dispatcher call for this step (see ``OpenCall.run``): its bucket plan is built once and
        reused across calls; its record joins ``calls``. ``variant``: what else decides the tensors'
        sizes, where the layout alone does not (a ZeRO-1/2 gather's chunks follow the placements)."""
        pg = self.call.source.groups.get(self.group.index)
        record = self.call.run(
            (self.gplan.group, self.b, variant),
            op,
            inputs,
            outputs,
            pg,
            bucket_bytes=bucket_bytes,
            done=done,
            meanwhile=meanwhile,
            strided=strided,
            whole=whole,
        )
        self.calls.append(record)


def viewed(buffer: torch.Tensor, runs: Sequence[ViewRun], count: int) -> list[torch.Tensor | None]:
    """The views ``runs`` say, of 1-D ``buffer``, by position (None where no run has one): a call per run
    (``as_strided``, then ``unbind``: ~0.5 us a view, against ~2 us for a split and a view each). Reads
    no data."""
    out: list[torch.Tensor | None] = [None] * count
    base = buffer.storage_offset()
    for run in runs:
        strides = [1] * len(run.shape)
        for i in range(len(run.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * run.shape[i + 1]
        if len(run.positions) == 1:
            out[run.positions[0]] = buffer.as_strided(run.shape, strides, base + run.start)
            continue
        rows = buffer.as_strided((len(run.positions), *run.shape), (run.stride, *strides), base + run.start)
        for k, view in zip(run.positions, rows.unbind(0)):
            out[k] = view
    return out


def shaped(grad: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """``grad`` in its parameter's shape (itself where it has it: no view object per call); reads no
    data."""
    return grad if grad.shape == slot.shape else grad.view(slot.shape)


def no_history(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` itself unless it carries autograd history (then detached from it)."""
    return grad.detach() if grad.requires_grad or grad.grad_fn is not None else grad


def converted(call: OpenCall, grad: torch.Tensor, out_dtype: torch.dtype, *, owned: bool = True) -> torch.Tensor:
    """``grad`` in ``out_dtype``, unscaled; in place only if ``owned`` (collgrad's own buffer) or
    converted (a copy already), never in a tensor of the optimizer's."""
    if grad.dtype is not out_dtype:
        grad, owned = grad.to(out_dtype), True
    if call.unscale:
        scale = call.local.loss_scale
        grad = grad.div_(scale) if owned else grad / scale
    return grad


def all_converted(call: OpenCall, out: Result, dtype: torch.dtype, out_dtype: torch.dtype) -> Result:
    """``out`` (views made while the data was in flight) converted, now that it has arrived."""
    if dtype is out_dtype and not call.unscale:
        return out
    return [(name, converted(call, grad, out_dtype)) for name, grad in out]
