"""Where this rank's gradient pieces lie, as a gather of partitions sends them, and what a rank tells the
others of it in the readiness check: a print of its placements (or -1: they changed, exchange them
again before a gather) and how many pieces it holds (the width of that exchange's row).
"""

from __future__ import annotations

from typing import Sequence

from collgrad.backends.agreement import stable_hash
from collgrad.core.buffers import Pieces, main_run, run_view
from collgrad.state.adapters.base import GroupBuffer
from collgrad.state.cache import PlanCache
from collgrad.state.layout import Partitioning, StateLayout
from collgrad.state.steps import Sent, sent_pieces

__all__ = ["placed", "sent_message", "placement_print", "piece_count", "CHANGED"]

#: Told instead of a print: this rank's cached placements no longer hold (or none are cached).
CHANGED = -1


def placed(buffer: Pieces) -> Sent:
    """How a gather of ``buffer``'s partition sends it (``steps.Sent``): its main run of pieces
    (``buffers.main_run``) as it lies, then the rest concatenated. Kept with the buffer."""
    found: Sent | None = buffer.memo.get("placed pieces")
    if found is None:
        found = sent_pieces(buffer.starts, [p.numel() for p in buffer.given], main_run(buffer))
        buffer.memo["placed pieces"] = found
    return found


def sent_message(buffer: Pieces) -> Pieces:
    """What a gather of ``buffer``'s partition sends, as pieces in that order: a view of its main run,
    then the other pieces in the partition's order (``placed``)."""
    run = main_run(buffer)
    rest: tuple[int, ...] | None = buffer.memo.get("not in the main run")
    if rest is None:
        members = set(run)
        rest = buffer.memo["not in the main run"] = tuple(k for k in range(len(buffer.given)) if k not in members)
    others = [buffer.piece(k) for k in rest]
    return Pieces([run_view(buffer, run), *others] if run else others)


def _gathered_as_they_lie(layout: StateLayout, buffers: Sequence[GroupBuffer]) -> list[tuple[int, Pieces]]:
    """(group index, buffer) of every group gathered as its partitions lie (ZeRO-1/2)."""
    return [
        (layout.groups[position].index, buffer)
        for position, buffer in enumerate(buffers)
        if isinstance(buffer, Pieces) and layout.groups[position].kind is Partitioning.PARTITIONED_FLAT
    ]


def placement_print(layout: StateLayout, plans: PlanCache, buffers: Sequence[GroupBuffer]) -> int:
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


def piece_count(layout: StateLayout, buffers: Sequence[GroupBuffer]) -> int:
    """The most pieces this rank holds in any group gathered as its partitions lie: a placements
    exchange pads every rank's row to three numbers per piece of the largest count told."""
    return max((len(placed(buffer).pieces) for _, buffer in _gathered_as_they_lie(layout, buffers)), default=0)
