"""The outcome of one phase of a call that writes or reads files, agreed by every rank: each rank tells
whether it failed (an errno, or 255 for any other error) and a hash of its arguments, in one small
all-gather over the model's group; then every rank raises together, or all go on. And a load's reads
together (``read_together``): what the ranks hold alike read once between them and gathered
(``gather_parts``); small pieces moved to the ranks that write them (``exchange_parts``): the
collectives that move checkpoint bytes between ranks.

    rank r:  [code, arguments]  ->  all-gather  ->  this rank failed?   its own error
                                                   another failed?     RankFailedError naming it
                                                   arguments differ?   ArgumentMismatchError
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, NamedTuple, Sequence, TypeVar, cast

import torch
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends import agreement
from collgrad.backends.waits import wait_work
from collgrad.checkpoint import storage
from collgrad.checkpoint.match import Opened, Reads, io_costs, memory, reads
from collgrad.checkpoint.safetensors import MetadataFiles, RecordedFiles, ReplayedFiles, metadata_from
from collgrad.core.dispatch import Dispatcher
from collgrad.errors import ArgumentMismatchError, CollgradError, InvalidArgumentError, RankFailedError

__all__ = [
    "agree_outcome",
    "Phases",
    "Tally",
    "gather_parts",
    "exchange_parts",
    "metadata_once",
    "Once",
    "deferred",
    "position",
    "read_together",
]

_T = TypeVar("_T")


def agree_outcome(
    group: ProcessGroup | None,
    me: int,
    error: BaseException | None,
    *,
    call: str,
    what: str,
    timeout_s: float,
    arguments: int = 0,
    compared: str = "arguments",
    extra: Sequence[int] = (),
) -> list[list[int]]:
    """Every rank of ``group`` learns whether any rank failed to ``what`` (and, with ``arguments``,
    whether every rank passed the same ``compared``): this rank raises its own failure (a CollgradError
    as it is, anything else wrapped in one naming ``call``), the others RankFailedError naming it.
    ``extra``: more of this rank's numbers for the others; returns every rank's row (its code, its
    ``arguments``, then its ``extra``) in the group's order, where none failed. Collective over
    ``group`` (None: this process alone)."""
    code = 0 if error is None else (getattr(error, "errno", None) or 255)
    rows = [[code, arguments, *extra]]
    ranks = [me]
    if group is not None:
        rows = agreement.exchange(group, [code, arguments, *extra], timeout_s=timeout_s, what=f"{call}: {what}")
        ranks = list(_compat.group_ranks(group))
    if error is not None:
        if isinstance(error, CollgradError):
            raise error
        raise CollgradError(f"rank {me}: {call} could not {what}: {error}") from error
    failed = [(r, row[0]) for r, row in zip(ranks, rows) if row[0]]
    if failed:
        rank, code = failed[0]
        cause = os.strerror(code) if code != 255 else "see that rank's error"
        raise RankFailedError(f"rank {rank} could not {what} ({cause}) [seen by rank {me}]")
    if len({row[1] for row in rows}) > 1:
        raise ArgumentMismatchError(
            f"ranks passed different {compared} to {call} [seen by rank {me}]: pass the same on every rank",
            ("arguments",),
        )
    return rows


class Phases(NamedTuple):
    """The phases of one call, each agreed by every rank of ``group`` with ``agree_outcome``: the call's
    name, what its ``arguments`` hash covers (named when they differ), this rank and the bounded wait."""

    group: ProcessGroup | None
    me: int
    call: str
    compared: str
    timeout_s: float

    def agree(
        self, error: BaseException | None, what: str, *, arguments: int = 0, extra: Sequence[int] = ()
    ) -> list[list[int]]:
        """Every rank learns whether any failed to ``what`` (``agree_outcome``); returns every rank's row."""
        return agree_outcome(
            self.group,
            self.me,
            error,
            call=self.call,
            what=what,
            timeout_s=self.timeout_s,
            arguments=arguments,
            compared=self.compared,
            extra=extra,
        )


