"""Statistics reduce a rank's fragments as strided runs: every fragment in exactly one run, each run
exactly the fragments it claims, and a model of repeated blocks in a few runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.state.layout import Fragment, strided_runs


def _fragments(sizes_and_gaps):
    frags, offset = [], 0
    for k, (numel, gap) in enumerate(sizes_and_gaps):
        offset += gap
        frags.append(Fragment(k, 0, offset, numel))
        offset += numel
    return tuple(frags)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), max_size=40))
def test_every_fragment_in_exactly_one_run_at_the_place_it_lies(sizes_and_gaps):
    frags = _fragments(sizes_and_gaps)
    runs = strided_runs(frags)
    assert sorted(i for r in runs for i in r.frags) == list(range(len(frags)))
    for run in runs:
        assert run.count >= 1 and (run.count == 1 or run.stride >= run.numel)  # rows never overlap
        for row, i in enumerate(run.frags):
            assert frags[i].numel == run.numel
            assert frags[i].local_offset == run.local_offset + row * run.stride


def test_repeated_blocks_make_one_run_per_layer():
    # 50 blocks of [weight 81, bias 9, norm weight 9, norm bias 9]: 4 runs (one per layer), not 200
    block = [(81, 0), (9, 0), (9, 0), (9, 0)]
    runs = strided_runs(_fragments(block * 50))
    assert sorted((r.numel, r.count, r.stride) for r in runs) == [(9, 50, 108)] * 3 + [(81, 50, 108)]


def test_equal_tensors_back_to_back_make_one_run():
    runs = strided_runs(_fragments([(16, 0)] * 200))
    assert [(r.count, r.stride) for r in runs] == [(200, 16)]
