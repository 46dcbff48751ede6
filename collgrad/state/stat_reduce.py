"""The statistics' local reductions: this rank's fragments of a group reduced where they lie (no copy,
no move off an offload device, no communication) to three partials per parameter: sum of squares,
max |g| and the count of non-finite elements. Block by block on a CPU (stat_blocks.py).
"""

from __future__ import annotations

import bisect
import math
from typing import Callable

import torch

from collgrad import _compat
from collgrad.core.buffers import Pieces
from collgrad.state import stat_blocks
from collgrad.state.adapters.base import GroupBuffer, rank_in
from collgrad.state.cache import PlanCache
from collgrad.state.layout import Fragment, LayoutGroup, Partitioning, owned_fragments
from collgrad.state.stat_blocks import Arranged, Rows, blocks

__all__ = ["partials"]

_Reduced = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[int], torch.Tensor]]


def _arranged(plans: PlanCache, group: LayoutGroup, buffer: Pieces, placement: tuple[int, ...]) -> Arranged:
    """The arrangement for ``placement`` (the offset of each piece in its storage span), from the cache
    while the pieces stay where they are (DeepSpeed keeps its buffers: the usual case)."""
    found = plans.arrangements.get(group.index)
    if found is not None and found.placement == placement:
        return found
    placed: list[Fragment] = []
    loose: list[Fragment] = []  # fragments within one piece, at their offset in the span; the others
    for f in _fragments(group, buffer):
        at = buffer.span_offset(f.local_offset, f.numel)
        if at is None:
            loose.append(f)
        else:
            placed.append(Fragment(f.param, f.param_offset, at, f.numel))
    found_blocks, sizes, owners = blocks(tuple(placed), _block_elements(buffer))
    found = plans.arrangements[group.index] = Arranged(
        placement,
        tuple(found_blocks),
        tuple(sizes) + (1,) * len(loose),
        tuple(loose),
        torch.tensor(owners + [f.param for f in loose], dtype=torch.int64),
    )
    return found


def _fragments(group: LayoutGroup, buffer: Pieces) -> tuple[Fragment, ...]:
    """This rank's fragments of ``group`` in ``buffer``: its owned ones, or every gradient whole (one
    piece each) where the group is replicated."""
    if group.kind is Partitioning.REPLICATED:
        return tuple(Fragment(k, 0, start, p.numel()) for k, (start, p) in enumerate(zip(buffer.starts, buffer.pieces)))
    return owned_fragments(group, rank_in(group))


def _block_elements(buffer: Pieces) -> int:
    """``stat_blocks.CPU_BLOCK_BYTES`` (read at each call: tests set it) in elements of ``buffer`` on a
    CPU; 0 (unlimited) elsewhere."""
    return stat_blocks.CPU_BLOCK_BYTES // buffer.given[0].element_size() if buffer.device.type == "cpu" else 0


def _reduce(plans: PlanCache, group: LayoutGroup, buffer: GroupBuffer) -> _Reduced:
    """Per result (a fragment, or a span of one): the parameter it belongs to, its L2 norm (accumulated
    in fp32 at least), its min and its max; and the i-th result's view (for the rare count of
    non-finite elements)."""
    if group.kind is Partitioning.REPLICATED:  # full gradients, often views of one flat buffer (BF16_Optimizer)
        assert isinstance(buffer, list)
        buffer = Pieces([buffer[k] for k in range(len(group.params))])
        if buffer.placement() is None:
            views = buffer.pieces
            return (torch.arange(len(views)), *_one_by_one(views), views.__getitem__)
    assert isinstance(buffer, Pieces)
    placed = buffer.placement()
    if placed is None:
        return _reduce_where_they_lie(group, buffer)
    span, placement = placed
    return _reduce_arranged(_arranged(plans, group, buffer, placement), span, buffer)


