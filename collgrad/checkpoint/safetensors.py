"""The safetensors format both ways: headers laid out for a save, and read back as untrusted input.

    file   | N (8 bytes, little-endian) | JSON header (N bytes) | data: every tensor's bytes, back to back |
    entry  {"dtype": "BF16", "shape": [4, 3], "data_offsets": [begin, end]}   offsets into the data

Written (``cut_shards``, pure): tensors in order cut into shards of at most ``max_shard_bytes`` (a new
shard when the next tensor would take the current one past it, as ``save_pretrained`` cuts them; a
larger tensor is a shard by itself), each header padded with spaces to 8 bytes; every tensor's place in
its file is fixed before any byte moves.

Read (``read_header``): N fits the file and safetensors' own limit; the header is a JSON object of
entries (and an optional ``__metadata__`` of strings); each entry has a known dtype, a shape of
non-negative ints and offsets with ``end - begin == numel * itemsize``; the entries tile the data
exactly (no overlap, no hole, nothing past the end of the file: a truncated file fails here). A
directory holds ``model.safetensors`` or ``model.safetensors.index.json``, whose ``weight_map`` names
shards by relative paths that must resolve (symlinks followed) inside the directory, each name found
in its shard's header. Every refusal is a ``CheckpointError`` naming the file and the reason.

Local: no process group, no file written (storage.py writes, commit.py renames).
Spec: https://github.com/huggingface/safetensors
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import operator
import os
import re
import struct
import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quoted  # json.dumps' own quoting of a str (C)
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from collgrad import _compat
from collgrad.errors import CheckpointError, InvalidArgumentError

__all__ = [
    "SAFE_DTYPES",
    "Entry",
    "Shard",
    "cut_shards",
    "lay_out_file",
    "parse_header",
    "shard_name",
    "SINGLE_NAME",
    "INDEX_NAME",
    "index_json",
    "is_weights_file",
    "Stored",
    "Checkpoint",
    "read_header",
    "open_checkpoint",
    "open_mapped",
    "MetadataFiles",
    "RecordedFiles",
    "ReplayedFiles",
    "metadata_from",
    "metadata_files",
    "inside",
    "refused",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
]

#: torch dtypes and their safetensors names
SAFE_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class Entry(NamedTuple):
    """One tensor of the checkpoint: its name, shape and dtype as written. A tuple: a save's plan hashes
    and compares thousands (the cut shards kept for the next save of the same tensors) at C speed."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Shard:
    """One file: its tensors, its header (length and JSON, padded), and where each tensor's bytes start."""

    entries: tuple[Entry, ...]
    header: bytes
    offsets: tuple[int, ...]  # from the start of the file, per entry
    data_bytes: int

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


#: The names ``save_pretrained`` gives a checkpoint of one file, and the index of a sharded one.
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


#: A weights file of a model directory: ``save_pretrained``'s shards, or a training state's (its generation
#: in the name: ``model-<generation>-00001-of-00002.safetensors``).
_WEIGHTS = re.compile(r"^model-([0-9a-f]+-)?\d{5,}-of-\d{5,}\.safetensors$")


def shard_name(index: int, count: int) -> str:
    """The file name ``save_pretrained`` gives shard ``index`` (0-based) of ``count``."""
    return SINGLE_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _cut(entries: list[Entry], max_shard_bytes: int, metadata: dict[str, str]) -> tuple[Shard, ...]:
    """``entries`` cut into shards in order, each laid out in the safetensors format (``cut_shards``). Pure."""
    groups: list[tuple[list[Entry], list[int]]] = []
    filled = 0
    for entry, nbytes in zip(entries, _nbytes(entries)):
        if not groups or (filled and filled + nbytes > max_shard_bytes):
            groups.append(([], []))
            filled = 0
        groups[-1][0].append(entry)
        groups[-1][1].append(nbytes)
        filled += nbytes
    return tuple(_laid_out(group, sizes, metadata) for group, sizes in groups)


def _nbytes(entries: Sequence[Entry]) -> list[int]:
    """Each entry's bytes; InvalidArgumentError (this rank) for a dtype safetensors cannot hold."""
    for dtype in {e.dtype for e in entries}:
        if dtype not in SAFE_DTYPES:
            bad = next(e for e in entries if e.dtype == dtype)
            raise InvalidArgumentError(f"rank {_compat.rank()}: {bad.name} is {dtype}, which safetensors cannot hold")
    return [math.prod(e.shape) * _ITEMSIZE[e.dtype] for e in entries]


