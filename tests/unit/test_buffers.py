import torch

from collgrad.core.buffers import Pieces, adjacent_view


def test_adjacent_views_of_one_buffer_become_one_view():
    flat = torch.arange(10.0)
    run = adjacent_view([flat[2:5], flat[5:6], flat[6:9]])
    assert run is not None and run.data_ptr() == flat[2:].data_ptr() and torch.equal(run, flat[2:9])
    run.mul_(2)  # a view, not a copy
    assert flat[2] == 4


def test_gaps_order_dtype_and_storage_break_adjacency():
    flat = torch.arange(10.0)
    assert adjacent_view([flat[0:2], flat[3:5]]) is None  # gap
    assert adjacent_view([flat[2:4], flat[0:2]]) is None  # out of order
    assert adjacent_view([flat[0:2], torch.arange(2.0)]) is None  # another storage
    assert adjacent_view([flat.view(2, 5)[:, :2]]) is None  # not contiguous
    assert adjacent_view([]) is None


def test_pieces_read_ranges_across_pieces():
    from collgrad.core.buffers import Pieces

    a, b, c = torch.arange(0.0, 5), torch.arange(5.0, 8), torch.arange(8.0, 12)
    pieces = Pieces([a, b.view(3, 1), c])
    assert pieces.numel() == 12 and torch.equal(pieces.whole(), torch.arange(12.0))
    inside = pieces.range(1, 3)
    assert torch.equal(inside, torch.tensor([1.0, 2, 3])) and inside.data_ptr() == a[1:].data_ptr()  # a view
    assert torch.equal(pieces.range(4, 6), torch.arange(4.0, 10))  # spans three pieces: a copy
    flat = torch.arange(6.0)
    adjacent = Pieces([flat[:2], flat[2:6]])
    assert adjacent.whole().data_ptr() == flat.data_ptr()  # back to back already: no copy


def test_ranges_over_pieces_in_storage_order_are_views_of_the_span():
    flat = torch.arange(20.0)
    in_order = Pieces([flat[2:5], flat[5:9], flat[9:10], flat[10:16]])  # ZeRO-3's slices of one buffer
    for offset, numel in [(0, 14), (1, 7), (3, 11), (4, 3), (7, 7), (13, 1)]:
        got = in_order.range(offset, numel)
        assert torch.equal(got, torch.arange(2.0 + offset, 2.0 + offset + numel))
        assert got.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # no copy
    # reversed (ZeRO-1/2's fragments), a gap, or another storage between: a copy of the same values
    reversed_ = Pieces([flat[10:13], flat[5:10], flat[0:5]])
    gap = Pieces([flat[0:3], flat[4:8]])
    mixed = Pieces([flat[0:3], torch.arange(3.0, 6.0), flat[6:9]])
    for pieces, values in [
        (reversed_, torch.cat([flat[10:13], flat[5:10], flat[0:5]])),
        (gap, torch.cat([flat[0:3], flat[4:8]])),
        (mixed, torch.arange(9.0)),
    ]:
        got = pieces.range(1, pieces.numel() - 2)
        assert torch.equal(got, values[1:-1])
        assert got.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        assert torch.equal(pieces.range(1, pieces.numel() - 2), values[1:-1])  # again, from the memo


def test_write_lands_in_place_across_pieces():
    a, b, c = torch.zeros(3), torch.zeros(2), torch.zeros(4)
    pieces = Pieces([a, b, c])
    pieces.write(2, torch.arange(1.0, 5.0))  # elements 2..5: the last of a, all of b, the first of c
    assert a.tolist() == [0, 0, 1] and b.tolist() == [2, 3] and c.tolist() == [4, 0, 0, 0]
    assert torch.equal(pieces.range(2, 4), torch.arange(1.0, 5.0))


