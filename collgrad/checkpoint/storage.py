"""The one writer and the one reader of checkpoint files: they only move bytes, as a plan's items say
(plan.py), between files and this rank's memory. Local: no process group; every failure is kept for
the caller to tell the other ranks (a rank that raised alone would leave them waiting).

    write   WriteItem -> the views of its values in memory (``Memory``) -> converted to the file's
            dtype -> joined with the write before it where both their bytes and their values follow
            on (a flat partition's fragments: one write) -> pwrite at its offset; large ones started
            on their way to the disk at once (``sync_file_range``); finish: fdatasync, close
    read    ReadItems -> each tensor's ranges read once (the whole tensor where any holding wants it
            whole) -> runs of adjacent bytes, read straight into place where their places follow on
            in one storage, else into a buffer of their own (at most ``MAX_RUN_BYTES``) and copied
            -> preadv; then the copies from what was read straight into place (one foreach copy)

Files are opened once each, created where they are not there yet and given their final size by every
rank that writes into them (no rank truncates what another wrote).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import sys
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch

from collgrad.checkpoint.hashes import Hasher
from collgrad.checkpoint.plan import (
    SETTER,
    STATUS,
    WHOLE,
    Exchange,
    Held,
    Ranges,
    ReadExchange,
    ReadItem,
    SharedRead,
    WriteItem,
    turn_runs,
)
from collgrad.checkpoint.safetensors import Stored
from collgrad.core.buffers import Pieces, adjacent_view
from collgrad.errors import CollgradError

__all__ = [
    "Memory",
    "Writer",
    "write",
    "write_exchanged",
    "in_memory",
    "ValuesOf",
    "Staging",
    "write_values",
    "Reader",
    "LoadPlan",
    "Run",
    "Copy",
    "Target",
    "load_plan",
    "read",
    "read_shared",
    "read_exchanged",
    "reads",
    "joined_runs",
    "with_moves",
    "bytes_of",
    "remove_all",
    "file_system",
    "LOCAL_FILE_SYSTEMS",
    "MAX_RUN_BYTES",
    "JOINED_WRITE_BYTES",
]

#: the most one ``os.pwrite`` or ``os.preadv`` moves on Linux
_MOST = 0x7FFFF000


@dataclass(frozen=True)
class Memory:
    """Where one source's holdings lie, as ``Held`` indexes them: per layout group its local buffer
    (``Pieces`` of a partitioned group, a tensor per parameter of a replicated one), the tensors it
    holds whole outside the layout, and (SETTER) a setter taking a parameter's index and whole values."""

    groups: Sequence[Pieces | Sequence[torch.Tensor]] = ()
    whole: Sequence[torch.Tensor] = ()
    setter: Callable[[int, torch.Tensor], None] | None = None

    def views(self, held: Held, numel: int) -> Sequence[tuple[torch.Tensor, int]]:
        """The ``numel`` elements ``held`` places, as views of this memory, each with its first element
        among them (a fragment may lie across pieces). Not for SETTER."""
        if held.group == WHOLE or held.param >= 0:
            tensor = self.whole[held.param] if held.group == WHOLE else self._tensors(held.group)[held.param]
            if held.offset == 0 and numel == tensor.numel():
                return ((tensor, 0),)  # as it is (any shape): a read copies into it, a write flattens it
            flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
            return ((flat[held.offset : held.offset + numel], 0),)
        buffer = self.groups[held.group]
        assert isinstance(buffer, Pieces)
        return tuple(buffer.spans(held.offset, numel))

    def _tensors(self, group: int) -> Sequence[torch.Tensor]:
        found = self.groups[group]
        assert not isinstance(found, Pieces)
        return found


def _file_runs(ranges: Ranges, at: int, numel: int) -> Iterator[tuple[int, int, int]]:
    """Elements ``[at, at + numel)`` of ``ranges`` (in their order) as runs of the tensor: (its first
    element in the tensor, its first among the ``numel``, elements). Pure."""
    done = 0
    while done < numel:
        k, within = divmod(at + done, ranges.length)
        n = min(ranges.length - within, numel - done)
        yield ranges.start + k * ranges.stride + within, done, n
        done += n


