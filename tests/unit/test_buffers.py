import torch

from collgrad.buffers import adjacent_view


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