def test_pieces_cache_reuses_where_the_same_fragments_lie_and_holds_them_weakly():
    import gc
    import weakref

    from collgrad.core.buffers import PiecesCache

    def fragments(flat):  # DeepSpeed's ZeRO-1/2 order: back to front in one storage
        return [flat[6:10], flat[2:6], flat[0:2]]

    cache, flat = PiecesCache(), torch.arange(12.0)
    frags = fragments(flat)
    first = cache.pieces(frags)
    first.memo["derived"] = 1
    again = cache.pieces(frags)
    assert again is not first and again.memo is first.memo  # known, not worked out again
    span, offsets = again.placement()
    assert offsets == (6, 2, 0) and span.data_ptr() == flat.data_ptr() and span.numel() == 10
    assert again.tiling() is not None and torch.equal(again.whole(), torch.cat(frags))
    assert again.starts == [0, 4, 8] and again.numel() == 10
    # a fragment replaced (DeepSpeed's next step), or the list re-made: worked out anew
    replaced = cache.pieces([frags[0], flat[1:5], frags[2]])
    assert "derived" not in replaced.memo and replaced.tiling() is None
    # a fragment re-pointed in place (``.data =``): worked out anew, from where it lies now
    frags = fragments(flat)
    cache.pieces(frags)
    elsewhere = torch.arange(100.0, 112.0)
    frags[1].data = elsewhere[2:6]
    moved = cache.pieces(frags)
    assert moved.placement() is None and torch.equal(moved.whole(), torch.cat([flat[6:10], elsewhere[2:6], flat[0:2]]))
    # held weakly: the gradient memory goes when its owner lets go of it
    other = torch.arange(8.0)
    cache.pieces(fragments(other))
    ref = weakref.ref(other)  # its views (what the cache saw) keep it alive as their base
    del other
    gc.collect()
    assert ref() is None


def test_span_offset_is_where_a_range_lies_in_the_storage_span():
    flat = torch.arange(10.0)
    pieces = Pieces([flat[6:10], flat[2:6], flat[0:2]])  # back to front, as DeepSpeed's ZeRO-1/2 list
    assert pieces.span_offset(0, 4) == 6 and pieces.span_offset(5, 2) == 3 and pieces.span_offset(8, 2) == 0
    assert pieces.span_offset(3, 2) is None  # straddles two pieces
    assert Pieces([flat[0:2], torch.arange(3.0)]).span_offset(0, 1) is None  # two storages: no span


def test_the_main_run_is_the_longest_back_to_back_stretch_and_its_view_aliases_it():
    from collgrad.core.buffers import main_run, run_view

    storage, pad = torch.arange(20.0), torch.zeros(3)
    # DeepSpeed's ZeRO-2 fragments: back to front in one buffer, a straddler at the front of its whole
    # slot (a gap after it), the tail padding a tensor of its own
    pieces = Pieces([storage[14:20], storage[8:14], storage[0:2], pad])
    run = main_run(pieces)
    assert run == (1, 0)  # 8..20, in storage order
    view = run_view(pieces, run)
    assert view.data_ptr() == storage[8:].data_ptr() and torch.equal(view, storage[8:20])
    tiled = Pieces([storage[5:10], storage[0:5]])
    assert main_run(tiled) == (1, 0) and torch.equal(run_view(tiled, main_run(tiled)), storage[:10])
    assert main_run(Pieces([torch.zeros(4), torch.zeros(2)])) == (0,)  # no two back to back: the longest


def test_copies_of_parts_that_follow_each_other_on_both_sides_are_joined_into_one_per_run():
    from collgrad.core.buffers import joined_copies

    source, target = torch.arange(12.0), torch.zeros(12)
    sizes = [2, 3, 1, 4, 2]
    sources, targets = list(source.split(sizes)), list(target.split(sizes))
    # a gap in the values between parts 2 and 3 (another buffer), and part 4's target elsewhere
    sources[3] = torch.arange(6.0, 10.0)
    targets[4] = torch.zeros(2)
    joined_targets, joined_sources = joined_copies(targets, sources)
    assert [t.numel() for t in joined_targets] == [6, 4, 2] == [s.numel() for s in joined_sources]
    assert joined_targets[0].data_ptr() == target.data_ptr() and joined_sources[0].data_ptr() == source.data_ptr()
    torch._foreach_copy_(joined_targets, joined_sources)
    assert torch.equal(target[:10], torch.arange(10.0)) and torch.equal(targets[4], torch.arange(10.0, 12.0))
    # targets out of order are not joined
    backwards = list(reversed(list(torch.zeros(12).split(sizes))))
    assert joined_copies(backwards, list(source.split(list(reversed(sizes)))))[0] == backwards
    # another dtype among the values, or non-contiguous ones: as given
    mixed = [sources[0].double(), *sources[1:]]
    assert joined_copies(targets, mixed)[1] == mixed
    strided = [torch.arange(4.0)[::2], torch.arange(4.0)[1::2]]
    assert joined_copies(list(torch.zeros(4).split(2)), strided)[1] == strided


