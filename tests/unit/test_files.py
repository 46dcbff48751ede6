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

from collgrad.checkpoint.plan import LOCAL_CALL_SECONDS, IoCosts
from collgrad.checkpoint.safetensors import (
    SAFE_DTYPES,
    Entry,
    MetadataFiles,
    lay_out_file,
    metadata_from,
    open_checkpoint,
    read_header,
)
from collgrad.checkpoint.storage import (
    JOINED_WRITE_BYTES,
    MAX_RUN_BYTES,
    Copy,
    Run,
    Target,
    Writer,
    joined_runs,
    reads,
    with_moves,
)
from collgrad.checkpoint.storage import Reader as RangeReader
from collgrad.errors import CheckpointError
from tests.counting import count_io

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


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=12),  # quotes, backslashes, control characters, any code point
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)),
        min_size=1,
        max_size=6,
    ),
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2),
)
def test_a_laid_out_header_is_the_json_safetensors_reads(tmp_path_factory, specs, metadata):
    """A header written entry by entry is json.dumps' own (byte for byte), and safetensors loads the file."""
    entries = [Entry(name, tuple(shape), dtype) for name, (dtype, shape) in specs.items()]
    shard = lay_out_file(entries, metadata)
    header: dict[str, object] = {"__metadata__": metadata}
    at = 0
    for e in entries:
        header[e.name] = {"dtype": SAFE_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    assert shard.header[8:].rstrip(b" ") == json.dumps(header, separators=(",", ":")).encode()
    path = tmp_path_factory.mktemp("laid") / "m.safetensors"
    path.write_bytes(shard.header + bytes(shard.data_bytes))
    loaded = safetensors.load_file(str(path))
    assert {n: (t.dtype, tuple(t.shape)) for n, t in loaded.items()} == {e.name: (e.dtype, e.shape) for e in entries}


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
        ({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "which collgrad does not read"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, bytes(4), "not [begin, end]"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, bytes(4), "not [begin, end]"),
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


def test_a_checkpoints_digest_is_its_tensors_names_files_dtypes_shapes_and_places(tmp_path):
    """``Checkpoint.digest``, what the ranks of a load compare: the same for a copy elsewhere (another mount
    of the same files, an index listing the same map in another order); another for a tensor of another
    shape, dtype or name, for the same tensors laid out otherwise (sharded) and for an index that maps a
    name to another file."""
    import shutil

    from safetensors.torch import save_file

    tensors = {"a": torch.zeros(4), "b": torch.ones(2, 3)}

    def saved(name: str, values: dict[str, torch.Tensor]) -> int:
        (tmp_path / name).mkdir()
        save_file(values, str(tmp_path / name / "model.safetensors"))
        return open_checkpoint(tmp_path / name).digest

    first = saved("first", tensors)
    shutil.copytree(tmp_path / "first", tmp_path / "copy")
    assert open_checkpoint(tmp_path / "copy").digest == first
    assert open_checkpoint(tmp_path / "copy" / "model.safetensors").digest == first
    others = {
        "shape": {"a": torch.zeros(2, 2), "b": torch.ones(2, 3)},
        "dtype": {"a": torch.zeros(4, dtype=torch.float64), "b": torch.ones(2, 3)},
        "name": {"c": torch.zeros(4), "b": torch.ones(2, 3)},
    }
    digests = {first} | {saved(name, values) for name, values in others.items()}
    assert len(digests) == 4
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": tensors["a"]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": tensors["b"]}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    split = open_checkpoint(sharded).digest
    assert split not in digests
    index["weight_map"] = dict(reversed(index["weight_map"].items()))  # the same map, listed otherwise
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert open_checkpoint(sharded).digest == split
    save_file({"a": tensors["a"], "b": tensors["b"]}, str(sharded / "model-00002-of-00002.safetensors"))
    index["weight_map"]["b"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["a"] = "model-00002-of-00002.safetensors"  # the same tensors, mapped to another file
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert open_checkpoint(sharded).digest not in digests | {split}


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


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=8),
    st.randoms(use_true_random=False),
    st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_joined_runs_read_every_range_where_it_goes(tmp_path_factory, sizes, rng, straight):
    """Tensors stored back to back in a file go to views of one flat tensor in a shuffled order (some
    read straight into place, others through a buffer and a copy), each also copied into a second flat
    tensor: the joined runs read and copy the same as one read per tensor, and join only what is
    adjacent in the file and in memory."""
    path = str(tmp_path_factory.mktemp("runs") / "data.bin")
    total = sum(sizes)
    stored = torch.randn(total)
    with open(path, "wb") as f:
        f.write(stored.numpy().tobytes())
    order = list(range(len(sizes)))
    rng.shuffle(order)
    places, at = {}, 0
    for i in order:  # where tensor i lies in memory
        places[i] = at
        at += sizes[i]
    into, mirror = torch.zeros(total), torch.zeros(total)
    single, offset = [], 0
    for i, n in enumerate(sizes):
        view, copy = into[places[i] : places[i] + n], mirror[places[i] : places[i] + n]
        copies = (Copy(0, Target(0, n, copy)),)
        if straight[i]:
            single.append(Run(path, offset * 4, n, torch.float32, view, copies))
        else:
            single.append(Run(path, offset * 4, n, torch.float32, None, (Copy(0, Target(0, n, view)), *copies)))
        offset += n
    runs = joined_runs(single)
    plan = with_moves(runs)
    with RangeReader() as reader:
        for run in plan.runs:
            buffer = run.dest if run.dest is not None else torch.empty(run.numel)
            reader.read_at(run.file, run.offset, buffer)
            for c in run.copies:
                c.target.write(buffer[c.at : c.at + c.target.numel])
        for values, target in plan.moves:  # from where runs read straight into place, once all are read
            target.write(values)
        assert reader.bytes_read == total * 4  # every byte once
    expected, starts = torch.empty(total), [sum(sizes[:i]) for i in range(len(sizes))]
    for i, n in enumerate(sizes):
        expected[places[i] : places[i] + n] = stored[starts[i] : starts[i] + n]
    assert torch.equal(into, expected) and torch.equal(mirror, expected)
    assert all(r.nbytes <= MAX_RUN_BYTES or r.dest is not None for r in runs)
    # joined exactly where the next tensor is read the same way and, straight into place, lies next
    joins = sum(
        1
        for i in range(len(sizes) - 1)
        if straight[i] == straight[i + 1] and (not straight[i] or places[i] + sizes[i] == places[i + 1])
    )
    assert len(runs) == len(sizes) - joins
    # the mirror lies as `into` does: the moves from what was read straight into place are one copy
    # where those places lie back to back
    if _straight_back_to_back(sizes, places, straight):
        assert len(plan.moves) == (1 if any(straight[: len(sizes)]) else 0)


def _straight_back_to_back(sizes, places, straight) -> bool:
    """The tensors read straight into place lie back to back in memory, in some order."""
    spans = sorted((places[i], sizes[i]) for i in range(len(sizes)) if straight[i])
    return all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_metadata_read_by_one_rank_is_read_alike_by_the_others(tmp_path):
    """``agree.metadata_once``'s two halves, no process group: a checkpoint opened through
    ``RecordedFiles`` (the first rank) and again through ``ReplayedFiles`` of its packed reads (any other
    rank) gives the same tensors without reading a byte of a file (a stat each, as before); a refusal (a
    missing shard) is the same refusal; what was not recorded is read from the file."""
    from collgrad.checkpoint.safetensors import RecordedFiles, ReplayedFiles, metadata_from

    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    safetensors.save_file(tensors, str(tmp_path / "model.safetensors"))
    recorded = RecordedFiles()
    with metadata_from(recorded):
        first = open_checkpoint(tmp_path)
    replayed = ReplayedFiles(recorded.packed())
    with metadata_from(replayed):
        again = open_checkpoint(tmp_path)
    assert again.tensors == first.tensors and again.header_bytes == first.header_bytes
    assert replayed.bytes_read == 0 and recorded.bytes_read == first.header_bytes
    # a refusal alike: the index names a shard that is not there
    index = {"weight_map": {"a": "model.safetensors", "b": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    recorded = RecordedFiles()
    with metadata_from(recorded), pytest.raises(CheckpointError) as on_first:
        open_checkpoint(tmp_path)
    replayed = ReplayedFiles(recorded.packed())
    with metadata_from(replayed), pytest.raises(CheckpointError) as on_other:
        open_checkpoint(tmp_path)
    assert str(on_first.value).split(": ", 1)[1] == str(on_other.value).split(": ", 1)[1]
    # a read that failed fails alike, as its own OSError subclass
    gone = str(tmp_path / "nothing.json")
    recorded = RecordedFiles()
    with pytest.raises(FileNotFoundError):
        recorded.whole(gone)
    with pytest.raises(FileNotFoundError):
        ReplayedFiles(recorded.packed()).whole(gone)
    recorded.reads[("whole", "nameless")] = OSError("a failure with no errno")  # as a FUSE mount may give
    with pytest.raises(OSError, match="a failure with no errno"):
        ReplayedFiles(recorded.packed()).whole("nameless")
    # what the first rank did not read, another reads itself
    other = ReplayedFiles(RecordedFiles().packed())
    assert other.whole(str(tmp_path / "model.safetensors.index.json")) == json.dumps(index).encode()
    assert other.bytes_read == len(json.dumps(index))


def test_a_header_of_the_same_bytes_is_parsed_once_and_placed_in_its_own_file(tmp_path):
    """Within one load's metadata (``MetadataFiles``), a header of the same bytes as one parsed before (a
    training state's masters and Adam's states) gives its own file's tensors; a file of another size
    with those bytes is checked as its own (refused where the data does not fit)."""
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}
    first, second, short = (str(tmp_path / f"{n}.safetensors") for n in ("first", "second", "short"))
    safetensors.save_file(tensors, first)
    safetensors.save_file({k: v + 1 for k, v in tensors.items()}, second)
    with open(first, "rb") as f:
        data = f.read()
    with open(short, "wb") as f:
        f.write(data[:-2])
    files = MetadataFiles()
    with metadata_from(files):
        one, size_one = read_header(first)
        two, size_two = read_header(second)
        with pytest.raises(CheckpointError, match="short.safetensors"):
            read_header(short)
    assert size_one == size_two and {s.file for s in two.values()} == {second}
    assert {n: s._replace(file=second) for n, s in one.items()} == two
    with RangeReader() as reader:
        assert torch.equal(reader.read(two["b"], 0, 6).reshape(2, 3), tensors["b"] + 1)


@pytest.mark.parametrize("call_seconds", [IoCosts().call_seconds, LOCAL_CALL_SECONDS], ids=["network", "local"])
def test_a_streams_small_writes_that_follow_on_are_one_write_each_buffer_full(tmp_path, call_seconds):
    """``Writer.write`` of values the caller overwrites after each call (``kept=False``: a stream's bucket),
    one after another in the file: where each is under ``joined_below`` (a network file system's), joined
    in the writer's buffer up to ``JOINED_WRITE_BYTES`` a call; where not (a local disk's: copying
    costs more than a call), one call each; a value larger than that threshold written at once. The
    file's bytes are each value's as it was at its call."""
    joined_below = IoCosts(call_seconds=call_seconds).joined_below
    per = 768 * 2**10 // 4  # 768 KiB of fp32 values a write: five fit in the buffer of 4 MiB, six do not
    count, big = 12, 2 * JOINED_WRITE_BYTES // 4
    size = (count * per + big) * 4
    path = str(tmp_path / "m.safetensors")
    bucket = torch.empty(per)
    with count_io(str(tmp_path)) as io:
        writer = Writer(None, joined_below)
        for k in range(count):
            bucket.fill_(k)  # the stream's next bucket in the same memory
            writer.write(path, size, k * per * 4, bucket, torch.float32, kept=False)
        writer.write(path, size, count * per * 4, torch.full((big,), -1.0), torch.float32, kept=False)
        writer.finish()
    assert writer.error is None
    joined = [5 * per * 4, 5 * per * 4, 2 * per * 4] if per * 4 < joined_below else [per * 4] * count
    assert [n for *_, n in io.log] == [*joined, big * 4]
    written = torch.from_file(path, size=size // 4, dtype=torch.float32)
    expected = torch.cat([torch.arange(count, dtype=torch.float32).repeat_interleave(per), torch.full((big,), -1.0)])
    assert torch.equal(written, expected)