def cut_shards(entries: tuple[Entry, ...], max_shard_bytes: int) -> tuple[Shard, ...]:
    """``entries`` cut into shards in order, each laid out with ``{"format": "pt"}`` (what
    ``save_pretrained`` writes). Pure."""
    return _cut(list(entries), max_shard_bytes, {"format": "pt"})


def lay_out_file(entries: list[Entry], metadata: dict[str, str]) -> Shard:
    """One safetensors file of ``entries`` in order: its header and each tensor's byte offset. Pure."""
    return _laid_out(entries, _nbytes(entries), metadata)


def _laid_out(entries: list[Entry], sizes: list[int], metadata: dict[str, str]) -> Shard:
    # the JSON written entry by entry, as ``json.dumps(header, separators=(",", ":"))`` writes the dict
    # (the same bytes; five times faster: a 3.9B-parameter training state's headers hold 160,000 entries)
    parts = ['{"__metadata__":' + json.dumps(metadata, separators=(",", ":"))]
    at, starts = 0, []
    for e, nbytes in zip(entries, sizes):
        shape = ",".join(map(str, e.shape))
        parts.append(f',{_quoted(e.name)}:{{"dtype":"{SAFE_DTYPES[e.dtype]}","shape":[{shape}],')
        parts.append(f'"data_offsets":[{at},{at + nbytes}]}}')
        starts.append(at)
        at += nbytes
    parts.append("}")
    raw = "".join(parts).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    first = len(head)
    return Shard(tuple(entries), head, tuple(first + s for s in starts), at)


def is_weights_file(name: str) -> bool:
    """``name`` is a model directory's weights file (``model.safetensors``, the index, or a shard of
    ``save_pretrained``'s or a training state's), which a loader of the directory would read."""
    return name in (SINGLE_NAME, INDEX_NAME) or _WEIGHTS.match(name) is not None