class Writer:
    """Byte ranges written at their offsets into files of known size (several ranks may fill one file
    together): each file opened once and given its final size, every write counted; a write may wait
    to be joined with the next where their bytes and values follow on. A failure is kept in ``error``
    (later writes skipped), never raised. ``finish`` flushes every file to the disk and closes it;
    ``remove`` takes away the files this rank opened (after a failure anywhere). Local."""

    def __init__(self, hasher: Hasher | None = None, joined_below: int = 0) -> None:
        """``hasher``: takes every byte written, as it goes out (hashes.py). ``joined_below``: a write of
        fewer bytes whose values lie apart from the next's is copied to be joined with it where their
        bytes follow on in the file (``IoCosts.joined_below`` of the directory; 0: never)."""
        self._fds: dict[str, int] = {}
        self.opened: list[str] = []
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.hasher = hasher
        #: a write waiting to be joined with the next: (path, size, offset, values)
        self._held: tuple[str, int, int, torch.Tensor] | None = None
        self.joined_below = joined_below
        #: where small writes that follow on in a file but not in memory are joined (``JOINED_WRITE_BYTES``,
        #: made at the first): a stream's tensors, each in a bucket the next overwrites
        self._joined: torch.Tensor | None = None
        self._joined_bytes = memoryview(b"")

    def write(self, path: str, size: int, offset: int, values: torch.Tensor, dtype: torch.dtype, kept: bool) -> None:
        """``values`` (any elements, flattened) written as ``dtype`` at byte ``offset`` of ``path``, a file
        of ``size`` bytes. ``kept``: the caller keeps ``values`` as they are until the next write (a
        module's own weight, a mapped file; not a stream's bucket, which the next bucket overwrites).
        Writes whose bytes follow on in the file are one system call: as one view where their values
        follow on in memory too (a flat buffer), else, each smaller than ``joined_below``, copied one
        after another into the writer's buffer while together at most ``JOINED_WRITE_BYTES`` (a
        stream's small tensors: thousands of writes otherwise, each a round trip on a parallel file
        system)."""
        if self.error is not None:
            return
        try:
            data, copied = _on_host(values, dtype)
            if not data.numel():
                return
            held = self._held
            if held is not None:
                joined = follows_on((held[0], held[2], held[3]), path, offset, data)
                if (
                    joined is None
                    and (held[0], held[2] + held[3].nbytes) == (path, offset)
                    and self._small(data)
                    and (self._small(held[3]) or self._in_buffer(held[3]))
                    and held[3].nbytes + data.nbytes <= JOINED_WRITE_BYTES
                ):
                    joined = self._joining(held[3], data)
                if joined is not None:
                    self._held = (path, size, held[2], joined)
                    return
                self._let_go()
            if kept or copied:
                self._held = (path, size, offset, data)
            elif self._small(data):  # the caller's values change after this call: a copy waits
                self._held = (path, size, offset, self._joining(None, data))
            else:
                self._pwrite(path, size, offset, bytes_of(data))
        except Exception as error:  # noqa: BLE001 - told to every rank by the caller
            self.error = error

    def _small(self, data: torch.Tensor) -> bool:
        """Whether ``data`` is copied to be joined: fewer bytes than ``joined_below``, and the buffer's."""
        return data.nbytes < min(self.joined_below, JOINED_WRITE_BYTES + 1)

    def _in_buffer(self, data: torch.Tensor) -> bool:
        """Whether ``data`` waits in the writer's buffer (it always starts it)."""
        return self._joined is not None and data.data_ptr() == self._joined.data_ptr()

    def _joining(self, first: torch.Tensor | None, then: torch.Tensor) -> torch.Tensor:
        """``first`` (a waiting write's values, or None) and ``then`` one after another in the writer's
        buffer (together at most ``JOINED_WRITE_BYTES``), as its bytes."""
        n = 0 if first is None else first.nbytes
        assert n + then.nbytes <= JOINED_WRITE_BYTES, "a write joined in the buffer fits it"
        if self._joined is None:
            self._joined = torch.empty(JOINED_WRITE_BYTES, dtype=torch.uint8)
            self._joined_bytes = bytes_of(self._joined)  # memoryview copies: a small tensor's copy_ costs more
        into = self._joined_bytes
        if first is not None and not self._in_buffer(first):  # waiting elsewhere: copied in first
            into[:n] = bytes_of(first)
        into[n : n + then.nbytes] = bytes_of(then)
        return self._joined[: n + then.nbytes]

    def write_bytes(self, path: str, size: int, offset: int, data: bytes | memoryview) -> None:
        """``data`` at byte ``offset`` of ``path`` (a header; a run of exchanged pieces)."""
        if self.error is None:
            self._let_go()
            self._pwrite(path, size, offset, memoryview(data))

    def _let_go(self) -> None:
        """The write held for joining, written."""
        if self._held is not None:
            path, size, offset, data = self._held
            self._held = None
            self._pwrite(path, size, offset, bytes_of(data))

    def write_runs(
        self, path: str, size: int, runs: Sequence[tuple[int, int, int]], values: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """``values`` (flattened, as ``dtype``) written in ``runs``: (byte offset in ``path``, first byte and
        bytes of the values), a row of a strided item each (a shard along dimension 1: one per row of
        the whole tensor), in one loop of system calls over one view of the values."""
        if self.error is not None or not runs:
            return
        try:
            self._let_go()
            data, _ = _on_host(values, dtype)
            fd, view = self._fd(path, size), bytes_of(data)
            for offset, lo, n in runs:
                write_all(fd, view[lo : lo + n], offset)
                if self.hasher is not None:
                    self.hasher.add(path, offset, view[lo : lo + n])
            self.bytes_written += sum(n for _, _, n in runs)
            first, last = runs[0][0], runs[-1][0] + runs[-1][2]
            if _WRITEBACK is not None and last - first >= 1 << 20:
                _WRITEBACK(fd, first, last - first)  # on its way to the disk now: less for finish() to wait for
        except Exception as error:  # noqa: BLE001 - told to every rank by the caller
            self.error = error

    def _fd(self, path: str, size: int) -> int:
        """``path`` open for writing, given its final size when this rank first opens it."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            self.opened.append(path)
            os.ftruncate(fd, size)  # the same size on every rank: nothing written is cut
        return fd

    def _pwrite(self, path: str, size: int, offset: int, data: memoryview) -> None:
        try:
            fd = self._fd(path, size)
            write_all(fd, data, offset)
            if self.hasher is not None:
                self.hasher.add(path, offset, data)
            self.bytes_written += len(data)
            if _WRITEBACK is not None and len(data) >= 1 << 20:
                _WRITEBACK(fd, offset, len(data))  # on its way to the disk now: less for finish() to wait for
        except OSError as error:
            self.error = error

    def finish(self) -> None:
        """Every file this rank wrote flushed to the disk (its data and size: fdatasync) and closed."""
        if self.error is None:
            try:
                self._let_go()
            except Exception as error:  # noqa: BLE001 - told to every rank by the caller
                self.error = error
        self._held = None
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
        self._held = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        remove_all(self.opened)
        self.opened.clear()


#: The values of a write item, as views each with its first element among the item's: where ``write``
#: takes them from.
ValuesOf = Callable[[WriteItem], Sequence[tuple[torch.Tensor, int]]]


def in_memory(memory: Sequence[Memory]) -> ValuesOf:
    """An item's values as views of the memory its ``held`` names (``Memory.views``)."""
    return lambda item: memory[item.held.source].views(item.held, item.ranges.numel) if item.held else ()


def write(
    writer: Writer,
    items: Iterable[WriteItem],
    values_of: ValuesOf,
    headers: Mapping[str, bytes],
    path_of: Callable[[str], str],
    after: Callable[[WriteItem], None] | None = None,
) -> None:
    """Every item's bytes written into the file ``path_of(item.file)``: a header from ``headers`` (by
    file), values from ``values_of`` (``in_memory``, or a ``Staging``'s copy), each run at its offset;
    ``after(item)`` once it is handed to the writer. Failures are kept in ``writer.error``. Local."""
    paths: dict[str, str] = {}
    with torch.no_grad():
        for item in items:
            if writer.error is not None:
                return
            path = paths.get(item.file)
            if path is None:
                path = paths[item.file] = path_of(item.file)
            if item.held is None:
                writer.write_bytes(path, item.size, 0, headers[item.file])
            else:
                for view, at in values_of(item):
                    write_values(writer, path, item, view, at)
            if after is not None:
                after(item)


def write_exchanged(
    writer: Writer,
    windows: Sequence[Exchange],
    values_of: ValuesOf,
    path_of: Callable[[str], str],
    exchange: Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor],
) -> None:
    """Small slices written by the ranks whose turn their bytes are (plan.exchanged_writes): per window,
    this rank's slices (their values as the files hold them, by destination, each destination's after
    this rank's status) sent and every rank's for this rank received (``exchange``: one all-to-all),
    laid out as the files hold them, and written as a few contiguous runs. Every rank of the group
    calls it with its windows whatever failed before or fails here (the exchanges are collective):
    after a failure its status says so (nothing it sends is written) and it writes nothing more; a
    failure anywhere stays in ``writer.error`` or is told by the caller's agreement."""
    for window in windows:
        part = torch.zeros(sum(window.sent), dtype=torch.uint8)
        if writer.error is None:
            try:
                _fill(part, window, values_of)
            except Exception as error:  # noqa: BLE001 - told to every rank by the caller
                writer.error = error
        _told(part, window.sent, writer.error)
        got = exchange(part, window.sent, window.received)
        if writer.error is not None or not _all_well(got, window.received):
            continue  # this rank's or a sender's failure: the caller's agreement tells it
        try:
            runs = _moved(got, window.moves, sum(n for *_, n in window.runs))
            at, view = 0, bytes_of(runs)
            for file, size, offset, n in window.runs:
                writer.write_bytes(path_of(file), size, offset, view[at : at + n])
                at += n
        except Exception as error:  # noqa: BLE001 - told to every rank by the caller
            writer.error = error


