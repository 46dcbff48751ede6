"""The registry's decision, pure: every rank's findings (one int64 row each, in group-rank order) ->
the group's immutable Capabilities. No process group, no I/O: every rank runs it on the same rows and
so reaches the same decision, or raises the same error.

    row   [ header (format, device, backend, size, rank, policy ok, MPI state) | per (op, primitive,
            dtype): reason, max elements ]
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from collgrad.backends.base import DTYPES, UNLIMITED, LocalFinding, Reason
from collgrad.backends.ops import Op, Primitive
from collgrad.errors import AgreementError, PolicyError

__all__ = [
    "FORMAT",
    "HEADER",
    "KEYS",
    "Capabilities",
    "Choice",
    "PrimitiveStatus",
    "code",
    "decide",
    "encode",
    "preference",
]

FORMAT = 2  # bump when the agreement vector changes: ranks on different collgrad versions then fail together


def preference(device_type: str) -> tuple[Primitive, ...]:
    """Best first. On CPU, MPI's shared-memory Allreduce beat Gloo's TCP ring (notes, table 6); on
    accelerators the group's own backend (NCCL/XCCL) comes before a CUDA-aware MPI. A packed flat
    buffer comes before the backend's coalesced call: for Gloo it is the same work without the
    internal flatten, and it is what the ZeRO planner fills directly."""
    if device_type == "cpu":
        return (Primitive.MPI4PY, Primitive.FLAT, Primitive.COALESCED, Primitive.PER_TENSOR)
    return (Primitive.FLAT, Primitive.COALESCED, Primitive.MPI4PY, Primitive.PER_TENSOR)


#: Low-precision dtypes that may travel as float32 when no primitive reduces them natively.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def code(text: str | None) -> int:
    """A name (device type, backend) as the number that travels in the agreement row (0 for none)."""
    return zlib.crc32((text or "").encode()) if text else 0


# --- the agreement vector ---------------------------------------------------------------------------
HEADER = (
    "format",
    "device",
    "backend",
    "size",
    "rank",
    "policy_ok",
    "mpi_reason",
    "mpi_rank",
    "mpi_size",
    "mpi_token",
    "strided_gather",
)
KEYS = tuple((op, prim, dtype) for op in Op for prim in Primitive for dtype in DTYPES)


def encode(header: Mapping[str, int], findings: Mapping[tuple[Op, Primitive, torch.dtype], LocalFinding]) -> list[int]:
    row = [int(header[name]) for name in HEADER]
    for key in KEYS:
        found = findings[key]
        row += [int(found.reason), int(found.max_elements)]
    return row


@dataclass(frozen=True)
class PrimitiveStatus:
    """The group's view of one primitive for one (op, dtype)."""

    op: Op
    primitive: Primitive
    dtype: torch.dtype
    backend: str
    max_elements: int
    missing: tuple[tuple[int, Reason], ...]  # (global rank, why) for every rank that cannot use it

    @property
    def ok(self) -> bool:
        return not self.missing

    def why_not(self) -> str:
        if self.ok:
            return "available"
        by_reason: dict[Reason, list[int]] = {}
        for rank, reason in self.missing:
            by_reason.setdefault(reason, []).append(rank)
        return "; ".join(f"{r.describe()} (rank {', '.join(map(str, ranks))})" for r, ranks in by_reason.items())


@dataclass(frozen=True)
class Choice:
    """The agreed way to carry one (op, dtype) on this group and device type."""

    op: Op
    dtype: torch.dtype
    primitive: Primitive | None  # None: nothing can carry it
    backend: str
    wire_dtype: torch.dtype
    max_elements: int
    passed_over: tuple[PrimitiveStatus, ...]  # better primitives that were not available, and why

    def why(self) -> str:
        parts = [f"{s.primitive.value}: {s.why_not()}" for s in self.passed_over]
        if self.primitive is not None and self.wire_dtype != self.dtype:
            parts.append(f"{self.dtype} travels as {self.wire_dtype}: no primitive reduces it natively")
        return "; ".join(parts) if parts else "first choice"


