"""Content hashes of a checkpoint's files, taken while the bytes are written (no second read), and their
check: by ``collgrad verify`` (every byte of every file), and by a load (the pieces each rank reads).

    a rank's write of bytes [a, b) of file f       ->  pieces: [a, b) cut at every BLOCK boundary of f,
                                                       each (f, offset, length, XXH3-64 of its bytes)
    training_state/hashes-<gen>-<rank>.json         each writing rank's pieces (the headers included)
    manifest.json "hashes": {"algorithm", "block",  every hash file and the XXH3-64 of its bytes; the
                   "files": {name: hex}, "digest"}  manifest's own digest over the rest of it
    save_full_model's directory (a model directory, no manifest):
    model.safetensors.hashes-<rank>.json            each writing rank's pieces
    model.safetensors.hashes.json                   the record: {"hashes": as above, "digest"}

XXH3-64 (``xxhash``): non-cryptographic, ~8 GB/s a core on the 2-vCPU VM (25 on a recent core), and it
releases the GIL, so the pieces of a large file hash in parallel threads. A piece never crosses a
BLOCK boundary of its file, so a rank that reads a range checks it by reading at most the pieces that
overlap it: within one BLOCK either side (less where the writer's own range ends sooner). Pure but for
reading the files it checks; no process group.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import xxhash

from collgrad.checkpoint.safetensors import metadata_files, refused

__all__ = [
    "ALGORITHM",
    "BLOCK",
    "Piece",
    "Hasher",
    "digest",
    "hash_file_name",
    "pieces_json",
    "read_pieces",
    "Coverage",
    "check",
]

ALGORITHM = "xxh3_64"
#: Pieces end at every BLOCK boundary of their file: the most a load reads beyond a range, either side.
BLOCK = 4 << 20
_HASH_FILE = re.compile(r"^(training_state/hashes-[0-9a-f]+-|model\.safetensors\.hashes-)\d{5,}\.json$")
#: the record of a ``save_full_model`` directory's hash files (its manifest's ``hashes``)
RECORD_NAME = "model.safetensors.hashes.json"


def digest(data: bytes | memoryview) -> int:
    """The XXH3-64 of ``data``."""
    return int(xxhash.xxh3_64_intdigest(data))


def hash_file_name(generation: str | None, rank: int) -> str:
    """A writing rank's hash file in a training state of ``generation`` (None: a ``save_full_model``
    directory's), relative to its directory."""
    if generation is None:
        return f"model.safetensors.hashes-{rank:05d}.json"
    return f"training_state/hashes-{generation}-{rank:05d}.json"


def canonical(document: Mapping[str, Any]) -> bytes:
    """A document's JSON as written and as its digest covers it: compact (json's C encoder serves only
    documents without indentation), keys sorted."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def listed(named: Mapping[str, int]) -> dict[str, Any]:
    """The ``hashes`` entry of a manifest or record: every hash file and the digest of its bytes."""
    files = {name: f"{value:016x}" for name, value in named.items()}
    return {"algorithm": ALGORITHM, "block": BLOCK, "files": files}


def signed(document: dict[str, Any]) -> bytes:
    """``document`` with its own ``digest`` over the rest of it, as written."""
    document["digest"] = f"{digest(canonical(document)):016x}"
    return canonical(document) + b"\n"


def checked_digest(document: Mapping[str, Any], where: str) -> bool:
    """Whether ``document`` records a digest (False: written without one); CheckpointError naming
    ``where`` where the rest of it does not hash to it."""
    found = document.get("digest")
    if found is None:
        return False
    rest = {k: v for k, v in document.items() if k != "digest"}
    if not isinstance(found, str) or found != f"{digest(canonical(rest)):016x}":
        raise refused(where, "does not hash to the digest it records: it changed after it was written")
    return True


def read_listed(found: Any, where: str) -> dict[str, int]:
    """A ``hashes`` entry (``listed``) read back: each hash file's name (checked) and digest;
    CheckpointError naming ``where`` for anything else."""
    if not isinstance(found, dict) or found.get("algorithm") != ALGORITHM or found.get("block") != BLOCK:
        raise refused(where, f"its hashes are not {ALGORITHM} in blocks of {BLOCK}")
    files = found.get("files")
    if not isinstance(files, dict):
        raise refused(where, "lists no hash files")
    out = {}
    for name, value in files.items():
        if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{16}", value):
            raise refused(where, f"records the digest {value!r} of {name}")
        out[hash_file(name, where)] = int(value, 16)
    return out


def record_json(named: Mapping[str, int]) -> bytes:
    """A ``save_full_model`` directory's record (``RECORD_NAME``) of its hash files."""
    return signed({"hashes": listed(named)})


