"""Safetensors checkpoints read as untrusted input: every header checked against its file, and every
shard an index names checked to lie inside the checkpoint's directory, before any byte of data is
trusted; then byte ranges read straight into tensors.

    file   | N (8 bytes, little-endian) | JSON header (N bytes) | data: every tensor's bytes, back to back |
    entry  {"dtype": "BF16", "shape": [4, 3], "data_offsets": [begin, end]}   offsets into the data

Checks (``read_header``): N fits the file and safetensors' own limit; the header is a JSON object of
entries (and an optional ``__metadata__`` of strings); each entry has a known dtype, a shape of
non-negative ints and offsets with ``end - begin == numel * itemsize``; the entries tile the data
exactly (no overlap, no hole, nothing past the end of the file: a truncated file fails here). A
directory holds ``model.safetensors`` or ``model.safetensors.index.json``, whose ``weight_map`` names
shards by relative paths that must resolve (symlinks followed) inside the directory, each name found
in its shard's header. Every refusal is a ``CheckpointError`` naming the file and the reason.

Local: no process group. The loader (load.py) agrees on the verdict between ranks.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch

from collgrad import _compat
from collgrad.errors import CheckpointError
from collgrad.state.shards import INDEX_NAME, SAFE_DTYPES, SINGLE_NAME, bytes_of

__all__ = [
    "Stored",
    "Checkpoint",
    "open_checkpoint",
    "open_mapped",
    "read_header",
    "RangeReader",
    "read_all",
    "MAX_HEADER_BYTES",
]

#: safetensors' own limit on a header (its reader refuses larger ones: "header too large").
MAX_HEADER_BYTES = 100_000_000
DTYPES = {name: dtype for dtype, name in SAFE_DTYPES.items()}
#: the most one ``os.preadv`` reads on Linux
_MOST = 0x7FFFF000


class Stored(NamedTuple):
    """One tensor of a checkpoint: the file it is in, its dtype and shape as stored, and where its bytes
    start in the file (absolute). A tuple: a checkpoint's headers hold thousands, made, hashed and
    compared (a kept load plan's key) at C speed."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def byte_offset(self, lo: int) -> int:
        """Where element ``lo`` (flat) starts in the file."""
        return self.start + lo * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Checkpoint:
    """Every tensor of a checkpoint by name, every file it spans, and the bytes of headers read."""

    directory: str
    files: tuple[str, ...]
    tensors: Mapping[str, Stored]
    header_bytes: int


def _refuse(path: str, reason: str) -> CheckpointError:
    return CheckpointError(f"rank {_compat.rank()}: {path}: {reason}; nothing was loaded")


def read_header(path: str) -> tuple[dict[str, Stored], int]:
    """The tensors of the safetensors file ``path`` and the size of its header (8 + N), every entry
    checked against the file (see the module's docstring). CheckpointError otherwise. Local."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            if len(first) < 8:
                raise _refuse(path, f"{size} bytes: too short for a safetensors header")
            (length,) = struct.unpack("<Q", first)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise _refuse(path, f"the header claims {length} bytes, the file has {size}")
            text = f.read(length)
    except OSError as error:
        raise _refuse(path, f"cannot be read ({error.strerror or error})") from error
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise _refuse(path, f"the header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise _refuse(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise _refuse(path, "__metadata__ must map strings to strings")
    data_start, data_size = 8 + length, size - 8 - length
    out: dict[str, Stored] = {}
    spans = []
    for name, entry in header.items():
        dtype, shape, begin, end = _well_formed(entry) or _entry(path, name, entry)
        if end > data_size:
            raise _refuse(path, f"{name!r} lies at bytes [{begin}, {end}) of a data section of {data_size}")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise _refuse(path, f"{name!r}: {end - begin} bytes for shape {list(shape)} of {dtype}")
        out[name] = Stored(path, dtype, shape, data_start + begin)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves bytes [{at}, {begin}) unused"
            raise _refuse(path, f"{name!r} {what}")
        at = end
    if at != data_size:
        raise _refuse(path, f"the tensors end at byte {at} of a data section of {data_size} (trailing bytes)")
    return out, data_start


def _well_formed(entry: object) -> tuple[torch.dtype, tuple[int, ...], int, int] | None:
    """One header entry's dtype, shape and offsets where it is well formed, checked in one pass (a
    checkpoint's headers hold thousands); None otherwise, for ``_entry`` to say what is wrong."""
    if type(entry) is not dict:
        return None
    name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = DTYPES.get(name) if type(name) is str else None
    if dtype is None or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        return None
    for d in shape:
        if type(d) is not int or d < 0:
            return None
    return dtype, tuple(shape), begin, end


def _entry(path: str, name: str, entry: object) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """One header entry's dtype, shape and offsets, each checked for its type."""
    if not isinstance(entry, dict):
        raise _refuse(path, f"the entry of {name!r} is not an object")
    found = entry.get("dtype")
    dtype = DTYPES.get(found) if isinstance(found, str) else None  # an unknown, absent or unhashable one: None
    if dtype is None:
        raise _refuse(path, f"{name!r} has dtype {entry.get('dtype')!r}, which collgrad does not read")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _refuse(path, f"{name!r} has shape {shape!r}: not a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _refuse(path, f"{name!r} has data_offsets {offsets!r}: not [begin, end] with 0 <= begin <= end")
    return dtype, tuple(shape), offsets[0], offsets[1]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path``: a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards (what ``save_pretrained`` and ``save_full_model``
    write), or one ``.safetensors`` file; every header checked. CheckpointError otherwise. Local."""
    path = os.fspath(path)
    if os.path.isfile(path):
        tensors, header = read_header(path)
        return Checkpoint(os.path.dirname(os.path.abspath(path)), (path,), tensors, header)
    if not os.path.isdir(path):
        raise _refuse(path, "no such file or directory")
    index = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index):
        single = os.path.join(path, SINGLE_NAME)
        if not os.path.isfile(single):
            raise _refuse(path, f"holds neither {SINGLE_NAME} nor {INDEX_NAME}")
        tensors, header = read_header(single)
        return Checkpoint(path, (single,), tensors, header)
    return open_mapped(path, _weight_map(index), index)


def open_mapped(path: str, weight_map: Mapping[str, str], index: str) -> Checkpoint:
    """The tensors ``weight_map`` places (name -> file, relative to the directory ``path``), as the index
    ``index`` (the file that holds the map, named in errors) gives them: every file checked to lie
    inside ``path`` and every header checked, every name found in its file's header. CheckpointError
    otherwise. Local."""
    files = {shard: _inside(path, shard, index) for shard in dict.fromkeys(weight_map.values())}
    headers, header_bytes = {}, 0
    for shard, file in files.items():
        headers[shard], size = read_header(file)
        header_bytes += size
    tensors = {}
    for name, shard in weight_map.items():
        found = headers[shard].get(name)
        if found is None:
            raise _refuse(index, f"names {name!r} in {shard}, whose header does not hold it")
        tensors[name] = found
    return Checkpoint(path, tuple(files.values()), tensors, header_bytes)


def _weight_map(index: str) -> dict[str, str]:
    try:
        with open(index, "rb") as f:
            found = json.loads(f.read().decode("utf-8"))
    except OSError as error:
        raise _refuse(index, f"cannot be read ({error.strerror or error})") from error
    except (UnicodeDecodeError, ValueError) as error:
        raise _refuse(index, f"is not valid JSON ({error})") from None
    weight_map = found.get("weight_map") if isinstance(found, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise _refuse(index, "has no weight_map of tensor names to shard files")
    return weight_map


def _inside(directory: str, shard: str, index: str) -> str:
    """The path of ``shard`` (as the index names it) if it lies inside ``directory``, symlinks followed;
    CheckpointError for an absolute path, one that leaves the directory, or a link out of it."""
    if os.path.isabs(shard) or not shard or os.path.normpath(shard).startswith(os.pardir):
        raise _refuse(index, f"names the shard {shard!r}, outside the checkpoint's directory")
    root = os.path.realpath(directory)
    resolved = os.path.realpath(os.path.join(directory, shard))
    if os.path.commonpath([root, resolved]) != root:
        raise _refuse(index, f"names the shard {shard!r}, which resolves outside the checkpoint's directory")
    if not os.path.isfile(resolved):
        raise _refuse(index, f"names the shard {shard!r}, which is not there")
    return resolved


def _pread_into(fd: int, file: str, offset: int, view: memoryview) -> int:
    """``view`` filled from the open ``file`` (``fd``) at byte ``offset``; returns the bytes read. OSError
    where the file ends early or reading fails."""
    nbytes, done = len(view), 0
    while done < nbytes:
        got = os.preadv(fd, [view[done : done + min(nbytes - done, _MOST)]], offset + done)
        if got == 0:
            raise OSError(f"{file} ends at byte {offset + done}, inside a tensor")
        done += got
    return nbytes


class RangeReader:
    """Ranges of a checkpoint's tensors read straight from its files, each file opened once; counts the
    bytes read. Use it as a context manager (or ``close`` it). Local."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self.bytes_read = 0

    def read(self, stored: Stored, lo: int, numel: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, lo + numel)`` of ``stored`` (flat, row-major, in its dtype), read into ``into``
        (contiguous, CPU, of that dtype and size) or a new buffer; OSError where the file ends early or
        reading fails."""
        out = torch.empty(numel, dtype=stored.dtype) if into is None else into.view(-1)
        assert out.numel() == numel and out.dtype == stored.dtype
        self.read_at(stored.file, stored.byte_offset(lo), out)
        return out

    def read_at(self, file: str, offset: int, out: torch.Tensor | memoryview) -> None:
        """``out``'s bytes (a contiguous CPU tensor, or its ``bytes_of``) read from ``file`` at byte
        ``offset``: a range the checked headers of ``file`` place inside it. OSError where the file
        ends early or reading fails."""
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        self.bytes_read += _pread_into(fd, file, offset, bytes_of(out) if isinstance(out, torch.Tensor) else out)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_all(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint``, whole, as one process reads a checkpoint to hand it to a
    framework's loader (the benchmark's anchors). Local."""
    with RangeReader() as reader:
        return {n: reader.read(t, 0, t.numel).reshape(t.shape) for n, t in checkpoint.tensors.items()}