def _reduce_where_they_lie(group: LayoutGroup, buffer: Pieces) -> _Reduced:
    """Pieces in different storages: views of each fragment where it lies, in blocks."""
    block = _block_elements(buffer)
    views: list[torch.Tensor] = []
    owners: list[int] = []
    for f in _fragments(group, buffer):
        view = buffer.range(f.local_offset, f.numel)
        parts = view.split_with_sizes(_cuts(f.numel, block)) if block and f.numel > block else (view,)
        views += parts
        owners += [f.param] * len(parts)
    index = torch.tensor(owners, dtype=torch.int64)
    return (index, *_one_by_one(views), views.__getitem__)


def _cuts(numel: int, block: int) -> list[int]:
    """``numel`` elements in pieces of ``block`` (the last one shorter), as ``Tensor.split`` cuts them."""
    return [block] * (numel // block) + ([numel % block] if numel % block else [])


def _reduce_arranged(arranged: Arranged, span: torch.Tensor, buffer: Pieces) -> _Reduced:
    """The pieces lie in one storage span: its blocks as ``arranged`` says, a few calls each."""
    base = span.storage_offset()
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    views: list[torch.Tensor | list[torch.Tensor]] = []  # per block: its rows (2-D) or its spans
    for block in arranged.blocks:
        if isinstance(block, Rows):
            rows = span.as_strided((block.count, block.numel), (block.stride, 1), base + block.offset)
            norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.promote_types(rows.dtype, torch.float32))
            # amin and amax along rows: faster than aminmax(dim=1) on CPU (measurements: docs/notes/)
            parts.append((norms, rows.amin(1), rows.amax(1)))
            views.append(rows)
        else:
            flat = [span[offset : offset + numel] for offset, numel in block]
            parts.append(_one_by_one(flat))
            views.append(flat)
    loose = [buffer.range(f.local_offset, f.numel) for f in arranged.loose]
    if loose:
        parts.append(_one_by_one(loose))
        views += [[v] for v in loose]
    starts = [0]
    for size in arranged.sizes:
        starts.append(starts[-1] + size)

    def view_at(i: int) -> torch.Tensor:
        b = bisect.bisect_right(starts, i) - 1
        return views[b][i - starts[b]]

    if not parts:
        return (arranged.index, *_one_by_one([]), view_at)
    norms, lows, highs = (torch.cat(p) for p in zip(*parts))
    return arranged.index, norms, lows, highs, view_at


def _one_by_one(views: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norms (one foreach call), mins and maxes (aminmax: one pass each) of ``views``."""
    if not views:
        empty = torch.empty(0)
        return empty, empty, empty
    lows, highs = zip(*(torch.aminmax(v) for v in views))
    return torch.stack(_compat.vector_norms(views)), torch.stack(lows), torch.stack(highs)


def partials(plans: PlanCache, group: LayoutGroup, buffer: GroupBuffer) -> torch.Tensor:
    """[3, P] float64 on the CPU: sum of squares, max |g| and non-finite count over this rank's
    elements of each parameter."""
    out = torch.zeros(3, len(group.params), dtype=torch.float64)
    with torch.no_grad():
        index, norms, lows, highs, view_at = _reduce(plans, group, buffer)
        if len(index) == 0:
            return out
        norms = norms.double().cpu()
        peaks = torch.maximum(-lows, highs).double().cpu()
        out[0].index_add_(0, index, norms.square())
        out[1].scatter_reduce_(0, index, peaks, reduce="amax")
        finite = torch.isfinite(norms) & torch.isfinite(peaks)
        if not bool(finite.all()):  # count only where something is not finite (an overflowing norm too)
            counts = torch.zeros(len(index), dtype=torch.float64)
            for i in (~finite).nonzero().flatten().tolist():
                counts[i] = float((~torch.isfinite(view_at(i))).sum())
            out[2].index_add_(0, index, counts)
            nan = torch.isnan(peaks)  # scatter_reduce's amax skips NaN; torch.max gives NaN, so do we
            if bool(nan.any()):
                out[1].index_fill_(0, index[nan], math.nan)
    return out
