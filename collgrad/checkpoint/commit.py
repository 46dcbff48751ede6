"""The one commit of a checkpoint, and the one probe for a directory the ranks share.

    write     every file under a temporary name beside its final one (hidden, not ``*.safetensors``:
              no loader of the directory reads one), flushed to the disk (storage.py's ``finish``)
    commit    renamed into place in the order given, the one that makes the checkpoint last (a
              training state's manifest; a model's index); the directories flushed; then the files of
              earlier saves that this one does not name renamed aside and removed in the background
    discard   after a failure anywhere: every temporary removed, the previous checkpoint as it was

A file the commit replaces is linked aside first, so that freeing its blocks is not the caller's wait.
Files being removed carry ``STALE`` names (hidden, not ``*.safetensors``); a later commit removes any
that a process which ended first left behind. Local: the jobs agree between ranks around each step.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Callable, Iterable, Sequence

from collgrad.checkpoint import hashes
from collgrad.checkpoint.storage import Writer, remove_all

__all__ = [
    "temporary",
    "write_small",
    "commit",
    "discard",
    "probe",
    "sees",
    "unprobe",
    "remove_later",
    "STALE",
    "TEMPORARY",
]

#: What an earlier checkpoint's file is renamed (or linked) to before it is removed in the background.
STALE = ".collgrad-stale-"
#: How a file's temporary name ends (``temporary``).
TEMPORARY = ".collgrad-tmp"
#: What a rank writes into a directory to find out whether the others see it (``probe``).
PROBE = ".collgrad-probe-"


def temporary(final: str) -> str:
    """Where the file ``final`` (a path) is written until the commit: beside it, hidden, the same on
    every rank. Pure."""
    head, name = os.path.split(final)
    return os.path.join(head, f".{name}{TEMPORARY}")


def write_small(final: str, body: bytes) -> tuple[str, str]:
    """``body`` written to ``final``'s temporary and flushed to the disk (an index, a manifest); returns
    (temporary, final) for the commit. OSError where the disk refuses it."""
    path = temporary(final)
    with open(path, "wb") as f:
        f.write(body)
        f.flush()
        os.fdatasync(f.fileno())
    return path, final


def hash_file(writer: Writer, path: str, name: str) -> tuple[tuple[str, str], int] | None:
    """What ``writer`` wrote, hashed as it went out (hashes.py), flushed to the temporary of the hash file
    ``name`` in ``path``: ((temporary, final), the digest of its bytes); None where it wrote nothing or
    failed (an OSError kept in ``writer.error``). Local."""
    pieces = writer.hasher.pieces if writer.hasher is not None else []
    if writer.error is not None or not pieces:
        return None
    body = hashes.pieces_json(pieces)
    try:
        return write_small(os.path.join(path, name), body), hashes.digest(body)
    except OSError as error:
        writer.error = error
        return None


def told(hashed: tuple[tuple[str, str], int] | None) -> tuple[int, int]:
    """What a rank tells the write's agreement of its hash file (``hash_file``'s): whether it wrote one,
    and its digest as the agreement's int64 carries it (``recorded`` reads it back)."""
    if hashed is None:
        return (0, 0)
    value = hashed[1]
    return (1, value - (1 << 64) if value >= 1 << 63 else value)


def recorded(rows: Sequence[Sequence[int]], name_of: Callable[[int], str]) -> dict[str, int]:
    """Every rank's hash file (``name_of`` its index) and digest, from the write's agreement's rows (each
    ``[code, arguments, *told]``), for the manifest or record that lists them."""
    return {name_of(k): row[3] % (1 << 64) for k, row in enumerate(rows) if row[2]}


def commit(
    renames: Sequence[tuple[str, str]],
    sweep: Iterable[tuple[str, Callable[[str], bool]]],
    keep: Iterable[str] = (),
) -> None:
    """A written checkpoint put in place: each (temporary, final) of ``renames`` renamed over what was
    there, in order (the one that makes the checkpoint last), every directory they lie in flushed;
    then in each (directory, stale) of ``sweep`` the files that ``stale(name)`` calls an earlier save's
    and that are not this checkpoint's (a rename's final, or one of ``keep``: paths other ranks put in
    place), and any ``STALE`` file left, renamed aside now (a save right after may write a file of its
    name) and removed in the background. OSError where the file system refuses."""
    doomed: list[str] = []
    for path, final in renames:
        doomed += _linked_aside(final)
        os.replace(path, final)
    for directory in dict.fromkeys(os.path.dirname(final) for _, final in renames):
        _sync_directory(directory)
    kept = {os.path.abspath(final) for _, final in renames} | {os.path.abspath(path) for path in keep}
    for directory, stale in sweep:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if name.startswith(STALE):
                doomed.append(path)
            elif stale(name) and os.path.abspath(path) not in kept:
                aside = _stale_name(path)
                try:
                    os.rename(path, aside)
                except OSError:
                    continue
                doomed.append(aside)
    remove_later(doomed)


def discard(writer: Writer, renames: Sequence[tuple[str, str]]) -> None:
    """What a failed save wrote removed: every file ``writer`` opened, every small file's temporary (the
    previous checkpoint is left as it was). Local."""
    writer.remove()
    remove_all(path for path, _ in renames)


def _stale_name(path: str) -> str:
    """A name beside ``path`` for it while it waits to be removed (no loader of the directory reads it)."""
    head, name = os.path.split(path)
    return os.path.join(head, f"{STALE}{secrets.token_hex(4)}-{name}.removing")


def _linked_aside(final: str) -> list[str]:
    """A second name for the file at ``final`` (a hard link) where there is one, so that replacing it
    does not free its blocks in the caller's time; what to remove later. Nothing where there is no
    file, or the file system links none (the replace then frees them)."""
    aside = _stale_name(final)
    try:
        os.link(final, aside)
    except OSError:
        return []
    return [aside]


def _sync_directory(path: str) -> None:
    """The directory's entries (the renames) flushed to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_later(paths: list[str]) -> None:
    """``paths`` removed in a background thread: freeing a file's blocks costs ~10 ms a file, which is
    not the caller's wait; a non-daemon thread, so the interpreter finishes it before it exits."""
    if paths:
        threading.Thread(target=remove_all, args=(paths,), name="collgrad-remove-stale").start()


def probe(directory: str, rank: int) -> None:
    """This rank's probe file written into ``directory`` (made where it is not there yet): shows the
    directory takes a file here, and lets the others look for it (``sees``). OSError otherwise."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{PROBE}{rank}"), "wb") as f:
        f.write(b"0")


def sees(directory: str, ranks: Sequence[int], me: int) -> bool:
    """The probe file of the rank after ``me`` in ``ranks`` (after the last: the first) is there: this
    rank sees the directory that rank wrote into (call once every rank probed, e.g. after an agreement).
    Every rank asks it of its own next; the ranks share the directory where all say yes. Seeing one
    directory is the same for all ranks on one file system, so a ring of yeses joins them all, and ranks on
    two file systems have an edge between them that says no: one look a rank, not one per rank of the
    world."""
    after = ranks[(ranks.index(me) + 1) % len(ranks)]
    return os.path.exists(os.path.join(directory, f"{PROBE}{after}"))


def unprobe(directory: str, rank: int) -> None:
    """This rank's probe file removed (call once every rank has looked)."""
    remove_all([os.path.join(directory, f"{PROBE}{rank}")])
