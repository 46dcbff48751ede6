"""Per-group capabilities: what each rank finds, how the group agrees, and the cached decision.

For one (process group, device type) every rank works out, alone, which primitive can carry which
(op, dtype) and up to which size (``local findings``: installed packages, the group's backend for the
device, the torch version, overrides, MPI state). The findings are packed into a short int64 vector
and exchanged with one ``all_gather`` on the group, so every rank holds every rank's findings and
runs the same pure ``decide`` on the same data: the decision cannot differ between ranks. Errors
found this way (an invalid override on one rank, ranks on different backends) are raised by every
rank together. The result is an immutable ``Capabilities`` cached per group.
"""

from __future__ import annotations

import importlib.util
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.core.agreement import exchange
from collgrad.core.waits import timeout_from_env
from collgrad.backends import ccl, gloo, mpi, nccl
from collgrad.core.ops import Op, Primitive
from collgrad.backends.base import DTYPES, UNLIMITED, LocalFinding, Reason
from collgrad.backends.policy import Policy
from collgrad.errors import AgreementError, NoBackendError, PolicyError

__all__ = ["Capabilities", "Choice", "PrimitiveStatus", "Registry", "decide", "preference", "installed"]

FORMAT = 1  # bump when the agreement vector changes: ranks on different collgrad versions then fail together

Finder = Callable[[str, Op, Primitive, torch.dtype], LocalFinding]


def _generic_finding(device_type: str, op: Op, primitive: Primitive, dtype: torch.dtype) -> LocalFinding:
    """A backend collgrad has no table for (ucc, third-party): only what every backend implements."""
    if primitive is Primitive.PER_TENSOR or (primitive is Primitive.FLAT and op is Op.ALL_REDUCE):
        return LocalFinding(Reason.OK)
    return LocalFinding(Reason.BACKEND_LACKS, detail="not known for this backend")


_TORCH_BACKENDS: Mapping[str, Finder] = {
    gloo.NAME: gloo.finding,
    nccl.NAME: nccl.finding,
    mpi.NAME: mpi.torch_mpi_finding,
    "ccl": ccl.ccl_finding,
    "xccl": ccl.xccl_finding,
}
_TORCH_PRIMITIVES = (Primitive.FLAT, Primitive.COALESCED, Primitive.PER_TENSOR)


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


def _code(text: str | None) -> int:
    return zlib.crc32((text or "").encode()) if text else 0


# --- the agreement vector ---------------------------------------------------------------------------
_HEADER = ("format", "device", "backend", "size", "rank", "policy_ok", "mpi_reason", "mpi_rank", "mpi_size", "mpi_token")
_KEYS = tuple((op, prim, dtype) for op in Op for prim in Primitive for dtype in DTYPES)


def encode(header: Mapping[str, int], findings: Mapping[tuple[Op, Primitive, torch.dtype], LocalFinding]) -> list[int]:
    row = [int(header[name]) for name in _HEADER]
    for key in _KEYS:
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

    def choice(self, op: Op, dtype: torch.dtype) -> Choice:
        for choice in self.choices:
            if choice.op is op and choice.dtype == dtype:
                return choice
        # dtypes outside the table (complex, bool, ...): the group's backend, one call per tensor.
        return Choice(op, dtype, Primitive.PER_TENSOR, self.backend, dtype, UNLIMITED, ())

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
    header = [dict(zip(_HEADER, row[: len(_HEADER)])) for row in rows]
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
    base = len(_HEADER)
    statuses = []
    for k, (op, prim, dtype) in enumerate(_KEYS):
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
    return Capabilities(tuple(group_ranks), device_type, backend, tuple(statuses), tuple(choices))


def _choose(table, order, op, dtype, backend) -> Choice:
    passed = []
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


def installed() -> dict[str, bool]:
    """What this process could use, for the probe table (not used for decisions)."""
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi (torch)": dist.is_mpi_available(),
        "xccl": _compat.xccl_available(),
        "ccl (oneccl_bindings_for_pytorch)": importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None,
        "mpi4py": importlib.util.find_spec("mpi4py") is not None,
        "cuda device": torch.cuda.is_available(),
        "xpu device": _compat.xpu_available(),
    }


@dataclass(frozen=True)
class GroupLinks:
    """What the dispatcher needs besides the decision: the MPI communicator, if mpi4py was chosen.
    (No reference to the group: the cache holds groups weakly.)"""

    capabilities: Capabilities
    mpi_comm: Any = None