def index_json(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json``'s contents, as ``save_pretrained`` writes them."""
    document = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


#: safetensors' own limit on a header (its reader refuses larger ones: "header too large").
MAX_HEADER_BYTES = 100_000_000
#: the most an index, a manifest, a hash file or record may hold: read whole, sent to every rank
MAX_JSON_BYTES = 1 << 30
DTYPES = {name: dtype for dtype, name in SAFE_DTYPES.items()}
#: Each dtype's bytes an element, looked up (``dtype.itemsize`` is a call into torch; a header holds thousands).
_ITEMSIZE = {dtype: dtype.itemsize for dtype in SAFE_DTYPES}


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
    """Every tensor of a checkpoint by name, every file it spans, and the bytes of headers read; its
    ``digest``: what the ranks compare to know they see the same checkpoint (every tensor's name, file,
    dtype, shape and place), a CRC-32 of its map of names to files and of each file's name and checked
    header, with no step a tensor (a 3.9B-parameter training state's 200,000 tensors listed, sorted
    and hashed were 0.27 s of every rank's load)."""

    directory: str
    files: tuple[str, ...]
    tensors: Mapping[str, Stored]
    header_bytes: int
    digest: int


def refused(where: str, reason: str) -> CheckpointError:
    """The one refusal of a checkpoint: this rank, the file (or directory) and why; nothing was loaded."""
    return CheckpointError(f"rank {_compat.rank()}: {where}: {reason}; nothing was loaded")


#: A header's tensors as columns: names, dtypes, shapes, starts.
_Columns = tuple[list[str], list[torch.dtype], list[tuple[int, ...]], list[int]]


_stored = _compat.maker(Stored)


class MetadataFiles:
    """Where a checkpoint's metadata is read from (its index, a training state's manifest, each file's
    header): the files themselves. A load's group reads it once (``agree.metadata_once``): its first rank
    through ``RecordedFiles``, every other rank from those bytes (``ReplayedFiles``), each checking them
    itself. ``bytes_read``: what it read from the files. Local."""

    def __init__(self) -> None:
        self.bytes_read = 0
        # each header parsed through these files, by its file's size and its bytes: its tensors as
        # columns (names, dtypes, shapes, starts) and its size (``parsed``)
        self._parsed: dict[tuple[int, bytes], tuple[_Columns, int]] = {}

    def parsed(self, path: str, text: bytes, size: int) -> tuple[dict[str, Stored], int]:
        """``parse_header(path, text, size)``, where a header of the same bytes in a file of the same size
        was parsed before through these files (a training state's fp32 masters and Adam's two states
        hold the same tensors cut alike: the same headers, 40,000 entries for a 3.9B-parameter model)
        its tensors placed in ``path`` instead of parsed again: the same checks, the same verdict.
        CheckpointError as ``parse_header``."""
        found = self._parsed.get((size, text))
        if found is not None:
            (names, dtypes, shapes, starts), header = found
            at = zip(itertools.repeat(path), dtypes, shapes, starts)
            return dict(zip(names, map(_stored, at))), header
        tensors, header = parse_header(path, text, size)
        values = tensors.values()
        dtypes, shapes, starts = (list(map(operator.itemgetter(k), values)) for k in (1, 2, 3))
        self._parsed[(size, text)] = (list(tensors), dtypes, shapes, starts), header
        return tensors, header

    def whole(self, path: str) -> bytes:
        """A small file's bytes (an index, a manifest, a hash file or record: at most ``MAX_JSON_BYTES``).
        OSError where it cannot be read or is larger."""
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
        self.bytes_read += len(data)
        if len(data) > MAX_JSON_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_JSON_BYTES} bytes: not an index, manifest or hash file")
        return data

    def header(self, path: str) -> tuple[int, bytes]:
        """The safetensors file's size and its first bytes: the 8 of the header's length, and the header
        where that length fits the file and ``MAX_HEADER_BYTES`` (else the caller refuses it). OSError."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(8)
            if len(first) < 8:
                return size, first
            (length,) = struct.unpack("<Q", first)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                return size, first
            data = first + f.read(length)
        self.bytes_read += len(data)
        return size, data


class RecordedFiles(MetadataFiles):
    """The files' metadata as ``MetadataFiles`` reads it, every read kept (its bytes, or its OSError) to be
    sent to the other ranks (``packed``). Local."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[tuple[str, str], tuple[int, bytes] | OSError] = {}

    def whole(self, path: str) -> bytes:
        return self._kept("whole", path, lambda: (0, super(RecordedFiles, self).whole(path)))[1]

    def header(self, path: str) -> tuple[int, bytes]:
        return self._kept("header", path, lambda: super(RecordedFiles, self).header(path))

    def _kept(self, kind: str, path: str, read: Callable[[], tuple[int, bytes]]) -> tuple[int, bytes]:
        try:
            found = read()
        except OSError as error:
            self.reads[(kind, path)] = error
            raise
        self.reads[(kind, path)] = found
        return found

    def packed(self) -> bytes:
        """Every read: its JSON list ([kind, path, size, bytes, failed, errno, strerror] each) after its
        8-byte length, then the bytes read, back to back."""
        listed, data = [], []
        for (kind, path), found in self.reads.items():
            if isinstance(found, OSError):
                listed.append([kind, path, 0, 0, True, found.errno, found.strerror or str(found)])
            else:
                listed.append([kind, path, found[0], len(found[1]), False, None, ""])
                data.append(found[1])
        text = json.dumps(listed).encode()
        return struct.pack("<Q", len(text)) + text + b"".join(data)


class ReplayedFiles(MetadataFiles):
    """Another rank's reads of the files' metadata (``RecordedFiles.packed``), read again here as that rank
    read them (its bytes, its errors); a file it did not read (a directory mounted elsewhere) read from
    the file. Local."""

    def __init__(self, packed: bytes) -> None:
        super().__init__()
        self.reads: dict[tuple[str, str], tuple[int, bytes] | OSError] = {}
        (length,) = struct.unpack("<Q", packed[:8])
        listed = json.loads(packed[8 : 8 + length].decode())
        at = 8 + length
        for kind, path, size, nbytes, failed, number, strerror in listed:
            if failed:
                self.reads[(kind, path)] = OSError(number, strerror, path) if number else OSError(strerror)
            else:
                self.reads[(kind, path)] = (size, packed[at : at + nbytes])
                at += nbytes
        assert at == len(packed), "the packed reads are whole"

    def whole(self, path: str) -> bytes:
        return self._found("whole", path, lambda: (0, super(ReplayedFiles, self).whole(path)))[1]

    def header(self, path: str) -> tuple[int, bytes]:
        return self._found("header", path, lambda: super(ReplayedFiles, self).header(path))

    def _found(self, kind: str, path: str, read: Callable[[], tuple[int, bytes]]) -> tuple[int, bytes]:
        found = self.reads.get((kind, path))
        if found is None:
            return read()
        if isinstance(found, OSError):  # as the first rank's: its subclass by errno (FileNotFoundError...)
            raise OSError(found.errno, found.strerror, path) if found.errno else OSError(*found.args)
        return found