@dataclass(frozen=True)
class Capabilities:
    """Immutable, agreed by every rank of ``group_ranks`` for tensors of ``device_type``."""

    group_ranks: tuple[int, ...]
    device_type: str
    backend: str
    statuses: tuple[PrimitiveStatus, ...]
    choices: tuple[Choice, ...]
    #: Every rank's backend lays a coalesced all-gather out into strided outputs itself (see
    #: ``backends.gloo.copies_gathers_out_strided``): agreed, so every rank gathers the same way.
    lays_out_strided: bool = False

    def choice(self, op: Op, dtype: torch.dtype) -> Choice:
        for choice in self.choices:
            if choice.op is op and choice.dtype == dtype:
                return choice
        # dtypes outside the table (complex, bool, ...): the group's backend, one call per tensor.
        return Choice(op, dtype, Primitive.PER_TENSOR, self.backend, dtype, UNLIMITED, ())

    def strided_gather(self, dtype: torch.dtype) -> bool:
        """Whether an all-gather of ``dtype`` may hand the group's coalesced primitive strided views as
        outputs, which the backend then fills in place (a rank-major gather laid out in the copy the
        backend makes anyway): every rank's backend does so and the coalesced primitive is allowed."""
        return self.lays_out_strided and self.status(Op.ALL_GATHER, Primitive.COALESCED, dtype).ok

    def status(self, op: Op, primitive: Primitive, dtype: torch.dtype) -> PrimitiveStatus:
        for s in self.statuses:
            if (s.op, s.primitive, s.dtype) == (op, primitive, dtype):
                return s
        raise KeyError((op, primitive, dtype))


def decide(
    rows: Sequence[Sequence[int]],
    device_type: str,
    backend: str,
    group_ranks: Sequence[int],
    *,
    mpi_verified: bool = True,
) -> Capabilities:
    """Pure: every rank's agreement row (in group-rank order) -> the group's Capabilities.

    Raises AgreementError or PolicyError; since every rank calls it with the same rows, every rank
    raises the same error.
    """
    header = [dict(zip(HEADER, row[: len(HEADER)])) for row in rows]
    for field in ("format", "device", "backend", "size"):
        values = [h[field] for h in header]
        if len(set(values)) != 1:
            raise AgreementError(
                f"ranks of group {list(group_ranks)} disagree on {field} ({values}) for {device_type} tensors: "
                "every rank must run the same collgrad version, with the same backend, and pass tensors "
                "of the same device types in the same order"
            )
    bad_policy = [group_ranks[r] for r, h in enumerate(header) if not h["policy_ok"]]
    if bad_policy:
        raise PolicyError(
            f"the force/forbid override is invalid on rank(s) {bad_policy} of group {list(group_ranks)}: "
            "fix COLLGRAD_FORCE/COLLGRAD_FORBID there (that rank's own error names the bad value)"
        )
    mapped = mpi_verified and _mpi_mapping_ok(header)
    base = len(HEADER)
    statuses = []
    for k, (op, prim, dtype) in enumerate(KEYS):
        reasons = [Reason(row[base + 2 * k]) for row in rows]
        limits = [row[base + 2 * k + 1] for row in rows]
        missing = tuple((group_ranks[r], why) for r, why in enumerate(reasons) if why is not Reason.OK)
        if prim is Primitive.MPI4PY and not missing and not mapped:
            missing = tuple((r, Reason.RANK_MAPPING) for r in group_ranks)
        served = "mpi4py" if prim is Primitive.MPI4PY else backend
        statuses.append(PrimitiveStatus(op, prim, dtype, served, min(limits), missing))
    table = {(s.op, s.primitive, s.dtype): s for s in statuses}
    choices = []
    order = preference(device_type)
    for op in Op:
        for dtype in DTYPES:
            choices.append(_choose(table, order, op, dtype, backend))
    strided = all(h["strided_gather"] for h in header)
    return Capabilities(tuple(group_ranks), device_type, backend, tuple(statuses), tuple(choices), strided)


def _choose(
    table: Mapping[tuple[Op, Primitive, torch.dtype], PrimitiveStatus],
    order: Sequence[Primitive],
    op: Op,
    dtype: torch.dtype,
    backend: str,
) -> Choice:
    passed: list[PrimitiveStatus] = []
    for prim in order:
        status = table[(op, prim, dtype)]
        if status.ok:
            return Choice(op, dtype, prim, status.backend, dtype, status.max_elements, tuple(passed))
        passed.append(status)
    wire = _UPCAST.get(dtype)
    if wire is not None:
        for prim in order:
            status = table[(op, prim, wire)]
            if prim.packs and status.ok:
                return Choice(op, dtype, prim, status.backend, wire, status.max_elements, tuple(passed))
    return Choice(op, dtype, None, backend, dtype, 0, tuple(passed))


def _mpi_mapping_ok(header: Sequence[Mapping[str, int]]) -> bool:
    """Torch ranks map onto one MPI job: distinct MPI ranks, one MPI job size, one job token."""
    if any(h["mpi_reason"] != Reason.OK for h in header):
        return False
    ranks = [h["mpi_rank"] for h in header]
    return (
        len(set(ranks)) == len(ranks)
        and len({h["mpi_size"] for h in header}) == 1
        and len({h["mpi_token"] for h in header}) == 1
        and header[0]["mpi_token"] != 0
    )