class Registry:
    """Finds, agrees on and caches capabilities per (group, device type, policy).

    ``capabilities()`` is collective over the group the first time it is called for a (group, device
    type, policy): every rank of the group must call it then, in the same order. Later calls are
    served from the cache without communication.
    """

    def __init__(
        self, policy: Policy | None = None, environ: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> None:
        self._environ = environ
        self.timeout = timeout_from_env(timeout, environ)
        self._env_policy = policy if policy is not None else Policy.from_env(environ)
        self.mpi = mpi.MpiLink(environ)
        self._cache: "weakref.WeakKeyDictionary[ProcessGroup, dict]" = weakref.WeakKeyDictionary()

    def policy(self, override: Policy | None = None) -> Policy:
        return self._env_policy.merged(override)

    def links(self, device_type: str, group: ProcessGroup | None = None, policy: Policy | None = None) -> GroupLinks:
        group = group if group is not None else _compat.default_group()
        effective = self.policy(policy)
        per_group = self._cache.setdefault(group, {})
        # Keyed on the call's policy, which every rank passes alike, not on the effective one: the
        # environment part may differ between ranks, and a cache hit on one rank with a miss on
        # another would leave ranks in different collectives.
        key = (device_type, policy)
        if key not in per_group:
            per_group[key] = self._agree(group, device_type, effective)
        return per_group[key]

    def capabilities(
        self, device_type: str, group: ProcessGroup | None = None, policy: Policy | None = None
    ) -> Capabilities:
        """The agreed capabilities of ``group`` for ``device_type`` tensors. Collective on first use."""
        return self.links(device_type, group, policy).capabilities

    # -- the one collective -----------------------------------------------------------------------
    def _agree(self, group: ProcessGroup, device_type: str, policy: Policy) -> GroupLinks:
        ranks = _compat.group_ranks(group)
        backend = _compat.backend_name(group, device_type)
        if backend is None:
            # The group's backends are fixed at creation and identical on every rank, so every rank
            # raises here, before any communication.
            raise NoBackendError(
                f"rank {dist.get_rank()}: process group {ranks} has no backend for {device_type} tensors "
                f"(it was created with {dist.get_backend(group)!r}); create it with a backend for "
                f"{device_type}, e.g. backend='cpu:gloo,cuda:nccl', or move the tensors"
            )
        header, findings, policy_error = self._local(group, device_type, backend, policy, len(ranks))
        rows = exchange(group, encode(header, findings), device_type, timeout_s=self.timeout,
                        what=f"the capability agreement for {device_type} tensors")
        if policy_error is not None:
            raise policy_error  # this rank's own, more precise message; the others raise in decide()
        caps = decide(rows, device_type, backend, ranks)
        comm = None
        if any(c.primitive is Primitive.MPI4PY for c in caps.choices):
            mpi_ranks = [r[_HEADER.index("mpi_rank")] for r in rows]
            comm = self.mpi.communicator(mpi_ranks, ranks)
            if comm is None:  # every member saw the same allgather, so every member gets here
                caps = decide(rows, device_type, backend, ranks, mpi_verified=False)
        return GroupLinks(caps, comm)

    def _local(self, group, device_type, backend, policy, size):
        policy_error = None
        try:
            policy.validate()
        except PolicyError as exc:
            policy_error = PolicyError(f"rank {dist.get_rank()}: {exc}")
        is_world = size == dist.get_world_size()
        state = self.mpi.state(group_is_world=is_world, group_size=size)
        finder = _TORCH_BACKENDS.get(backend, _generic_finding)
        findings = {}
        for op, prim, dtype in _KEYS:
            if policy_error is not None:
                found = LocalFinding(Reason.POLICY_INVALID)
            elif prim is Primitive.MPI4PY:
                found = self.mpi.finding(state, device_type, op, dtype)
            else:
                found = finder(device_type, op, prim, dtype)
            if found.ok:
                allowed = policy.check(prim, backend)
                if allowed is not Reason.OK:
                    found = LocalFinding(allowed)
            findings[(op, prim, dtype)] = found
        header = {
            "format": FORMAT,
            "device": _code(device_type),
            "backend": _code(backend),
            "size": size,
            "rank": dist.get_rank(),
            "policy_ok": int(policy_error is None),
            "mpi_reason": int(state.reason),
            "mpi_rank": state.rank,
            "mpi_size": state.size,
            "mpi_token": state.token,
        }
        return header, findings, policy_error