_METADATA: ContextVar[MetadataFiles | None] = ContextVar("collgrad_metadata_files", default=None)


def metadata_files() -> MetadataFiles:
    """Where this call reads a checkpoint's metadata from: the files, unless ``metadata_from`` says."""
    return _METADATA.get() or MetadataFiles()  # a load's, or one of a call's own


@contextmanager
def metadata_from(files: MetadataFiles) -> Iterator[None]:
    """Within the block, a checkpoint's metadata (index, manifest, headers) read through ``files``."""
    token = _METADATA.set(files)
    try:
        yield
    finally:
        _METADATA.reset(token)


def read_header(path: str) -> tuple[dict[str, Stored], int]:
    """The tensors of the safetensors file ``path`` and the size of its header (8 + N), every entry
    checked against the file (see the module's docstring); read through ``metadata_files()``.
    CheckpointError otherwise. Local."""
    tensors, header, _ = _header(path)
    return tensors, header


def _header(path: str) -> tuple[dict[str, Stored], int, int]:
    """``read_header``'s tensors and size, and the CRC-32 of the header's bytes."""
    files = metadata_files()
    try:
        size, first = files.header(path)
    except OSError as error:
        raise refused(path, f"cannot be read ({error.strerror or error})") from error
    if len(first) < 8:
        raise refused(path, f"{size} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", first[:8])
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise refused(path, f"the header claims {length} bytes, the file has {size}")
    tensors, header = files.parsed(path, first[8:], size)
    return tensors, header, zlib.crc32(first)


def _digest(name: str, header: int, crc: int, digest: int = 0) -> int:
    """``digest`` (a ``Checkpoint``'s) carried on over a file the checkpoint names ``name``: its header's
    size and the CRC-32 of its bytes (checked against the file, they fix the file's size and tensors)."""
    return zlib.crc32(f"{name}\0{header}\0{crc}\0".encode(), digest)


@_compat.uncollected
def parse_header(path: str, text: bytes, size: int) -> tuple[dict[str, Stored], int]:
    """``read_header``'s checks of a header's JSON ``text`` (the file's bytes after its 8-byte length), of
    the file ``path`` of ``size`` bytes: its tensors and the size of its header. Pure."""
    length = len(text)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise refused(path, f"the header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise refused(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise refused(path, "__metadata__ must map strings to strings")
    data_start, data_size = 8 + length, size - 8 - length
    out: dict[str, Stored] = {}
    spans = []
    ordered, last = True, 0  # a save writes its entries in the order of their bytes: then no sort
    for name, entry in header.items():
        dtype, shape, begin, end = _well_formed(entry) or _entry(path, name, entry)
        if end > data_size:
            raise refused(path, f"{name!r} lies at bytes [{begin}, {end}) of a data section of {data_size}")
        if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise refused(path, f"{name!r}: {end - begin} bytes for shape {list(shape)} of {dtype}")
        out[name] = _stored((path, dtype, shape, data_start + begin))  # in C (maker): 40,000 a header
        spans.append((begin, end, name))
        ordered, last = ordered and begin >= last, end
    at = 0
    for begin, end, name in spans if ordered else sorted(spans):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves bytes [{at}, {begin}) unused"
            raise refused(path, f"{name!r} {what}")
        at = end
    if at != data_size:
        raise refused(path, f"the tensors end at byte {at} of a data section of {data_size} (trailing bytes)")
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
        raise refused(path, f"the entry of {name!r} is not an object")
    found = entry.get("dtype")
    dtype = DTYPES.get(found) if isinstance(found, str) else None  # an unknown, absent or unhashable one: None
    if dtype is None:
        raise refused(path, f"{name!r} has dtype {entry.get('dtype')!r}, which collgrad does not read")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise refused(path, f"{name!r} has shape {shape!r}: not a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise refused(path, f"{name!r} has data_offsets {offsets!r}: not [begin, end] with 0 <= begin <= end")
    return dtype, tuple(shape), offsets[0], offsets[1]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path``: a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards (what ``save_pretrained`` and ``save_full_model``
    write), or one ``.safetensors`` file; every header checked. CheckpointError otherwise. Local."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return _single(os.path.dirname(os.path.abspath(path)), path)
    if not os.path.isdir(path):
        raise refused(path, "no such file or directory")
    index = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index):
        single = os.path.join(path, SINGLE_NAME)
        if not os.path.isfile(single):
            raise refused(path, f"holds neither {SINGLE_NAME} nor {INDEX_NAME}")
        return _single(path, single)
    return open_mapped(path, _weight_map(index), index)


def _single(directory: str, file: str) -> Checkpoint:
    """The checkpoint of the one file ``file``: every tensor its header holds."""
    tensors, header, crc = _header(file)
    return Checkpoint(directory, (file,), tensors, header, _digest(os.path.basename(file), header, crc))


def model_files(path: str) -> tuple[str, ...]:
    """The weights files of the model directory ``path``, by their names in it: those its index names
    (each checked to lie inside it), else ``model.safetensors``; no header read. CheckpointError where
    the index is malformed. Local."""
    index = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index):
        return (SINGLE_NAME,)
    shards = dict.fromkeys(_weight_map(index).values())
    return tuple(os.path.relpath(inside(path, shard, index), path) for shard in shards)


