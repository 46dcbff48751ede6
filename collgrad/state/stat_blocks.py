"""How the statistics read a rank's fragments, as data: blocks of its storage span, built by a pure
function (``blocks``) from where the fragments lie. No process group; tested without ranks.

    span     | a0 . b0 . a1 . b1 . a2 . b2 . c |     a0 a1 a2: one layer of three repeated blocks
    blocks   Rows(a0, count 3, stride)  Rows(b0, count 3, stride)  Spans((c,))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collgrad.state.layout import Fragment, strided_runs

__all__ = ["CPU_BLOCK_BYTES", "Rows", "Spans", "Block", "Arranged", "blocks"]

#: Bytes reduced at a time on a CPU. Norm, min and max each read the gradient; going block by block,
#: the second and third reads come from the core's own cache instead of memory (L2 is 1-2 MiB per core
#: on current x86 servers; measurements: docs/notes/). Accelerators reduce whole runs: a block is a
#: kernel launch there.
CPU_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Rows:
    """``count`` rows of ``numel`` elements, ``stride`` apart from ``offset`` in the span: one strided 2-D
    view, reduced along its rows in one call per statistic."""

    offset: int
    count: int
    numel: int
    stride: int


#: Spans (offset in the span, numel) reduced one by one (a norm for all in one call).
Spans = tuple[tuple[int, int], ...]
Block = Rows | Spans


@dataclass(frozen=True)
class Arranged:
    """This rank's fragments of a group arranged for reduction, for one placement of its pieces:
    ``blocks`` of the pieces' storage span (rows of repeated blocks, or spans), each a few calls;
    ``loose`` fragments straddle two pieces and are read by range; ``index``: the parameter of each
    result, in reduction order (a parameter cut in spans has several: their partials add up)."""

    placement: tuple[int, ...]
    blocks: tuple[Block, ...]
    #: results per block, then one per loose fragment
    sizes: tuple[int, ...]
    loose: tuple[Fragment, ...]
    index: torch.Tensor


def blocks(placed: tuple[Fragment, ...], block: int) -> tuple[list[Block], list[int], list[int]]:
    """Pure: ``placed`` fragments as blocks of at most ``block`` elements (0: unlimited): runs of
    equal fragments as rows, as many rows a block as fit; the other fragments, and rows larger than a
    block, as spans cut to ``block``. Returns the blocks, each one's number of results, and the
    parameter of each result."""
    out: list[Block] = []
    sizes: list[int] = []
    owners: list[int] = []
    spans: list[tuple[int, int, int]] = []  # (offset, numel, parameter), reduced one by one
    placed = tuple(f for f in placed if f.numel)  # an empty parameter's partials stay zero
    for run in strided_runs(placed):
        if run.count > 1 and (block == 0 or run.numel <= block):
            per = run.count if block == 0 else max(1, block // run.numel)
            for i in range(0, run.count, per):
                rows = run.frags[i : i + per]
                out.append(Rows(run.local_offset + i * run.stride, len(rows), run.numel, run.stride))
                sizes.append(len(rows))
                owners += [placed[k].param for k in rows]
            continue
        for i, k in enumerate(run.frags):
            offset, left = run.local_offset + i * run.stride, run.numel
            cut = left if block == 0 else block
            while True:
                spans.append((offset, min(cut, left), placed[k].param))
                offset, left = offset + cut, left - cut
                if left <= 0:
                    break
    group: list[tuple[int, int]] = []
    filled = 0
    for offset, numel, param in spans:  # the spans in blocks of about ``block`` elements
        if group and block and filled + numel > block:
            out.append(tuple(group))
            sizes.append(len(group))
            group, filled = [], 0
        group.append((offset, numel))
        filled += numel
        owners.append(param)
    if group:
        out.append(tuple(group))
        sizes.append(len(group))
    return out, sizes, owners