@dataclass
class Tally:
    """The collectives that moved checkpoint bytes between ranks in one call (the gathers of what the ranks
    hold alike, the exchanges of small slices), and this rank's bytes into them."""

    collectives: int = 0
    bytes: int = 0


def gather_parts(dispatcher: Dispatcher, group: ProcessGroup, tally: Tally) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gather of what the ranks read alike (``storage.read_shared``'s): every rank's part (uint8, as
    long on every rank) gathered, rank-major, over ``group`` on a device its backend takes (the host's
    bytes moved there and back where it is an accelerator's only), with the dispatcher's buckets; the
    call is agreed already (no argument check). Counted in ``tally``. Collective over ``group``."""
    device = _compat.agreement_device(agreement.control_device_type(group))

    def gather(part: torch.Tensor) -> torch.Tensor:
        part = part.to(device)
        out = torch.empty(group.size() * part.numel(), dtype=torch.uint8, device=device)
        record = dispatcher.all_gather([out], [part], group, atomic=False, check=False)
        tally.collectives, tally.bytes = tally.collectives + record.collectives, tally.bytes + record.bytes
        return out.cpu()

    return gather


def exchange_parts(
    group: ProcessGroup, tally: Tally, timeout_s: float
) -> Callable[[torch.Tensor, Sequence[int], Sequence[int]], torch.Tensor]:
    """The all-to-all that moves small slices between the ranks that hold them and the ranks that write
    or read their tensors (``storage.write_exchanged``, ``read_exchanged``): this rank's bytes (uint8,
    ``sent[d]`` to rank d back to back) in, what every rank sent it (``received[s]`` from rank s) out,
    over ``group`` on a device its backend takes, waited for at most ``timeout_s`` (the dispatcher's
    bounded wait: CollgradTimeoutError naming it). Counted in ``tally``. Collective over ``group``."""
    device = _compat.agreement_device(agreement.control_device_type(group))

    def exchange(part: torch.Tensor, sent: Sequence[int], received: Sequence[int]) -> torch.Tensor:
        out = torch.empty(sum(received), dtype=torch.uint8, device=device)
        work = _compat.all_to_all(out, part.to(device), received, sent, group)
        ranks = _compat.group_ranks(group)
        wait_work(work, timeout_s, f"the exchange of small slices (an all_to_all of {part.numel()} bytes over {ranks})")
        tally.collectives, tally.bytes = tally.collectives + 1, tally.bytes + part.numel()
        return out.cpu()

    return exchange


class Once(Generic[_T]):
    """What ``metadata_once`` read on this rank (or ``deferred`` did): ``get()`` gives it, or raises what
    reading it raised (in the caller's own handling of this rank's errors, in its own order);
    ``bytes_read``: the bytes this rank read from the files for it (the first rank all of them, the
    others none)."""

    def __init__(self, value: _T | None, error: BaseException | None, bytes_read: int) -> None:
        self._value, self._error, self.bytes_read = value, error, bytes_read

    def get(self) -> _T:
        if self._error is not None:
            raise self._error
        return cast(_T, self._value)


def deferred(read: Callable[[], _T]) -> Once[_T]:
    """``read()`` done now (within ``metadata_once``'s read: its files recorded with the rest), what it
    raises kept for ``get``, where the caller meets it in its own order. Local."""
    try:
        return Once(read(), None, 0)
    except Exception as error:  # noqa: BLE001 - the caller's handling of this rank's errors gets it
        return Once(None, error, 0)


def metadata_once(
    group: ProcessGroup | None, me: int, timeout_s: float, read: Callable[[], _T], tally: Tally
) -> Once[_T]:
    """``read()``, a load's reading of a checkpoint's metadata (its index or manifest and every file's
    header), done by the group's first rank, its reads kept (``safetensors.RecordedFiles``) and broadcast,
    then done by every other rank on those bytes (``ReplayedFiles``): the directory's metadata read
    once, not once a rank, and every rank checking the same bytes itself (each reaches the same
    verdict). Where it pays, as for what the ranks hold alike (``IoCosts.shares``: from 12 ranks with
    the default costs, where the file system's bandwidth, shared by every rank, is the bound; below,
    each rank reads them itself, at once with the others, as one read and a broadcast cannot beat). The
    two broadcasts (the length, the bytes) counted in ``tally``. Collective over ``group`` where it
    pays (None: this rank alone reads): every rank of the load calls it, before anything that may fail
    alone; what ``read()`` raises is kept for ``Once.get``."""
    try:
        pays = group is not None and io_costs().shares(group.size())
    except InvalidArgumentError:  # a malformed cost: the load's plan raises it, on every rank together
        pays = False
    if group is None or not pays:
        return _done(read, MetadataFiles())
    first = _compat.group_ranks(group)[0]
    device = _compat.agreement_device(agreement.control_device_type(group))
    what = f"the checkpoint's metadata from rank {first} (a broadcast over {_compat.group_ranks(group)})"
    recorded = RecordedFiles() if me == first else None
    once = _done(read, recorded) if recorded is not None else None
    packed = recorded.packed() if recorded is not None else b""
    length = torch.tensor([len(packed)], dtype=torch.int64, device=device)
    wait_work(_compat.broadcast(length, first, group), timeout_s, what)
    if recorded is not None:
        moved = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(device)
    else:
        moved = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    wait_work(_compat.broadcast(moved, first, group), timeout_s, what)
    tally.collectives, tally.bytes = tally.collectives + 2, tally.bytes + 8 + moved.numel()
    if once is not None:
        return once
    return _done(read, ReplayedFiles(moved.cpu().numpy().tobytes()))


def _done(read: Callable[[], _T], files: MetadataFiles) -> Once[_T]:
    try:
        with metadata_from(files):
            return Once(read(), None, files.bytes_read)
    except Exception as error:  # noqa: BLE001 - the caller's handling of this rank's errors gets it
        return Once(None, error, files.bytes_read)


def position(group: ProcessGroup | None, me: int) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size (None: this process alone)."""
    if group is None:
        return 0, 1
    ranks = list(_compat.group_ranks(group))
    return ranks.index(me), len(ranks)


def read_together(
    sources: Sequence[Opened],
    buffers: Sequence[tuple[str, torch.Tensor]],
    planned: Reads,
    dispatcher: Dispatcher,
    group: ProcessGroup | None,
    tally: Tally,
) -> tuple[int, BaseException | None]:
    """A load's reads (match.planned_reads): this rank's own (storage.read), its small slices read by the
    ranks whose turn their tensors are and exchanged (storage.read_exchanged), then what the ranks of
    ``group`` hold alike, each its turn, gathered (storage.read_shared). Collective over ``group`` where
    anything is exchanged or shared: every rank calls it after the load's check agreed, whatever its
    own reads did. Returns the bytes read and the first error (for the caller's agreement); the
    collectives that moved bytes are counted in ``tally``."""
    bytes_read, error = storage.read(reads(sources, buffers, planned))
    if not planned.shared and not planned.exchanged:
        return bytes_read, error
    assert group is not None, "nothing is shared or exchanged without a group"
    into = memory(sources, buffers, loading=True)
    kept = sources[0].source.scratch  # where the places go, kept with the plan (as storage.load_plan)
    if planned.exchanged:  # small slices: each rank reads its turn of the tensors, the holders get theirs
        exchange = exchange_parts(group, tally, dispatcher.timeout)
        more, late = storage.read_exchanged(planned.exchanged, into, exchange, kept, planned.key)
        bytes_read, error = bytes_read + more, error or late
    if planned.shared:
        gather = gather_parts(dispatcher, group, tally)
        turn = planned.from_turn
        more, late = storage.read_shared(planned.shared, planned.position, into, gather, turn, kept, planned.key)
        bytes_read, error = bytes_read + more, error or late
    return bytes_read, error
