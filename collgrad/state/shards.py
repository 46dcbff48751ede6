"""Safetensors shards laid out before any tensor moves, and filled in place as tensors stream in.

Every tensor's name, shape and dtype are known from the layout before the first collective, so the
shards are cut (in layout order, a new shard when the next tensor would take the current one past
``max_shard_bytes``, as ``save_pretrained`` cuts them; a larger tensor is a shard by itself) and every
tensor's place in its file is fixed up front (``plan_shards``, pure). Shard k is written by
``ranks[k % len(ranks)]``, which creates the file with its header and writes each tensor at its offset
the moment it arrives (``ShardFiles``): no rank holds a shard, only the stream's buckets. A shard is
written under a temporary name and renamed only once every rank has written all of its own (save.py),
so a failure never leaves a half-written shard under a final name.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}`` padded with spaces to 8 bytes,
then the tensors' bytes back to back in header order.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import secrets
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

import torch

from collgrad import _compat
from collgrad.core.buffers import adjacent_view
from collgrad.errors import InvalidArgumentError

__all__ = [
    "Entry",
    "Shard",
    "plan_shards",
    "cut_shards",
    "ShardFiles",
    "shard_name",
    "write_safetensors",
    "SAFE_DTYPES",
    "bytes_of",
    "SINGLE_NAME",
    "INDEX_NAME",
    "RangeWriter",
    "write_all",
    "shared",
    "STALE",
    "stale_name",
    "remove_later",
    "remove_all",
    "follows_on",
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
#: the most one ``os.pwrite`` writes on Linux
_MOST = 0x7FFFF000


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its name, shape and dtype as written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Shard:
    """One file: its tensors, its header (length and JSON, padded), and where each tensor's bytes start."""

    entries: tuple[Entry, ...]
    header: bytes
    offsets: tuple[int, ...]  # from the start of the file, per entry

    @functools.cached_property
    def size(self) -> int:
        return len(self.header) + self.data_bytes

    @functools.cached_property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


#: The names ``save_pretrained`` gives a checkpoint of one file, and the index of a sharded one.
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


#: The shards ``save_pretrained`` and ``shard_name`` name; not a training state's, whose names carry its
#: generation (``model-<generation>-00001-of-00002.safetensors``, which its manifest names).
_SHARD = re.compile(r"^model-\d{5,}-of-\d{5,}\.safetensors$")


def shard_name(index: int, count: int) -> str:
    """The file name ``save_pretrained`` gives shard ``index`` (0-based) of ``count``."""
    return SINGLE_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(entries: list[Entry], max_shard_bytes: int, metadata: dict[str, str]) -> tuple[Shard, ...]:
    """``entries`` cut into shards in order, each laid out in the safetensors format. Pure."""
    groups: list[list[Entry]] = []
    filled = 0
    for entry in entries:
        if entry.dtype not in SAFE_DTYPES:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {entry.name} is {entry.dtype}, which safetensors cannot hold"
            )
        if not groups or (filled and filled + entry.nbytes > max_shard_bytes):
            groups.append([])
            filled = 0
        groups[-1].append(entry)
        filled += entry.nbytes
    return tuple(_laid_out(group, metadata) for group in groups)


@functools.lru_cache(maxsize=16)
def cut_shards(entries: tuple[Entry, ...], max_shard_bytes: int) -> tuple[Shard, ...]:
    """``plan_shards`` of ``entries`` with ``{"format": "pt"}`` (what ``save_pretrained`` writes), kept
    for the next save of the same tensors (the headers' JSON is most of the planning)."""
    return plan_shards(list(entries), max_shard_bytes, {"format": "pt"})


