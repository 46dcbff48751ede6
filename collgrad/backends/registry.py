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
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends import ccl, gloo, mpi, nccl
from collgrad.backends.agreement import exchange
from collgrad.backends.base import LocalFinding, Reason
from collgrad.backends.decide import FORMAT, HEADER, KEYS, Capabilities, code, decide, encode
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.backends.waits import timeout_from_env
from collgrad.errors import NoBackendError, PolicyError

__all__ = ["Registry", "GroupLinks", "installed"]


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


def _never(device_type: str) -> bool:
    return False


#: Backends whose coalesced all-gather may be handed strided outputs (it copies out with ``copy_``).
_LAYS_OUT_STRIDED: Mapping[str, Callable[[str], bool]] = {gloo.NAME: gloo.copies_gathers_out_strided}


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
    mpi_comm: mpi.MpiComm | None = None


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
        self._cache: weakref.WeakKeyDictionary[ProcessGroup, dict[tuple[str, Policy | None], GroupLinks]] = (
            weakref.WeakKeyDictionary()
        )

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
        rows = exchange(
            group,
            encode(header, findings),
            device_type,
            timeout_s=self.timeout,
            what=f"the capability agreement for {device_type} tensors",
        )
        if policy_error is not None:
            raise policy_error  # this rank's own, more precise message; the others raise in decide()
        caps = decide(rows, device_type, backend, ranks)
        comm = None
        if any(c.primitive is Primitive.MPI4PY for c in caps.choices):
            mpi_ranks = [r[HEADER.index("mpi_rank")] for r in rows]
            comm = self.mpi.communicator(mpi_ranks, ranks)
            if comm is None:  # every member saw the same allgather, so every member gets here
                caps = decide(rows, device_type, backend, ranks, mpi_verified=False)
        return GroupLinks(caps, comm)

    def _local(
        self, group: ProcessGroup, device_type: str, backend: str, policy: Policy, size: int
    ) -> tuple[dict[str, int], dict[tuple[Op, Primitive, torch.dtype], LocalFinding], PolicyError | None]:
        policy_error = None
        try:
            policy.validate()
        except PolicyError as exc:
            policy_error = PolicyError(f"rank {dist.get_rank()}: {exc}")
        is_world = size == dist.get_world_size()
        state = self.mpi.state(group_is_world=is_world, group_size=size)
        finder = _TORCH_BACKENDS.get(backend, _generic_finding)
        findings: dict[tuple[Op, Primitive, torch.dtype], LocalFinding] = {}
        for op, prim, dtype in KEYS:
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
            "device": code(device_type),
            "backend": code(backend),
            "size": size,
            "rank": dist.get_rank(),
            "policy_ok": int(policy_error is None),
            "mpi_reason": int(state.reason),
            "mpi_rank": state.rank,
            "mpi_size": state.size,
            "mpi_token": state.token,
            "strided_gather": int(_LAYS_OUT_STRIDED.get(backend, _never)(device_type)),
        }
        return header, findings, policy_error
