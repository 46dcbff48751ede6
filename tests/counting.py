"""Counting the collectives torch itself receives, inside a rank: every collective method of
``torch.distributed.ProcessGroup`` is wrapped for the duration of the block. Whatever issues the
call (``torch.distributed`` functions, collgrad's channels calling the group directly, DeepSpeed),
it passes through here, so a test observes what happened instead of reading what the code under
test says about itself. ``count_io`` does the same for the reads and writes of checkpoint files:
the functions of ``os`` and ``builtins`` that move their bytes."""

from __future__ import annotations

import builtins
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["count_collectives", "count_planning", "Calls", "count_io", "Io", "as_on_a_network_file_system"]

_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "_allgather_base",
    "all_gather_single",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "recv_anysource",
)


class Calls(Counter):
    """Collective calls by method name; ``log`` holds (method, the first tensor argument's dtype, whether
    the call was made inside collgrad's agreement exchange)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, torch.dtype | None, bool]] = []
        self.in_agreement = False

    @property
    def total(self) -> int:
        return sum(self.values())

    @property
    def agreements(self) -> int:
        """Calls torch received for collgrad's agreements (capabilities, argument and readiness checks)."""
        return sum(1 for *_, agreement in self.log if agreement)

    @property
    def metadata(self) -> int:
        """Broadcasts: collgrad's only are a load's metadata (index or manifest, headers), read by one rank
        and sent to the others (``agree.metadata_once``: its length, then its bytes)."""
        return sum(1 for name, _, agreement in self.log if name == "broadcast" and not agreement)

    @property
    def data(self) -> int:
        """Calls torch received for everything else: the data itself."""
        return self.total - self.agreements - self.metadata


def _first_tensor(args) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a:
            found = _first_tensor(a)
            if found is not None:
                return found
    return None


@contextmanager
def count_collectives() -> Iterator[Calls]:
    from collgrad.backends import agreement, registry

    calls = Calls()
    cls = dist.ProcessGroup
    saved = {}
    exchange = agreement.exchange

    def tagged_exchange(*args, **kwargs):  # which of torch's calls serve an agreement, not data
        calls.in_agreement = True
        try:
            return exchange(*args, **kwargs)
        finally:
            calls.in_agreement = False

    agreement.exchange = registry.exchange = tagged_exchange
    for name in _METHODS:
        original = cls.__dict__.get(name)
        if original is None:
            continue
        saved[name] = original

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            first = _first_tensor(args)
            calls.log.append((_name, None if first is None else first.dtype, calls.in_agreement))
            return _original(self, *args, **kwargs)

        setattr(cls, name, wrapped)
    try:
        yield calls
    finally:
        agreement.exchange = registry.exchange = exchange
        for name, original in saved.items():
            setattr(cls, name, original)


