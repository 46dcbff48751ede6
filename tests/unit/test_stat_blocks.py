"""Statistics reduce a rank's fragments block by block (on a CPU, blocks that fit the core's cache):
every element of every fragment is read exactly once, credited to its parameter, and no block is
larger than asked, except rows of a run, which are never cut."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.layout import Fragment
from collgrad.state.stat_blocks import Rows as _Rows
from collgrad.state.stat_blocks import blocks as _blocks


def _fragments(sizes_and_gaps):
    frags, offset = [], 0
    for k, (numel, gap) in enumerate(sizes_and_gaps):
        offset += gap
        frags.append(Fragment(k % 7, 0, offset, numel))  # several fragments may share a parameter
        offset += numel
    return tuple(frags)


def _elements(blocks, sizes, owners):
    """(element offset -> parameter credited) for every element the blocks read, and each block's size."""
    read: Counter = Counter()
    credit = {}
    k = 0
    for block, size in zip(blocks, sizes):
        if isinstance(block, _Rows):
            assert size == block.count and (block.count == 1 or block.stride >= block.numel)
            items = [(block.offset + r * block.stride, block.numel) for r in range(block.count)]
        else:
            assert size == len(block)
            items = list(block)
        for offset, numel in items:
            for e in range(offset, offset + numel):
                read[e] += 1
                credit[e] = owners[k]
            k += 1
    assert k == len(owners)
    return read, credit


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), max_size=30),
    st.sampled_from([0, 1, 5, 16, 64]),
)
def test_every_element_read_once_credited_to_its_parameter(sizes_and_gaps, block):
    frags = _fragments(sizes_and_gaps)
    blocks, sizes, owners = _blocks(frags, block)
    read, credit = _elements(blocks, sizes, owners)
    expected = {e: f.param for f in frags for e in range(f.local_offset, f.local_offset + f.numel)}
    assert credit == expected and set(read.values()) <= {1}
    for b in blocks:
        if block and isinstance(b, _Rows):
            assert b.numel <= block and (b.count == 1 or b.count * b.numel <= max(block, b.numel))
        elif block:
            assert sum(n for _, n in b) <= block or len(b) == 1
            assert all(n <= block for _, n in b)


def test_repeated_layers_go_in_row_blocks_that_fit():
    frags = _fragments([(1000, 0)] * 100)  # 100 equal tensors back to back: one run
    blocks, sizes, _ = _blocks(frags, 4096)
    assert all(isinstance(b, _Rows) for b in blocks) and sizes == [4] * 25
    whole, sizes, _ = _blocks(frags, 0)  # unlimited (an accelerator): the run in one block
    assert whole == [_Rows(0, 100, 1000, 1000)] and sizes == [100]


def test_a_large_tensor_is_cut_into_spans():
    blocks, sizes, owners = _blocks(_fragments([(10_000, 0)]), 4096)
    assert blocks == [((0, 4096),), ((4096, 4096),), ((8192, 1808),)] and owners == [0, 0, 0]


def test_empty_fragments_are_skipped():
    frags = (Fragment(0, 0, 0, 0), Fragment(1, 0, 0, 0), Fragment(2, 0, 0, 5), Fragment(3, 0, 5, 0))
    for block in (0, 4):
        blocks, sizes, owners = _blocks(frags, block)
        assert set(owners) == {2} and sum(sizes) == len(owners)
