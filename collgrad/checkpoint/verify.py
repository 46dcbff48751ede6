"""``collgrad verify DIR`` and the check a load makes before it changes anything: a training state's
bytes against the hashes its save recorded (hashes.py).

    verify   the manifest (its own digest), every hash file (the manifest's digest of it), every file the
             manifest names there in full (the pieces cover each byte once, up to its size), and every
             piece read once and hashed, several files at a time; of a ``save_full_model`` directory
             the same with its record (hashes.RECORD_NAME) for the manifest, every file its index names
    a load   the pieces that overlap what this rank reads, read and hashed before anything is written
             into the model: at most a block beyond each range it reads, either side

Local: no process group (a load agrees on the verdict itself). Files are untrusted: nothing here
trusts a size, a name or an offset before it is checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from collgrad.checkpoint import hashes
from collgrad.checkpoint.manifest import MANIFEST_NAME, Manifest, manifest_path, read_manifest
from collgrad.checkpoint.plan import ReadItem
from collgrad.checkpoint.safetensors import model_files, refused
from collgrad.errors import CheckpointError

__all__ = [
    "Verified",
    "verify_directory",
    "recorded_pieces",
    "record_pieces",
    "check_reads",
    "differing",
    "differs",
]


@dataclass(frozen=True)
class Verified:
    """What ``verify_directory`` found: the directory, the files it checked, the bytes it read and
    hashed, and each problem (naming its file); intact where there is none."""

    directory: str
    files: tuple[str, ...]
    bytes: int
    problems: tuple[str, ...]

    @property
    def intact(self) -> bool:
        return not self.problems


def recorded_pieces(path: str, manifest: Manifest) -> list[hashes.Piece]:
    """Every piece the save recorded, each hash file checked against the manifest's digest of it and
    naming only the manifest's files; CheckpointError (naming the file) otherwise, or where the save
    recorded no hashes."""
    where = manifest_path(path)
    if manifest.hashes is None:
        raise refused(where, "records no content hashes (a save of an earlier collgrad): pass verify=False")
    known = set(manifest.files())
    out = []
    for name, value in manifest.hashes.items():
        found = hashes.read_pieces(path, name, value, where)
        strange = sorted({p.file for p in found} - known)
        if strange:
            raise refused(os.path.join(path, name), f"hashes {strange[:3]}, which the manifest does not name")
        out += found
    return out


def record_pieces(path: str) -> list[hashes.Piece] | None:
    """Every piece a ``save_full_model`` directory records (its record and hash files checked, naming
    only its own safetensors files); None where it records none. CheckpointError naming the file."""
    named = hashes.read_record(path)
    if named is None:
        return None
    out = []
    for name, value in named.items():
        found = hashes.read_pieces(path, name, value, os.path.join(path, hashes.RECORD_NAME))
        strange = sorted({p.file for p in found if not p.file.endswith(".safetensors") or "/" in p.file})
        if strange:
            raise refused(os.path.join(path, name), f"hashes {strange[:3]}, which are not files of this directory")
        out += found
    return out


def verify_directory(directory: str | os.PathLike[str], threads: int = 4) -> Verified:
    """Every byte of the checkpoint in ``directory`` (a training state, or a ``save_full_model``
    directory: its record of hashes) against the hashes its save recorded; a manifest or record that
    cannot be read or checked is a problem too (never raised). Local."""
    path = os.fspath(directory)
    full_model = not os.path.isfile(manifest_path(path)) and os.path.isfile(os.path.join(path, hashes.RECORD_NAME))
    try:
        if full_model:
            files = model_files(path)
            pieces = record_pieces(path) or []
        else:
            manifest = read_manifest(path)
            files = manifest.files()
            pieces = recorded_pieces(path, manifest)
    except CheckpointError as error:
        return Verified(path, (hashes.RECORD_NAME if full_model else MANIFEST_NAME,), 0, (str(error),))
    coverage = hashes.Coverage(pieces)
    problems: list[str] = []
    for file in files:
        try:
            size = os.path.getsize(os.path.join(path, file))
        except OSError:
            problems.append(f"{os.path.join(path, file)}: missing (the manifest names it)")
            continue
        gaps = coverage.gaps(file, size)
        if gaps:
            problems.append(
                f"{os.path.join(path, file)}: {size} bytes, and the recorded hashes cover other bytes "
                f"(first difference at bytes {gaps[0][0]}-{gaps[0][1]}): truncated, extended or not this save's"
            )
    bad = hashes.check(path, [p for p in pieces if not any(p.file in q for q in problems)], threads)
    problems += [f"{os.path.join(path, file)}: its bytes do not hash to what the save recorded" for file in bad]
    read = sum(p.length for p in pieces)
    return Verified(path, tuple(files), read, tuple(problems))


def check_reads(path: str, pieces: Sequence[hashes.Piece], items: Iterable[ReadItem]) -> list[str]:
    """The files whose pieces overlapping ``items`` (a load's reads on this rank, their files as resolved
    inside ``path``) do not hash to what was recorded, or that no piece covers, each once: those pieces
    read and hashed (the load then reads its ranges from the page cache). Local."""
    coverage = hashes.Coverage(pieces)
    root = os.path.realpath(path)
    wanted: dict[tuple[str, int], hashes.Piece] = {}
    uncovered: list[str] = []
    names: dict[str, str] = {}  # each file's name in the checkpoint, worked out once (relpath is slow)
    for item in items:
        file = names.get(item.file)
        if file is None:
            file = names[item.file] = os.path.relpath(item.file, root)
        size, ranges = item.dtype.itemsize, item.ranges
        for first, _ in ranges.runs():
            offset, length = item.offset + (first - ranges.start) * size, ranges.length * size
            found = coverage.overlapping(file, offset, length)
            if sum(min(p.offset + p.length, offset + length) - max(p.offset, offset) for p in found) != length:
                uncovered.append(file)
            wanted.update(((p.file, p.offset), p) for p in found)
    # one file at a time: a load runs on every rank of the node at once already
    return list(dict.fromkeys([*uncovered, *hashes.check(path, list(wanted.values()), threads=1)]))


def differing(path: str, pieces: Sequence[hashes.Piece], files: Sequence[str], items: Iterable[ReadItem]) -> int:
    """What this rank tells the others of its reads (``items``) against ``pieces``: 0 where they match,
    else 1 + the index of the first file that differs among ``files`` (the checkpoint's, relative to
    ``path``, sorted: the same list on every rank, which agree on the number). Local."""
    bad = check_reads(path, pieces, items)
    return 1 + files.index(bad[0]) if bad else 0


def differs(path: str, files: Sequence[str], told: Sequence[int]) -> CheckpointError:
    """What every rank raises where the ranks told (``told``: ``differing``'s, those not 0) that files
    differ: the first named, the others listed."""
    named = [os.path.join(path, files[k - 1]) for k in sorted(set(told))]
    others = f" (and {', '.join(named[1:])})" if named[1:] else ""
    return refused(
        named[0],
        f"does not hash to what its save recorded{others}: it changed or was cut since; nothing was loaded "
        "(python -m collgrad verify names every such file)",
    )