def read_record(path: str) -> dict[str, int] | None:
    """The hash files a ``save_full_model`` directory records and their digests, checked; None where it
    records none (a ``save_pretrained`` directory, one file). CheckpointError naming the record else."""
    where = os.path.join(path, RECORD_NAME)
    if not os.path.lexists(where):
        return None
    document = _parsed(where, _read(where))
    if not isinstance(document, dict) or not checked_digest(document, where):
        raise refused(where, "is not a record of hash files with its own digest")
    return read_listed(document.get("hashes"), where)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of ``file`` (relative to the checkpoint's directory) hash to
    ``value``."""

    file: str
    offset: int
    length: int
    value: int


class Hasher:
    """The pieces of what one rank writes, hashed as the bytes go out: ``add`` each write (the file by
    the path it is written to; ``names`` gives each path's name in the checkpoint)."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self._names = names
        self.pieces: list[Piece] = []

    def add(self, path: str, offset: int, data: memoryview) -> None:
        name = self._names.get(path)
        if name is None:  # not a file of the checkpoint (none is written that is not one)
            return
        done = 0
        while done < len(data):
            at = offset + done
            length = min(len(data) - done, BLOCK - at % BLOCK)
            self.pieces.append(Piece(name, at, length, digest(data[done : done + length])))
            done += length


def pieces_json(pieces: Iterable[Piece]) -> bytes:
    """A hash file's bytes: the pieces by file, each ``[offset, length, hex]``."""
    by_file: dict[str, list[list[Any]]] = {}
    for p in pieces:
        by_file.setdefault(p.file, []).append([p.offset, p.length, f"{p.value:016x}"])
    document = {"algorithm": ALGORITHM, "block": BLOCK, "pieces": by_file}
    return (json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n").encode()


class Coverage:
    """Every piece of a checkpoint, by file, sorted by offset: what covers which bytes."""

    def __init__(self, pieces: Iterable[Piece]) -> None:
        self.by_file: dict[str, list[Piece]] = {}
        for p in pieces:
            self.by_file.setdefault(p.file, []).append(p)
        for listed in self.by_file.values():
            listed.sort(key=lambda p: p.offset)
        self._starts = {f: [p.offset for p in listed] for f, listed in self.by_file.items()}

    def overlapping(self, file: str, offset: int, length: int) -> list[Piece]:
        """The pieces of ``file`` that hold any of bytes ``[offset, offset + length)``."""
        listed = self.by_file.get(file, [])
        starts = self._starts.get(file, [])
        k = max(0, bisect.bisect_right(starts, offset) - 1)
        out = []
        while k < len(listed) and listed[k].offset < offset + length:
            if listed[k].offset + listed[k].length > offset:
                out.append(listed[k])
            k += 1
        return out

    def gaps(self, file: str, size: int) -> list[tuple[int, int]]:
        """The byte ranges of ``file`` (``size`` bytes) no piece covers, or that two cover."""
        out, at = [], 0
        for p in self.by_file.get(file, []):
            if p.offset != at:
                out.append((min(at, p.offset), max(at, p.offset)))
            at = max(at, p.offset + p.length)
        if at != size:
            out.append((min(at, size), max(at, size)))
        return out


def read_pieces(path: str, name: str, expected: int, where: str) -> list[Piece]:
    """A hash file's pieces (the file ``name`` in the checkpoint at ``path``), checked: its bytes hash
    to ``expected`` (the manifest's), every field of the right type, every file a name the caller
    checks. CheckpointError naming ``where`` otherwise."""
    data = _read(os.path.join(path, name))
    if digest(data) != expected:
        raise refused(os.path.join(path, name), "does not hash to what the manifest records: it changed")
    document = _parsed(os.path.join(path, name), data)
    if not isinstance(document, dict) or document.get("algorithm") != ALGORITHM or document.get("block") != BLOCK:
        raise refused(os.path.join(path, name), f"is not a hash file of {ALGORITHM} in blocks of {BLOCK}")
    found = document.get("pieces")
    if not isinstance(found, dict):
        raise refused(os.path.join(path, name), "holds no pieces by file")
    out = []
    for file, listed in found.items():
        if not isinstance(file, str) or not isinstance(listed, list):
            raise refused(os.path.join(path, name), f"lists the pieces of {file!r} wrongly")
        for entry in listed:
            ok = isinstance(entry, list) and len(entry) == 3 and all(type(v) is int and v >= 0 for v in entry[:2])
            if not ok or not isinstance(entry[2], str) or not re.fullmatch(r"[0-9a-f]{16}", entry[2]):
                raise refused(os.path.join(path, name), f"holds the piece {str(entry)[:60]} of {file}")
            if entry[1] == 0 or entry[1] > BLOCK or entry[0] // BLOCK != (entry[0] + entry[1] - 1) // BLOCK:
                raise refused(os.path.join(path, name), f"holds a piece of {file} that is not inside one block")
            out.append(Piece(file, entry[0], entry[1], int(entry[2], 16)))
    return out


def check(path: str, pieces: Sequence[Piece], threads: int = 4) -> list[str]:
    """The files (relative to ``path``) whose bytes do not hash to ``pieces``' (or cannot be read in
    full), each once, in order: every piece read and hashed, several files at a time (XXH3 and ``pread``
    release the GIL). Local."""
    by_file: dict[str, list[Piece]] = {}
    for p in pieces:
        by_file.setdefault(p.file, []).append(p)

    def bad(file: str) -> bool:
        try:
            with open(os.path.join(path, file), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                ordered = sorted(by_file[file], key=lambda p: p.offset)
                if any(p.offset + p.length > size for p in ordered):
                    return True  # short: never mapped past its end (a read there would fault)
                if not size:
                    return any(p.value != digest(b"") for p in ordered)
                # hashed where the page cache holds the bytes: mapped, not copied out (a copy per piece
                # cost as much as the load's own read)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        return any(digest(view[p.offset : p.offset + p.length]) != p.value for p in ordered)
                    finally:
                        view.release()
        except (OSError, ValueError):
            return True

    files = list(by_file)
    if threads <= 1 or len(files) <= 1:  # no pool to start (a thread costs ~4 ms to start here)
        return [f for f in files if bad(f)]
    with ThreadPoolExecutor(max_workers=min(threads, len(files))) as pool:
        flags = list(pool.map(bad, files))
    return [f for f, b in zip(files, flags) if b]


def hash_file(name: Any, where: str) -> str:
    """``name`` if it is a hash file's name (``training_state/hashes-<gen>-<rank>.json``); CheckpointError
    naming ``where`` otherwise."""
    if not isinstance(name, str) or not _HASH_FILE.match(name):
        raise refused(where, f"names the hash file {name!r}, which is not a plain hash file name")
    return name


def _read(where: str) -> bytes:
    """The bytes of the small file ``where`` (a hash file or record: at most ``MAX_JSON_BYTES``), read
    through ``safetensors.metadata_files()`` (a load's group reads them once); CheckpointError naming it
    where it cannot be read or is larger."""
    try:
        return metadata_files().whole(where)
    except OSError as error:
        raise refused(where, f"cannot be read ({error.strerror or error})") from None


def _parsed(where: str, data: bytes) -> Any:
    """``data`` (the file ``where``'s) as JSON; CheckpointError naming the file where it is not."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise refused(where, f"is not valid JSON ({error})") from None
