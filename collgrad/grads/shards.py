"""Safetensors shards written as tensors stream in: the file format, and which rank writes which shard.

A shard fills in the order tensors arrive until the next one would take it past ``max_shard_bytes``
(a tensor larger than that is a shard by itself), as Hugging Face's ``save_pretrained`` cuts them. Every
rank follows the same arrival order and sizes, so every rank knows every cut without communicating;
shard ``k`` is written by ``ranks[k % len(ranks)]``, the only rank that keeps its tensors. A shard is
written under a temporary name and renamed to its final one only once every rank has written all of
its own (see save.py), so a failure never leaves a half-written shard under a final name.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}`` padded with spaces to 8 bytes,
then the tensors' bytes back to back in header order.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import torch

from collgrad import _compat
from collgrad.errors import InvalidArgumentError

__all__ = ["ShardWriter", "write_safetensors", "shard_name", "SAFE_DTYPES"]

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


def shard_name(index: int, count: int) -> str:
    """The file name ``save_pretrained`` gives shard ``index`` (0-based) of ``count``."""
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """``tensors`` written to ``path`` in the safetensors format, flushed to the disk; returns the bytes
    of tensor data. Raises OSError as the file system does."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFE_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in tensors:
            if t.numel():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return offset


@dataclass
class ShardWriter:
    """Cuts the arriving tensors into shards and writes this rank's: ``add`` each tensor in arrival order
    (every rank, the same order), ``finish`` at the end. A write that fails is kept in ``error`` (and
    the rest of this rank's shards skipped), never raised: the caller must go on taking part in the
    stream's collectives and tell the others."""

    directory: str
    max_shard_bytes: int
    ranks: tuple[int, ...]
    rank: int
    #: (shard index, temporary path) of each shard this rank wrote
    written: list[tuple[int, str]] = field(default_factory=list)
    #: every tensor's shard index, and every shard's bytes (known on every rank)
    shard_of: dict[str, int] = field(default_factory=dict)
    shard_bytes: list[int] = field(default_factory=list)
    error: OSError | None = None
    _held: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_shard_bytes < 1:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: max_shard_bytes must be positive, got {self.max_shard_bytes}"
            )

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if tensor.dtype not in SAFE_DTYPES:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {name} is {tensor.dtype}, which safetensors cannot hold"
            )
        if not self.shard_bytes or (self.shard_bytes[-1] and self.shard_bytes[-1] + size > self.max_shard_bytes):
            self._flush()
            self.shard_bytes.append(0)
        self.shard_of[name] = len(self.shard_bytes) - 1
        self.shard_bytes[-1] += size
        if self._mine(len(self.shard_bytes) - 1):
            held = tensor.detach().to("cpu")
            if held.untyped_storage().nbytes() > size:  # a view of a bucket: keep this tensor, not the bucket
                held = held.clone()
            self._held.append((name, held))

    def finish(self) -> None:
        self._flush()

    def _mine(self, index: int) -> bool:
        return self.ranks[index % len(self.ranks)] == self.rank

    def _flush(self) -> None:
        held, self._held = self._held, []
        if not held or self.error is not None:
            return
        index = len(self.shard_bytes) - 1
        path = os.path.join(self.directory, f".collgrad-shard-{index}.tmp")
        try:
            write_safetensors(path, held, {"format": "pt"})
        except OSError as error:
            self.error = error
            _remove(path)
            return
        self.written.append((index, path))

    def discard(self) -> None:
        """Remove every temporary file this rank wrote (after a failure anywhere)."""
        for _, path in self.written:
            _remove(path)
        self.written.clear()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
