"""Where this rank's gradient pieces lie, as a gather of partitions sends them, and what a rank tells the
others of it in the readiness check: a print of its placements (or -1: they changed, exchange them
again before a gather) and how many pieces it holds (the width of that exchange's row).
"""

from __future__ import annotations

from typing import Any, Sequence

from collgrad.backends.agreement import stable_hash
from collgrad.core.buffers import Pieces
from collgrad.grads.cache import PlanCache
from collgrad.grads.sources.layout import GradLayout, Kind
from collgrad.grads.steps import placed_pieces

__all__ = ["placed", "placement_print", "piece_count", "CHANGED"]

#: Told instead of a print: this rank's cached placements no longer hold (or none are cached).
CHANGED = -1


def placed(buffer: Pieces) -> tuple[tuple[int, int, int], ...]:
    """``buffer``'s pieces as a gather of its partition sends them (``steps.placed_pieces``): sent as they
    lie when they tile one storage span, else concatenated. Kept with the buffer."""
    found: tuple[tuple[int, int, int], ...] | None = buffer.memo.get("placed pieces")
    if found is None:
        tiling = buffer.tiling()
        sent = tiling[1] if tiling is not None else buffer.starts
        found = placed_pieces(buffer.starts, sent, [p.numel() for p in buffer.pieces])
        buffer.memo["placed pieces"] = found
    return found


def _gathered_as_they_lie(layout: GradLayout, buffers: Sequence[Any]) -> list[tuple[int, Pieces]]:
    """(group index, buffer) of every group gathered as its partitions lie (ZeRO-1/2)."""
    return [
        (layout.groups[position].index, buffer)
        for position, buffer in enumerate(buffers)
        if isinstance(buffer, Pieces) and layout.groups[position].kind is Kind.PARTITIONED_FLAT
    ]


def placement_print(layout: GradLayout, plans: PlanCache, buffers: Sequence[Any]) -> int:
    """What this rank tells the others of where its gradient pieces lie: a print of them if the
    placements cached in ``plans`` still hold for every group, else ``CHANGED``, which makes every
    rank exchange placements again before such a gather."""
    prints = []
    for index, buffer in _gathered_as_they_lie(layout, buffers):
        pieces = placed(buffer)
        cached = plans.placements.get(index)
        if cached is None or cached.pieces != pieces:
            return CHANGED
        if "placed print" not in buffer.memo:
            buffer.memo["placed print"] = stable_hash(pieces)
        prints.append(buffer.memo["placed print"])
    return stable_hash(prints) & ((1 << 62) - 1)


def piece_count(layout: GradLayout, buffers: Sequence[Any]) -> int:
    """The most pieces this rank holds in any group gathered as its partitions lie: a placements
    exchange pads every rank's row to three numbers per piece of the largest count told."""
    return max((len(placed(buffer)) for _, buffer in _gathered_as_they_lie(layout, buffers)), default=0)