def open_mapped(path: str, weight_map: Mapping[str, str], index: str) -> Checkpoint:
    """The tensors ``weight_map`` places (name -> file, relative to the directory ``path``), as the index
    ``index`` (the file that holds the map, named in errors) gives them: every file checked to lie
    inside ``path`` and every header checked, every name found in its file's header. CheckpointError
    otherwise. Local."""
    files = {shard: inside(path, shard, index) for shard in dict.fromkeys(weight_map.values())}
    headers: dict[str, dict[str, Stored]] = {}
    checked: dict[str, tuple[int, int]] = {}  # each file's header's size and CRC-32
    for shard, file in files.items():
        headers[shard], size, crc = _header(file)
        checked[shard] = size, crc
    # the same whatever order the index lists its map in
    digest = zlib.crc32("\0".join(f"{name}\1{file}" for name, file in sorted(weight_map.items())).encode())
    for shard in sorted(checked):
        size, crc = checked[shard]
        digest = _digest(shard, size, crc, digest)
    header_bytes = sum(size for size, _ in checked.values())
    tensors = {}
    for name, shard in weight_map.items():
        found = headers[shard].get(name)
        if found is None:
            raise refused(index, f"names {name!r} in {shard}, whose header does not hold it")
        tensors[name] = found
    return Checkpoint(path, tuple(files.values()), tensors, header_bytes, digest)


def _weight_map(index: str) -> dict[str, str]:
    try:
        found = json.loads(metadata_files().whole(index).decode("utf-8"))
    except OSError as error:
        raise refused(index, f"cannot be read ({error.strerror or error})") from error
    except (UnicodeDecodeError, ValueError) as error:
        raise refused(index, f"is not valid JSON ({error})") from None
    weight_map = found.get("weight_map") if isinstance(found, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise refused(index, "has no weight_map of tensor names to shard files")
    return weight_map


def inside(directory: str, shard: str, index: str) -> str:
    """The path of ``shard`` (as the index names it) if it lies inside ``directory``, symlinks followed;
    CheckpointError for an absolute path, one that leaves the directory, or a link out of it."""
    if os.path.isabs(shard) or not shard or os.path.normpath(shard).startswith(os.pardir):
        raise refused(index, f"names the shard {shard!r}, outside the checkpoint's directory")
    root = os.path.realpath(directory)
    resolved = os.path.realpath(os.path.join(directory, shard))
    if os.path.commonpath([root, resolved]) != root:
        raise refused(index, f"names the shard {shard!r}, which resolves outside the checkpoint's directory")
    if not os.path.isfile(resolved):
        raise refused(index, f"names the shard {shard!r}, which is not there")
    return resolved
