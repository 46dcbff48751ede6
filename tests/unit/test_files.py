"""Safetensors headers read as untrusted input, without a process group: what ``safetensors`` writes is
read as ``safe_open`` reads it (every dtype, shape and byte), ranges read straight into tensors, and the
reads a load plans cover every element once."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collgrad.errors import CheckpointError
from collgrad.state.files import RangeReader, open_checkpoint, read_header
from collgrad.state.load import reads

safetensors = pytest.importorskip(
    "safetensors.torch", reason="safetensors is not installed (pip install 'collgrad[hf]')"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)), min_size=1, max_size=6
    )
)
def test_what_safetensors_writes_reads_back_bitwise(tmp_path_factory, specs):
    path = str(tmp_path_factory.mktemp("st") / "m.safetensors")
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": (torch.randn(shape, generator=g) * 10).to(dtype)
        if dtype.is_floating_point
        else torch.randint(0, 2, shape).to(dtype)
        for i, (dtype, shape) in enumerate(specs)
    }
    safetensors.save_file(tensors, path)
    stored, header = read_header(path)
    assert sorted(stored) == sorted(tensors) and header > 8
    with RangeReader() as reader:
        for name, tensor in tensors.items():
            s = stored[name]
            assert (s.dtype, s.shape) == (tensor.dtype, tuple(tensor.shape))
            before = reader.bytes_read
            out = reader.read(s, 0, s.numel)
            assert reader.bytes_read - before == tensor.numel() * tensor.element_size()
            assert torch.equal(out.reshape(s.shape), tensor)
            if s.numel > 2:  # a range from the middle, into a buffer of the caller's
                part = torch.empty(s.numel - 2, dtype=s.dtype)
                assert reader.read(s, 1, s.numel - 2, part).data_ptr() == part.data_ptr()
                assert torch.equal(part, tensor.reshape(-1)[1:-1])


def _raw(path, header, data=b""):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "header, data, reason",
    [
        (b"[1, 2]", b"", "not a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__ must map strings to strings"),
        ({"x": []}, b"", "is not an object"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "not a list of non-negative ints"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), "0 <= begin <= end"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8), "trailing bytes"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "leaves bytes [0, 4) unused"),
        ({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4), "not a list of non-negative ints"),
    ],
)
def test_a_malformed_header_is_refused_naming_the_file(tmp_path, header, data, reason):
    path = str(tmp_path / "bad.safetensors")
    _raw(path, header, data)
    with pytest.raises(CheckpointError, match="bad.safetensors") as caught:
        read_header(path)
    assert reason in str(caught.value)


def test_a_directory_without_a_checkpoint_or_with_a_broken_index_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(CheckpointError, match="no weight_map"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(CheckpointError, match="which is not there"):
        open_checkpoint(tmp_path)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(1, 40)), min_size=1, max_size=6))
def test_the_planned_reads_cover_every_target_once(numel, wanted):
    targets = [(lo % numel, max(1, min(n, numel - lo % numel))) for lo, n in wanted]
    planned = reads(targets, numel)
    for lo, n in targets:  # each target lies inside one read
        assert any(a <= lo and lo + n <= a + m for a, m in planned)
    assert len(set(planned)) == len(planned)  # no range read twice
    if (0, numel) in targets:
        assert planned == ((0, numel),)