@contextmanager
def count_planning() -> Iterator[Counter]:
    """Calls of the two planners inside the block: the gradient plan and the dispatcher's bucket plan."""
    from collgrad.core import planner
    from collgrad.state import call

    counts: Counter = Counter()
    targets = [(planner, "plan_buckets"), (call, "plan_grads")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name, original in saved:

        def wrapped(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, wrapped)
    try:
        yield counts
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@dataclass
class Io:
    """The I/O of a block on the safetensors files under one directory: positional writes and reads
    (``os.pwrite``, ``os.preadv``) and header reads (``open(path, "rb")``: one call of 8 + N bytes), the
    bytes each moved, and the files (by their final names: a write goes to a file's temporary, see
    collgrad.checkpoint.commit) that any of them touched. ``log``: (what, file, offset, bytes) per call,
    and ("hashed", file, 0, 0) per file a verified load hashes (not counted)."""

    calls: int = 0
    read: int = 0
    written: int = 0
    files: set[str] = field(default_factory=set)
    log: list[tuple[str, str, int, int]] = field(default_factory=list)
    hashing: bool = False

    def figures(self) -> dict[str, int]:
        """What the simulation reports of a job (collgrad.bench.simulate's ``Figures``), by its names."""
        return {
            "io_calls": self.calls,
            "bytes_read": self.read,
            "bytes_written": self.written,
            "files": len(self.files),
        }

    def _add(self, what: str, file: str, offset: int, nbytes: int) -> None:
        self.calls += 1
        if what == "pwrite":
            self.written += nbytes
        else:
            self.read += nbytes
        self.files.add(file)
        self.log.append((what, file, offset, nbytes))


def _safetensors(directory: str, path: object) -> str | None:
    """The final path of ``path`` where it names a safetensors file under ``directory`` (or its
    temporary, ``.NAME.safetensors<TEMPORARY>``), else None."""
    from collgrad.checkpoint.commit import TEMPORARY

    if not isinstance(path, (str, bytes, os.PathLike)):
        return None  # a file descriptor
    full = os.path.realpath(os.fsdecode(path))
    if not full.startswith(directory + os.sep):
        return None
    head, name = os.path.split(full)
    if name.startswith(".") and name.endswith(TEMPORARY):
        name = name[1 : -len(TEMPORARY)]
    return os.path.join(head, name) if name.endswith(".safetensors") else None


@contextmanager
def count_io(directory: str) -> Iterator[Io]:
    """The reads and writes of the safetensors files under ``directory`` inside the block (``Io``): every
    ``os.pwrite`` and ``os.preadv`` on a descriptor ``os.open`` gave for one of them (the bytes each call
    moved), every ``open(path, "rb")`` of one as a header read (one call of 8 + the length its first 8
    bytes give, read here from the file). A verified load's hashing (``collgrad.checkpoint.hashes.check``:
    the files mapped, not read) is left out, as the simulation leaves it out."""
    from collgrad.checkpoint import hashes

    io, root = Io(), os.path.realpath(directory)
    fds: dict[int, str] = {}
    saved = {"open": os.open, "close": os.close, "pwrite": os.pwrite, "preadv": os.preadv}
    opened, check = builtins.open, hashes.check

    def os_open(path, flags, *args, **kwargs):
        fd = saved["open"](path, flags, *args, **kwargs)
        found = _safetensors(root, path)
        if found is not None:
            fds[fd] = found
        return fd

    def os_close(fd):
        fds.pop(fd, None)
        return saved["close"](fd)

    def pwrite(fd, data, offset):
        done = saved["pwrite"](fd, data, offset)
        if fd in fds:
            io._add("pwrite", fds[fd], offset, done)
        return done

    def preadv(fd, buffers, offset, *args):
        done = saved["preadv"](fd, buffers, offset, *args)
        if fd in fds:
            io._add("preadv", fds[fd], offset, done)
        return done

    def builtin_open(file, mode="r", *args, **kwargs):
        found = _safetensors(root, file) if mode == "rb" else None
        if found is not None and io.hashing:
            io.log.append(("hashed", found, 0, 0))  # in the log, not counted
        elif found is not None:
            with opened(file, "rb") as f:
                first = f.read(8)
            length = int.from_bytes(first, "little") if len(first) == 8 else 0
            io._add("header", found, 0, len(first) + length)
        return opened(file, mode, *args, **kwargs)

    def hashing(*args, **kwargs):  # a verified load's hashing of mapped files: not counted
        io.hashing = True
        try:
            return check(*args, **kwargs)
        finally:
            io.hashing = False

    os.open, os.close, os.pwrite, os.preadv = os_open, os_close, pwrite, preadv
    builtins.open, hashes.check = builtin_open, hashing
    try:
        yield io
    finally:
        os.open, os.close, os.pwrite, os.preadv = saved["open"], saved["close"], saved["pwrite"], saved["preadv"]
        builtins.open, hashes.check = opened, check


def as_on_a_network_file_system() -> None:
    """This rank weighs its checkpoint I/O as on a network file system (``IoCosts``' call of 1 ms: small
    slices exchanged), though the tests' temporary directories lie on a local disk (where a call costs
    no more than an exchange's handling of a piece, and nothing is exchanged). For the tests of the
    exchanges: call it first in a rank's worker (a forked rank's environment is its own)."""
    from collgrad.checkpoint.plan import IoCosts

    os.environ["COLLGRAD_IO_CALL_SECONDS"] = repr(IoCosts().call_seconds)