def _fill(part: torch.Tensor, window: Exchange, values_of: ValuesOf) -> None:
    """``part`` filled with ``window.sends``' values as the files hold them, each destination's after its
    status bytes (the items go by destination in rank order: each segment filled in turn)."""
    out, starts = bytes_of(part), _starts(window.sent)
    segment, at, end = -1, 0, 0
    with torch.no_grad():
        for item in window.sends:
            while at >= end:  # this destination's segment is full: the next one's, past its status
                segment += 1
                at, end = starts[segment] + STATUS, starts[segment] + window.sent[segment]
            size = item.dtype.itemsize
            for view, first in values_of(item):
                data, _ = _on_host(view, item.dtype)
                nbytes = data.numel() * size
                out[at + first * size : at + first * size + nbytes] = bytes_of(data)
            at += item.ranges.numel * size


def _starts(lengths: Sequence[int]) -> list[int]:
    """Where each of segments of ``lengths``, back to back, starts."""
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n
    return out


def _told(part: torch.Tensor, lengths: Sequence[int], error: BaseException | None) -> None:
    """Each segment's status bytes (its first ``STATUS``): 0, or 1 where this rank failed."""
    for start in _starts(lengths):
        part[start : start + STATUS] = 0 if error is None else 1


def _all_well(got: torch.Tensor, lengths: Sequence[int]) -> bool:
    """Whether every rank's segment of what this rank received says its sender went well (one look)."""
    starts = torch.tensor(_starts(lengths), dtype=torch.int64)
    return not bool(got[(starts[:, None] + torch.arange(STATUS)).view(-1)].any())