def test_runs_of_parts_that_follow_each_other_are_found_from_their_addresses_and_joined_per_storage():
    from collgrad.core.buffers import joined_runs, joined_source

    source = torch.arange(20.0)
    values = [source[0:4], source[4:10], source[10:20], torch.arange(3.0)]
    # parts: all of the first two, elements 2.. of the third (so it does not follow the second), the fourth
    los, numels = [0, 0, 2, 0], [4, 6, 8, 3]
    assert joined_runs(values, los, numels, [True, True, True]) == [(0, 2), (2, 3), (3, 4)]
    assert joined_runs(values, los, numels, [False, True, True]) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    joined = joined_source(values[0], 0, values[1], 10)
    assert joined is not None and joined.data_ptr() == source.data_ptr() and torch.equal(joined, source[:10])
    part = joined_source(values[2], 2, values[2], 8)
    assert part is not None and torch.equal(part, source[12:20])
    # another dtype among them, or a non-contiguous one: no runs
    assert joined_runs([values[0], values[1].double()], [0, 0], [4, 6], [True]) is None
    assert joined_runs([values[0], source[::2]], [0, 0], [4, 10], [True]) is None
    # two storages whose memory abuts (two tensors over halves of one buffer): back to back by address,
    # but one view cannot span them
    memory = bytearray(32)
    halves = [torch.frombuffer(memoryview(memory)[at : at + 16], dtype=torch.float32) for at in (0, 16)]
    assert joined_runs(halves, [0, 0], [4, 4], [True]) == [(0, 2)]
    assert joined_source(halves[0], 0, halves[1], 8) is None


def test_parts_of_values_that_view_one_buffer_in_order_are_cut_in_one_split():
    from collgrad.core.buffers import cut_parts

    flat = torch.arange(40.0)
    values = [flat[0:10].view(2, 5), flat[10:16], flat[16:30], torch.arange(100.0, 106.0), flat[30:40]]
    # a slice of each (as ZeRO-3 writes), all of one, and a value of its own in between
    los, numels = [2, 0, 5, 1, 0], [3, 6, 4, 2, 10]
    cut = cut_parts(values, los, numels)
    expected = [v.reshape(-1)[lo : lo + n] for v, lo, n in zip(values, los, numels)]
    assert all(torch.equal(c, e) and c.data_ptr() == e.data_ptr() for c, e in zip(cut, expected))
    assert [c.numel() for c in cut] == numels
    # parts out of order in their buffer, another dtype, not contiguous: each as it is, the same elements
    for odd in ([flat[10:16], flat[0:10]], [flat[0:10], flat[10:16].double()], [flat[0:10], flat[10:22][::2]]):
        got = cut_parts(odd, [1, 2], [4, 3])
        assert all(torch.equal(c, v.reshape(-1)[lo : lo + n]) for c, v, lo, n in zip(got, odd, [1, 2], [4, 3]))


def test_storage_spans_group_pieces_by_the_storage_they_lie_in():
    main, padding = torch.arange(10.0), torch.zeros(3)
    pieces = Pieces([main[6:10], main[0:4], padding, main[4:6]])  # DeepSpeed's order: back to front, then padding
    spans, where = pieces.storage_spans()
    assert [s.numel() for s in spans] == [10, 3] and spans[0].data_ptr() == main.data_ptr()
    assert where == ((0, 6), (0, 0), (1, 0), (0, 4))
    assert pieces.memo["storage spans"] is not None  # worked out once while the pieces stay (PiecesCache)
    assert Pieces([main.view(2, 5)[:, :2]]).storage_spans() is None  # not contiguous: cut piece by piece