def _laid_out(entries: list[Entry], metadata: dict[str, str]) -> Shard:
    header: dict[str, object] = {"__metadata__": metadata}
    at, starts = 0, []
    for e in entries:
        header[e.name] = {"dtype": SAFE_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        starts.append(at)
        at += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return Shard(tuple(entries), head, tuple(len(head) + s for s in starts))


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """``tensors`` written to ``path`` as one safetensors file, flushed to the disk (a framework's
    consolidated state dict, for the benchmark's anchors); returns the bytes of tensor data."""
    shard = _laid_out([Entry(n, tuple(t.shape), t.dtype) for n, t in tensors], metadata)
    with open(path, "wb") as f:
        f.write(shard.header)
        for _, t in tensors:
            if t.numel():
                f.write(bytes_of(t.detach().cpu().contiguous()))
        f.flush()
        os.fsync(f.fileno())
    return shard.data_bytes


def bytes_of(data: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, as they lie (no copy): writable, and holding the tensor's storage
    while it lives (reads land in the tensor itself)."""
    assert data.is_contiguous() and data.device.type == "cpu"
    return memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())


@dataclass
class ShardFiles:
    """This rank's part of the shards of ``plan`` under temporary names in ``directory``: ``create`` them,
    ``put`` each tensor as it arrives (every rank is given every tensor), ``finish``. Shard k is written
    by ``ranks[k % len(ranks)]``; with ``share`` (this rank's index among the ``world`` ranks that all
    write into the one directory), by every rank together instead: each its share of the tensors (a
    contiguous run of the checkpoint's bytes, ``shared``), the first also the headers. A failing write
    is kept in ``error`` (the rest of this rank's writes skipped), never raised: the caller must go on
    taking part in the stream's collectives and tell the others."""

    plan: tuple[Shard, ...]
    directory: str
    ranks: tuple[int, ...]
    rank: int
    share: tuple[int, int] | None = None
    #: (shard index, temporary path) of each shard this rank writes (with ``share``: writes a part of)
    written: list[tuple[int, str]] = field(default_factory=list)
    error: BaseException | None = None
    _where: dict[str, tuple[int, int, Entry]] = field(default_factory=dict)
    _files: dict[int, int] = field(default_factory=dict)
    _mine: frozenset[str] | None = None
    #: bytes this rank wrote into the shards (headers and tensors)
    bytes_written: int = 0
    #: a write waiting to be joined with the next (file, offset, values)
    _held: tuple[int, int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        for k, shard in enumerate(self.plan):
            for entry, offset in zip(shard.entries, shard.offsets):
                self._where[entry.name] = (k, offset, entry)
        if self.share is not None:
            entries = [e for shard in self.plan for e in shard.entries]
            self._mine = frozenset(entries[i].name for i in shared([e.nbytes for e in entries], *self.share))

    def create(self) -> None:
        """Each of this rank's shard files, with its header, at its final size (with ``share``: the
        shards it has tensors of, opened as they are, not truncated; a shard's header by the rank of its
        first tensor)."""
        for k, shard in enumerate(self.plan):
            if self.share is None and self.ranks[k % len(self.ranks)] != self.rank:
                continue
            if self._mine is not None and not any(e.name in self._mine for e in shard.entries):
                continue  # shared: nothing of this rank's in it
            path = self._temporary(k)
            # shared: no rank truncates what another may have written already; each sets the final size
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if self.share is None else 0)
            try:
                fd = os.open(path, flags, 0o644)
            except OSError as error:
                self.error = error
                return
            self._files[k] = fd
            self.written.append((k, path))
            header = self._mine is None or shard.entries[0].name in self._mine  # shared: its first tensor's rank
            if header and not self._write(fd, memoryview(shard.header), 0):
                return
            try:
                os.ftruncate(fd, shard.size)
            except OSError as error:
                self.error = error
                return

    def put(self, name: str, tensor: torch.Tensor, kept: bool = False) -> None:
        """``tensor`` (the whole value of ``name``) written at its place, on the rank writing it. ``kept``:
        the caller keeps ``tensor`` as it is until ``finish`` (a module's own weight, not a stream's
        bucket that the next bucket overwrites): then its write may wait to be joined with the next
        tensor's where their bytes follow each other in the file and in memory (one write for a run
        of the weights in their flat buffer)."""
        k, offset, entry = self._where[name]
        fd = self._files.get(k)
        if fd is None or self.error is not None or (self._mine is not None and name not in self._mine):
            return
        try:  # any failure is kept, never raised: the other ranks are in the stream's collectives
            data = tensor.detach().to("cpu", entry.dtype).contiguous()
            if data.numel() != math.prod(entry.shape):
                raise InvalidArgumentError(
                    f"rank {_compat.rank()}: {name} has {data.numel()} elements, not {entry.shape}"
                )
            if not data.numel():
                return
            held = self._held
            joined = follows_on(held, fd, offset, data) if held is not None and kept else None
            if held is not None and joined is not None:
                self._held = (fd, held[1], joined)
                return
            self._let_go()
            if kept and data.data_ptr() == tensor.data_ptr():  # the caller's own memory: it may wait
                self._held = (fd, offset, data)
            else:
                self._write(fd, bytes_of(data), offset)
        except Exception as error:  # noqa: BLE001 - told to every rank by the caller
            self.error = error

    def _let_go(self) -> None:
        """The write held for joining, written."""
        if self._held is not None:
            fd, offset, data = self._held
            self._held = None
            self._write(fd, bytes_of(data), offset)

    def finish(self) -> None:
        """Every file of this rank flushed to the disk and closed."""
        if self.error is None:
            try:
                self._let_go()
            except Exception as error:  # noqa: BLE001 - told to every rank by the caller
                self.error = error
        self._held = None
        for fd in self._files.values():
            try:
                if self.error is None:
                    os.fdatasync(fd)
            except OSError as error:
                self.error = error
            finally:
                os.close(fd)
        self._files.clear()

    def commit(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """This rank's shards renamed to their final names (with ``share``: every shard, by the first
        rank), and by the first writing rank the index added and an earlier save's weights files
        removed, once every rank has written all of its own: every file of the checkpoint, and those
        this rank put in place. A failure is kept in ``error`` (the temporaries not renamed yet
        removed) for the caller to tell the others."""
        count = len(self.plan)
        files = tuple(shard_name(k, count) for k in range(count)) + ((INDEX_NAME,) if count > 1 else ())
        here: list[str] = []
        first = self.share[0] == 0 if self.share is not None else self.rank == self.ranks[0]
        doomed: list[str] = []
        try:
            if self.share is None or first:
                mine = self.written if self.share is None else [(k, self._temporary(k)) for k in range(count)]
                for k, temporary in mine:
                    final = os.path.join(self.directory, files[k])
                    doomed += _kept_aside(final)
                    os.replace(temporary, final)
                    here.append(files[k])
            if first:
                if count > 1:
                    self._write_index()
                    here.append(INDEX_NAME)
                doomed += self._set_aside_stale(files)
        except OSError as caught:
            self.error = caught
            self.discard()
        remove_later(doomed)
        return files, tuple(here)

    def _temporary(self, k: int) -> str:
        """Where shard ``k`` is written until every rank has written its part."""
        return os.path.join(self.directory, f".collgrad-shard-{k}.tmp")

    def _write_index(self) -> None:
        count = len(self.plan)
        index = {
            "metadata": {"total_size": sum(s.data_bytes for s in self.plan)},
            "weight_map": {e.name: shard_name(k, count) for k, shard in enumerate(self.plan) for e in shard.entries},
        }
        temporary = os.path.join(self.directory, f".{INDEX_NAME}.tmp")
        with open(temporary, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(temporary, os.path.join(self.directory, INDEX_NAME))

    def _set_aside_stale(self, files: tuple[str, ...]) -> list[str]:
        """Weights files an earlier save left that are not part of this one (``from_pretrained`` would
        load ``model.safetensors`` before an index), as ``save_pretrained`` removes them: renamed out of
        the way now, returned for removal later."""
        out = []
        for name in os.listdir(self.directory):
            stale = name == SINGLE_NAME or name == INDEX_NAME or _SHARD.match(name) is not None
            if stale and name not in files:
                aside = stale_name(os.path.join(self.directory, name))
                os.rename(os.path.join(self.directory, name), aside)
                out.append(aside)
        return out

    def discard(self) -> None:
        """Every temporary file of this rank removed (after a failure anywhere)."""
        self._held = None
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        remove_all(path for _, path in self.written)
        self.written.clear()

    def _write(self, fd: int, data: memoryview, offset: int) -> bool:
        try:
            write_all(fd, data, offset)
        except OSError as error:
            self.error = error
            return False
        self.bytes_written += len(data)
        if _WRITEBACK is not None and len(data) >= 1 << 20:
            _WRITEBACK(fd, offset, len(data))  # on its way to the disk now: less for finish() to wait for
        return True


#: What an earlier checkpoint's file is renamed (or linked) to before it is removed in the background (a
#: later training-state commit removes any left by a process that ended first).
STALE = ".collgrad-stale-"


def stale_name(path: str) -> str:
    """A name beside ``path`` for it while it waits to be removed."""
    return os.path.join(os.path.dirname(path), f"{STALE}{secrets.token_hex(4)}-{os.path.basename(path)}")


def _kept_aside(final: str) -> list[str]:
    """A second name for the file at ``final`` (a hard link) where there is one, so that replacing it
    does not free its blocks in the caller's time; what to remove later. Nothing where there is no
    file, or the file system links none (the replace then frees them)."""
    aside = stale_name(final)
    try:
        os.link(final, aside)
    except OSError:
        return []
    return [aside]


def remove_later(paths: list[str]) -> None:
    """``paths`` removed in a background thread: freeing a file's blocks costs ~10 ms a file, which is
    not the caller's wait; a non-daemon thread, so the interpreter finishes it before it exits."""
    if paths:
        threading.Thread(target=remove_all, args=(paths,), name="collgrad-remove-stale").start()


def remove_all(paths: Iterable[str]) -> None:
    """Each of ``paths`` removed where it is there to remove (cleaning up: a file already gone, or one
    that cannot be removed, is left to the error that made the caller clean up). Local."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def follows_on(
    before: tuple[Hashable, int, torch.Tensor], file: Hashable, offset: int, data: torch.Tensor
) -> torch.Tensor | None:
    """``before`` (a write waiting: its file, byte offset and values) and ``data`` (to write at ``offset``
    of ``file``) as one write's values: one view of both, where ``data``'s bytes follow ``before``'s in
    the file and in memory; else None. What joins a run of writes into one (the weights' flat buffer,
    ZeRO's flat partitions). Local."""
    held_file, at, values = before
    if held_file != file or at + values.nbytes != offset:
        return None
    return adjacent_view([values, data])


def shared(sizes: Sequence[int], index: int, world: int) -> list[int]:
    """Of items of ``sizes`` bytes one after another, those rank ``index`` of ``world`` writes when the
    ranks share the writing: item k by the rank whose turn its first byte falls in, counting through
    the bytes in order (a contiguous run per rank, about 1/world of the bytes each). Pure."""
    total = sum(sizes) or 1
    out, at = [], 0
    for k, size in enumerate(sizes):
        if min(world - 1, at * world // total) == index:
            out.append(k)
        at += size
    return out


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``data`` written to the open file ``fd`` at byte ``offset``, however many calls that takes. OSError
    where the disk refuses it."""
    while len(data):
        done = os.pwrite(fd, data[:_MOST], offset)
        data, offset = data[done:], offset + done


def _writeback() -> Callable[[int, int, int], object] | None:
    """Linux's ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing a range of a
    file to the disk and return at once (Python's ``os`` has no binding), so that a save's flush at
    the end waits for what is still in flight instead of for every byte; None elsewhere (the flush
    then does it all)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


_WRITEBACK = _writeback()


class RangeWriter:
    """Byte ranges written at their offsets into files of known size that several ranks fill together:
    each file opened once (created where it is not there yet, and given its final size), every write
    counted; a failure kept in ``error`` (later writes skipped), never raised, for the caller to tell
    the other ranks. ``finish`` flushes every file to the disk and closes it; ``remove`` takes away the
    files this rank opened (after a failure anywhere). Local."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self.opened: list[str] = []
        self.error: BaseException | None = None
        self.bytes_written = 0

    def write(self, path: str, size: int, offset: int, data: memoryview) -> None:
        """``data`` at byte ``offset`` of ``path``, a file of ``size`` bytes."""
        if self.error is not None:
            return
        try:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                self.opened.append(path)
                os.ftruncate(fd, size)  # the same size on every rank: nothing written is cut
            write_all(fd, data, offset)
            self.bytes_written += len(data)
            if _WRITEBACK is not None and len(data) >= 1 << 20:
                _WRITEBACK(fd, offset, len(data))
        except OSError as error:
            self.error = error

    def finish(self) -> None:
        """Every file this rank wrote flushed to the disk (its data and size: fdatasync) and closed."""
        for fd in self._fds.values():
            try:
                if self.error is None:
                    os.fdatasync(fd)
            except OSError as error:
                self.error = error
            finally:
                os.close(fd)
        self._fds.clear()

    def remove(self) -> None:
        """Every file this rank opened removed (closed first)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        remove_all(self.opened)
        self.opened.clear()