def _moved(got: torch.Tensor, moves: Sequence[tuple[int, int, int]], nbytes: int) -> torch.Tensor:
    """``nbytes`` laid out from ``got`` by ``moves`` (``_laid``)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    _laid(out, got, moves)
    return out


def _laid(out: torch.Tensor, came: torch.Tensor, moves: Sequence[tuple[int, int, int]]) -> None:
    """``out`` filled from ``came`` (both uint8) by ``moves``: (offset in ``came``, offset in ``out``,
    bytes) each."""
    into, have = bytes_of(out), bytes_of(came)
    for src, dst, n in moves:
        into[dst : dst + n] = have[src : src + n]


class Staging:
    """Host memory that write items' values are copied into, so that they can be written after their
    owner has changed them (an async save: the state at the call, whatever steps follow): the values
    as the files hold them (the item's dtype), in the items' order, back to back where their dtypes
    align (the writer joins what follows on in memory and in the file into one write). Kept from one
    copy to the next, grown when a copy needs more, pinned where the values lie on a device. Local;
    one copy in use at a time."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def copy(self, items: Sequence[WriteItem], values_of: ValuesOf) -> ValuesOf:
        """Every item's values copied here, waited for (a device's copies too); returns where ``write``
        takes them from, valid until the next ``copy``."""
        offsets, end = [], 0
        for item in items:
            width = item.dtype.itemsize
            end = -(-end // width) * width  # a view of the bytes as the item's dtype must align
            offsets.append(end)
            end += item.ranges.numel * width if item.held is not None else 0
        views = [list(values_of(item)) for item in items]
        on_device = any(v.device.type != "cpu" for found in views for v, _ in found)
        buffer = self._buffer
        if buffer is None or buffer.numel() < end or (on_device and not buffer.is_pinned()):
            self._buffer = None  # the old one let go of first: at most one held
            buffer = self._buffer = torch.empty(end, dtype=torch.uint8, pin_memory=on_device)
        staged: dict[WriteItem, Sequence[tuple[torch.Tensor, int]]] = {}
        with torch.no_grad():
            for item, offset, found in zip(items, offsets, views):
                if item.held is None:
                    continue
                values = buffer[offset : offset + item.nbytes].view(item.dtype)
                for view, at in found:
                    flat = view.reshape(-1) if view.dim() != 1 else view
                    values[at : at + flat.numel()].copy_(flat, non_blocking=on_device)
                staged[item] = ((values, 0),)
        if on_device:
            torch.accelerator.synchronize()  # the copies above were queued on the device's stream
        return lambda item: staged.get(item, ())


def _on_host(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``values`` flattened, contiguous, on the host in ``dtype`` (as bytes go to a file), and whether that
    took a copy (else it is the caller's memory)."""
    data = values.reshape(-1) if values.dim() != 1 else values
    if data.requires_grad:  # a parameter itself (a replicated group's)
        data = data.detach()
    copied = data.device.type != "cpu" or data.dtype != dtype or not data.is_contiguous()
    return (data.to("cpu", dtype).contiguous() if copied else data), copied


def write_values(
    writer: Writer, path: str, item: WriteItem, values: torch.Tensor, at: int = 0, kept: bool = True
) -> None:
    """``values`` (``item``'s elements from its ``at``-th on, in order) written where they go in the file
    ``path``: one run at its place, a strided item's cut where its elements leave a run. ``kept``: the
    values stay as they are until the writer is done (else they are copied if the write waits). Local."""
    size = item.dtype.itemsize
    if item.ranges.rows == 1:
        writer.write(path, item.size, item.offset + at * size, values, item.dtype, kept)
        return
    base = item.offset - item.ranges.start * size
    runs = [(base + first * size, lo * size, n * size) for first, lo, n in _file_runs(item.ranges, at, values.numel())]
    writer.write_runs(path, item.size, runs, values, item.dtype)


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


#: File systems whose calls are the local kernel's (its page cache, a disk of this machine): a call of
#: a few microseconds (a 16 KiB pread from the page cache ~2 us, a pwrite ~10 us, measured here), not
#: a network round trip. What no list names (NFS, Lustre, GPFS, BeeGFS, CephFS, a FUSE mount of an
#: object store) is taken to be a network's.
LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "ramfs", "overlay", "jfs"}
)


def file_system(path: str) -> str | None:
    """The type of the file system ``path`` (or, where it is not there yet, the nearest directory above
    it) lies on, from Linux's ``/proc/self/mountinfo`` (the deepest mount point that holds it); None
    where that cannot be read (another OS). Local."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    at = os.path.realpath(path)
    while not os.path.exists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    best, found = -1, None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        # mount point: field 5, its spaces, tabs, newlines and backslashes escaped as octal; the type
        # after the "-"
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        kind = fields[fields.index("-", 6) + 1]
        inside = at == point or at.startswith(point.rstrip("/") + "/")
        # the deepest mount point that holds the path (the table's order is not always the mounts': in a
        # container the root may come after /proc); of two at one point, the later, which hides the other
        if inside and len(point) >= best:
            best, found = len(point), kind
    return found


def bytes_of(data: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, as they lie (no copy): writable, and holding the tensor's storage
    while it lives (reads land in the tensor itself)."""
    assert data.is_contiguous() and data.device.type == "cpu"
    return memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())


def remove_all(paths: Iterable[str]) -> None:
    """Each of ``paths`` removed where it is there to remove (cleaning up: a file already gone, or one
    that cannot be removed, is left to the error that made the caller clean up). Local."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


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


class Reader:
    """Ranges of a checkpoint's files read straight into memory, each file opened once; counts the bytes
    read. Use it as a context manager (or ``close`` it). Local."""

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

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Target:
    """One place a range of a tensor goes: elements ``[at, at + numel)`` of it (flat) into ``dest``, a
    view of where this rank keeps them (any shape of ``numel`` elements; converted on the copy), or,
    where no view can be had (an optimizer collgrad does not read), through ``put`` (DeepSpeed's setter)."""

    at: int
    numel: int
    dest: torch.Tensor | None = None
    put: Callable[[torch.Tensor], None] | None = None

    def write(self, values: torch.Tensor) -> None:
        """Put ``values`` (1-D, contiguous: this target's elements) in place."""
        if self.dest is not None:
            self.dest.copy_(values if self.dest.dim() == 1 else values.view(self.dest.shape))
        else:
            assert self.put is not None
            self.put(values)

    def takes(self, dtype: torch.dtype, lo: int, numel: int) -> bool:
        """A read of ``[lo, lo + numel)`` of a tensor stored as ``dtype`` can land in ``dest`` itself: the
        same range, dtype and a contiguous CPU view (then the others copy from it)."""
        dest = self.dest
        return (
            dest is not None
            and (self.at, self.numel) == (lo, numel)
            and dest.dtype == dtype
            and dest.device.type == "cpu"
            and dest.is_contiguous()
        )


def reads(targets: Sequence[tuple[int, int]], numel: int) -> tuple[tuple[int, int], ...]:
    """The ranges to read of a tensor of ``numel`` elements for ``targets`` (first element, elements):
    the whole tensor once where any target wants it whole, else each distinct range once. Pure."""
    if any(lo == 0 and n == numel for lo, n in targets):
        return ((0, numel),)
    return tuple(sorted(set(targets)))


_T = TypeVar("_T")

#: The most bytes of small writes a writer joins in its buffer (``Writer.write``): a few ms of a parallel
#: file system's bandwidth a call, against its ~1 ms a call; the writer's memory for it.
JOINED_WRITE_BYTES = 4 * 2**20

#: The most bytes of ranges read together into a buffer of their own (ranges read straight into place
#: are joined without a bound: they take no memory).
MAX_RUN_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Copy:
    """Elements ``[at, at + target.numel)`` of a run put in place by ``target``."""

    at: int
    target: Target


@dataclass(frozen=True)
class Run:
    """Adjacent byte ranges of one file, read with one call: ``nbytes`` at ``offset``, ``numel`` elements
    of ``dtype``, straight into ``dest`` where the first place each range goes lies right after the
    previous one's in one storage (a flat view over all of them), else into a buffer of its own; then
    ``copies`` put the run's elements where else they go. ``dest``: flat."""

    file: str
    offset: int
    numel: int
    dtype: torch.dtype
    dest: torch.Tensor | None
    copies: tuple[Copy, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def into(self) -> memoryview | None:
        """``dest``'s bytes, worked out once per run (a kept plan reads into the same ones again)."""
        return bytes_of(self.dest) if self.dest is not None else None


def load_plan(
    memory: Sequence[Memory],
    items: Callable[[], Sequence[ReadItem]],
    kept: dict[Hashable, object] | None = None,
    key: Hashable = None,
) -> LoadPlan:
    """The read items ``items()`` gives resolved against ``memory``: every place each range goes, each
    stored tensor's ranges read once (straight into the first place that can take it where one can),
    joined into runs. ``kept``: a scratch of the model's where the plan is kept for the next load
    whose items depend on the same ``key`` and go into the same memory (its views keep that memory
    alive, so an address that matches is the same storage): then ``items`` is not called. Local."""
    return _kept(kept, "load plan", key, memory, lambda: _load_plan(memory, items()))


def _kept(
    kept: dict[Hashable, object] | None, name: str, key: Hashable, memory: Sequence[Memory], make: Callable[[], _T]
) -> _T:
    """``make()``, kept in ``kept`` under ``name`` for the next call whose plan depends on the same ``key``
    and resolves against the same ``memory`` (by address: what is kept holds views of it, so an
    address that matches is the same storage); nothing is kept where a setter takes any of it."""
    addresses = _memory_key(memory) if kept is not None else None
    full = (key, addresses) if addresses is not None else None  # None: nothing is kept
    found = kept.get(name) if kept is not None and full is not None else None
    if isinstance(found, tuple) and found[0] == full:
        kept_one: _T = found[1]
        return kept_one
    made = make()
    if kept is not None and full is not None:
        kept[name] = (full, made)
    return made


def _load_plan(memory: Sequence[Memory], items: Iterable[ReadItem]) -> LoadPlan:
    targets: dict[tuple[str, int, torch.dtype, int], list[Target]] = {}
    for item in items:
        numel = math.prod(item.shape)
        start = item.offset - item.ranges.start * item.dtype.itemsize
        into = targets.setdefault((item.file, start, item.dtype, numel), [])
        into.extend(_targets(item, memory[item.held.source]))
    single = []
    for (file, start, dtype, numel), wanted in targets.items():
        for lo, n in reads([(w.at, w.numel) for w in wanted], numel):
            covered = [w for w in wanted if lo <= w.at and w.at + w.numel <= lo + n]
            direct = next((w for w in covered if w.takes(dtype, lo, n)), None)  # straight into place
            copies = tuple(Copy(w.at - lo, w) for w in covered if w is not direct)
            dest = None if direct is None or direct.dest is None else direct.dest.view(-1)  # contiguous
            single.append(Run(file, start + lo * dtype.itemsize, n, dtype, dest, copies))
    return with_moves(joined_runs(single))


def _targets(item: ReadItem, memory: Memory) -> Iterator[Target]:
    """The places ``item``'s elements go: views of ``memory`` (a strided item's runs each their own), or
    the setter (a parameter whole)."""
    held = item.held
    if held.group == SETTER:
        setter, param, shape = memory.setter, held.param, item.shape
        assert setter is not None

        def put(values: torch.Tensor) -> None:
            setter(param, values.reshape(shape))

        yield Target(item.ranges.start, item.ranges.numel, put=put)
        return
    for view, at in memory.views(held, item.ranges.numel):
        if item.ranges.rows == 1:
            yield Target(item.ranges.start + at, view.numel(), view)
            continue
        flat = view.reshape(-1)  # a strided item's memory: a contiguous local shard
        for first, lo, n in _file_runs(item.ranges, at, view.numel()):
            yield Target(first, n, flat[lo : lo + n])


def _memory_key(memory: Sequence[Memory]) -> tuple[object, ...] | None:
    """The address, size and dtype of every tensor of ``memory``; None where a setter takes any (a plan
    through it is not kept)."""
    parts: list[object] = []
    for one in memory:
        if one.setter is not None:
            return None
        for buffer in one.groups:
            tensors = buffer.given if isinstance(buffer, Pieces) else buffer
            parts.append(tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
        parts.append(tuple((t.data_ptr(), t.numel(), t.dtype) for t in one.whole))
    return tuple(parts)


def read(plan: LoadPlan) -> tuple[int, BaseException | None]:
    """``plan``'s reads and copies done on this rank: the bytes read, and the error that stopped them (an
    I/O error, a setter's), for the caller to agree on. Local."""
    reader = Reader()
    error: BaseException | None = None
    try:
        with torch.no_grad():
            for run in plan.runs:
                if run.into is not None:  # straight into place
                    reader.read_at(run.file, run.offset, run.into)
                    continue
                buffer = torch.empty(run.numel, dtype=run.dtype)
                reader.read_at(run.file, run.offset, buffer)
                for copy in run.copies:
                    copy.target.write(buffer[copy.at : copy.at + copy.target.numel])
                del buffer  # one read buffer at a time
            plan.move()
    except (OSError, CollgradError) as caught:
        error = caught
    finally:
        reader.close()
    return reader.bytes_read, error


def read_shared(
    windows: Sequence[SharedRead],
    index: int,
    memory: Sequence[Memory],
    gather: Callable[[torch.Tensor], torch.Tensor],
    from_turn: Sequence[Sequence[tuple[ReadItem, int]]] = (),
    kept: dict[Hashable, object] | None = None,
    key: Hashable = None,
) -> tuple[int, BaseException | None]:
    """What the ranks of a group read alike, read once between them (plan.shared_reads): in each window
    this rank's turn read into its part after its status (runs of bytes that follow on in a file and
    in the part, one call each), every rank's part gathered (``gather``: this rank's part -> every
    rank's parts back to back, rank-major: one collective), and every piece put in place from its
    owner's part (converted to its place's dtype) where that part's status says its reads went well;
    this rank's own items that lie in its turn (``from_turn``, per window: the item and where its bytes
    start in the part) put in place from its part. Every rank of the group calls it with the same
    windows whatever failed before or fails here (the gathers are collective): after a failure its
    status says so, it puts nothing more in place, and returns the failure for the caller's
    agreement (where another rank failed, that rank's). Where the places go is worked out once and
    ``kept`` for the next load alike (``key``: what the windows depend on). Returns the bytes read."""

    def placed(w: int) -> Iterator[tuple[ReadItem, int, int]]:
        window = windows[w]
        yield from zip(window.items, window.owner, window.at)
        yield from ((item, index, at) for item, at in (from_turn[w] if from_turn else ()))  # its own, in its turn

    every = range(len(windows))
    puts, error = _resolved(kept, "shared puts", key, memory, lambda: [Puts.of(placed(w), memory) for w in every])
    reader = Reader()
    try:
        for w, window in enumerate(windows):
            part = torch.zeros(window.part_bytes, dtype=torch.uint8)
            if error is None:
                try:
                    for file, offset, at, nbytes in turn_runs(window, index):
                        reader.read_at(file, offset, part[at : at + nbytes])
                except Exception as caught:  # noqa: BLE001 - told to every rank by the caller
                    error = caught
            _told(part, [window.part_bytes], error)
            gathered = gather(part).view(-1, window.part_bytes)
            if error is not None or not _all_well(gathered.view(-1), [window.part_bytes] * gathered.shape[0]):
                continue
            try:
                puts[w].put(gathered)
            except Exception as caught:  # noqa: BLE001 - told to every rank by the caller
                error = caught
    finally:
        reader.close()
    return reader.bytes_read, error


def read_exchanged(
    windows: Sequence[ReadExchange],
    memory: Sequence[Memory],
    exchange: Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor],
    kept: dict[Hashable, object] | None = None,
    key: Hashable = None,
) -> tuple[int, BaseException | None]:
    """Small slices read by the ranks whose turn their bytes are and moved to their holders
    (plan.exchanged_reads): per window, this rank's runs read into its buffer, each holder's slices
    sent after this rank's status (``exchange``: one all-to-all), and this rank's items put in place
    from what it received (converted to their places' dtype) where every sender's status says its
    reads went well. Every rank of the group calls it with its windows whatever failed before or fails
    here (the exchanges are collective): after a failure its status says so and it puts nothing more
    in place; the failure is returned for the caller's agreement. Where the places go is worked out
    once and ``kept`` for the next load alike (``key``: what the windows depend on). Returns the bytes
    read."""
    puts, error = _resolved(
        kept, "exchanged puts", key, memory, lambda: [Puts.of(((i, 0, t) for i, t in w.takes), memory) for w in windows]
    )
    reader = Reader()
    try:
        for w, window in enumerate(windows):
            part = torch.zeros(sum(window.sent), dtype=torch.uint8)
            if error is None:
                try:
                    buffer = torch.empty(sum(n for *_, n in window.runs), dtype=torch.uint8)
                    at = 0
                    for file, offset, n in window.runs:
                        reader.read_at(file, offset, buffer[at : at + n])
                        at += n
                    _laid(part, buffer, window.moves)
                except Exception as caught:  # noqa: BLE001 - told to every rank by the caller
                    error = caught
            _told(part, window.sent, error)
            got = exchange(part, window.sent, window.received)
            if error is not None or not _all_well(got, window.received):
                continue
            try:
                puts[w].put(got.view(1, -1))
            except Exception as caught:  # noqa: BLE001 - told to every rank by the caller
                error = caught
    finally:
        reader.close()
    return reader.bytes_read, error


def _resolved(
    kept: dict[Hashable, object] | None,
    name: str,
    key: Hashable,
    memory: Sequence[Memory],
    make: Callable[[], list[Puts]],
) -> tuple[list[Puts], BaseException | None]:
    """Where a gather's or an exchange's pieces go (``_kept``), or the failure to work it out: kept for
    the caller to tell in every window, as a failed read (it still takes part in each collective)."""
    try:
        return _kept(kept, name, key, memory, make), None
    except Exception as caught:  # noqa: BLE001 - told to every rank by the caller
        return [], caught


@dataclass(frozen=True)
class Puts:
    """Where the items a rank receives in one window go (an exchange's or a gather's), resolved once
    against its memory: per place, where its values lie in what it receives (row, byte offset, stored
    dtype, elements) and a flat view of the place (one foreach copy for all, converting dtypes as a
    load plan's moves), or, where no view can take them (a setter), the target."""

    into: tuple[torch.Tensor, ...]
    values: tuple[tuple[int, int, torch.dtype, int], ...]
    rest: tuple[tuple[Target, tuple[int, int, torch.dtype, int]], ...]

    @staticmethod
    def of(placed: Iterable[tuple[ReadItem, int, int]], memory: Sequence[Memory]) -> Puts:
        """``placed``: each item, the row of what is received that holds it and the byte its elements
        start at there."""
        into: list[torch.Tensor] = []
        values: list[tuple[int, int, torch.dtype, int]] = []
        rest: list[tuple[Target, tuple[int, int, torch.dtype, int]]] = []
        for item, row, at in placed:
            size = item.dtype.itemsize
            for target in _targets(item, memory[item.held.source]):
                where = (row, at + (target.at - item.ranges.start) * size, item.dtype, target.numel)
                dest = target.dest
                if dest is not None and dest.is_contiguous() and dest.device.type == "cpu":
                    into.append(dest.view(-1))
                    values.append(where)
                else:
                    rest.append((target, where))
        return Puts(tuple(into), tuple(values), tuple(rest))

    def put(self, rows: torch.Tensor) -> None:
        """Every place filled from ``rows`` (uint8, a row per sender: what this rank received)."""
        with torch.no_grad():
            if self.into:
                torch._foreach_copy_(list(self.into), [_values(rows, where) for where in self.values])
            for target, where in self.rest:
                target.write(_values(rows, where))


def _values(rows: torch.Tensor, where: tuple[int, int, torch.dtype, int]) -> torch.Tensor:
    row, at, dtype, numel = where
    raw = rows[row, at : at + numel * dtype.itemsize]
    if at % dtype.itemsize:  # a view as wider elements must start on one of them
        raw = raw.clone()
    return raw.view(dtype)


def joined_runs(runs: Iterable[Run]) -> list[Run]:
    """``runs`` in file order, each joined with the next where its bytes follow in the file and its
    elements in memory (``_joined``). Pure."""
    return _folded(sorted(runs, key=lambda r: (r.file, r.offset)), _joined)


def _folded(items: Iterable[_T], together: Callable[[_T, _T], _T | None]) -> list[_T]:
    """``items`` in order, each made one with the one before it where ``together`` can (else None). Pure."""
    out: list[_T] = []
    for item in items:
        merged = together(out[-1], item) if out else None
        if merged is not None:
            out[-1] = merged
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class LoadPlan:
    """A load's reads and, once they are all done, the copies from where they were read straight into
    place to where else those elements go (``moves``: values, target), adjacent ones made one."""

    runs: tuple[Run, ...]
    moves: tuple[tuple[torch.Tensor, Target], ...]

    @functools.cached_property
    def _batched(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, Target]]]:
        """The moves into views on the device of their values, as two lists for one foreach copy (flat
        views), and the rest (setters, another device) one by one."""
        into, values, rest = [], [], []
        for v, target in self.moves:
            dest = target.dest
            if dest is not None and dest.device == v.device and dest.is_contiguous():
                into.append(dest.view(-1))
                values.append(v)
            else:
                rest.append((v, target))
        return into, values, rest

    def move(self) -> None:
        """Every move done: one foreach copy for those it can take, the rest one by one. Local."""
        into, values, rest = self._batched
        if into:
            torch._foreach_copy_(into, values)  # one call, not one per tensor (converting dtypes as copy_)
        for v, target in rest:
            target.write(v)


def with_moves(runs: Iterable[Run]) -> LoadPlan:
    """``runs`` with the copies of those read straight into place moved after every read (their values
    stay where they were read: each place is written once), each joined with the next where both its
    values and its target follow in one storage (ZeRO-3's weight partitions, one flat buffer, into the
    fp32 partition, another: one copy). The copies of a run read into a buffer of its own stay with it,
    joined the same way by storage. Pure."""
    kept: list[Run] = []
    moves: list[tuple[torch.Tensor, Target]] = []
    for run in runs:
        if run.dest is None:
            copies = _folded(sorted(run.copies, key=lambda c: (_place(c.target.dest)[0], c.at)), _copied_together)
            kept.append(replace(run, copies=tuple(copies)))
            continue
        moves.extend((run.dest[c.at : c.at + c.target.numel], c.target) for c in run.copies)
        kept.append(replace(run, copies=()))
    joined = _folded(sorted(moves, key=lambda m: _place(m[1].dest)), _moved_together)
    return LoadPlan(tuple(kept), tuple(joined))


def _moved_together(
    first: tuple[torch.Tensor, Target], then: tuple[torch.Tensor, Target]
) -> tuple[torch.Tensor, Target] | None:
    """Two moves as one, where ``then``'s values follow ``first``'s and its place follows ``first``'s,
    each in one storage; else None."""
    (first_values, first_target), (then_values, then_target) = first, then
    if first_target.dest is None or then_target.dest is None:
        return None
    values, dest = adjacent_view([first_values, then_values]), adjacent_view([first_target.dest, then_target.dest])
    if values is None or dest is None:
        return None
    return values, Target(first_target.at, dest.numel(), dest)


def _place(dest: torch.Tensor | None) -> tuple[int, int]:
    """Where ``dest`` lies (its storage, its offset in it): ordering by it puts neighbours side by side."""
    return (dest.untyped_storage().data_ptr(), int(dest.storage_offset())) if dest is not None else (-1, 0)


def _joined(first: Run, then: Run) -> Run | None:
    """``first`` and ``then`` as one run, where ``then``'s bytes follow ``first``'s in the same file and
    either both are read straight into place, ``then``'s right after ``first``'s in one storage, or
    both into buffers of their own, together at most ``MAX_RUN_BYTES``; else None. Pure."""
    if (first.file, first.dtype, first.offset + first.nbytes) != (then.file, then.dtype, then.offset):
        return None
    if first.dest is not None and then.dest is not None:
        dest = adjacent_view([first.dest, then.dest])
        if dest is None:
            return None
    elif first.dest is None and then.dest is None:
        if first.nbytes + then.nbytes > MAX_RUN_BYTES:
            return None
        dest = None
    else:
        return None
    moved = tuple(Copy(first.numel + c.at, c.target) for c in then.copies)
    return Run(first.file, first.offset, first.numel + then.numel, first.dtype, dest, first.copies + moved)


def _copied_together(first: Copy, then: Copy) -> Copy | None:
    """Two copies out of one run's buffer as one, where ``then``'s elements follow ``first``'s in the
    run and its place follows ``first``'s in one storage; else None."""
    a, b = first.target.dest, then.target.dest
    if first.at + first.target.numel != then.at or a is None or b is None:
        return None
    dest = adjacent_view([a, b])
    return Copy(first.at, Target(first.target.at, dest.numel(), dest)) if dest is not None else None
