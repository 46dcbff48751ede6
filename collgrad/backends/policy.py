"""User overrides: force or forbid a backend or a primitive.

Set per rank through the environment (``COLLGRAD_FORCE``, ``COLLGRAD_FORBID``: comma-separated
names) or per call through ``policy=Policy(...)``; both apply, the argument's ``force`` replacing the
environment's. An override that differs between ranks is safe: the registry combines every rank's
findings, so the group agrees on a primitive that every rank allows, or every rank raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from collgrad.backends.base import Reason
from collgrad.backends.ops import Primitive
from collgrad.errors import PolicyError

__all__ = ["Policy", "BACKEND_NAMES", "PRIMITIVE_NAMES", "ENV_FORCE", "ENV_FORBID"]

ENV_FORCE = "COLLGRAD_FORCE"
ENV_FORBID = "COLLGRAD_FORBID"

#: torch.distributed backends by their ``Backend.name()``, plus mpi4py (which runs beside them).
BACKEND_NAMES = frozenset({"gloo", "nccl", "mpi", "ccl", "xccl", "ucc", "mpi4py"})
PRIMITIVE_NAMES = frozenset(p.value for p in Primitive)


def _names(value: str | Iterable[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = value.split(",")
    return frozenset(v.strip().lower() for v in value if v.strip())


@dataclass(frozen=True)
class Policy:
    """Which backends/primitives this rank allows.

    ``force``: if it names primitives, only those may be used; if it names backends, only primitives
    those backends serve. ``forbid``: names that may not be used. Names: backends
    ``gloo nccl mpi ccl xccl ucc mpi4py``, primitives ``flat coalesced mpi4py per_tensor``.
    """

    force: frozenset[str] = field(default_factory=frozenset)
    forbid: frozenset[str] = field(default_factory=frozenset)

    def __init__(self, force: str | Iterable[str] | None = None, forbid: str | Iterable[str] | None = None):
        object.__setattr__(self, "force", _names(force))
        object.__setattr__(self, "forbid", _names(forbid))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Policy":
        env = os.environ if environ is None else environ
        return cls(force=env.get(ENV_FORCE), forbid=env.get(ENV_FORBID))

    def merged(self, other: "Policy | None") -> "Policy":
        """This (environment) policy with a per-call ``other`` applied on top."""
        if other is None:
            return self
        return Policy(force=other.force or self.force, forbid=self.forbid | other.forbid)

    def validate(self) -> None:
        """Raise PolicyError (on this rank only: call it before any collective) for unknown names."""
        known = BACKEND_NAMES | PRIMITIVE_NAMES
        unknown = sorted((self.force | self.forbid) - known)
        if unknown:
            raise PolicyError(
                f"unknown backend/primitive name(s) {unknown} in {ENV_FORCE}/{ENV_FORBID} or policy=; "
                f"known backends: {sorted(BACKEND_NAMES)}, primitives: {sorted(PRIMITIVE_NAMES)}"
            )
        both = sorted(self.force & self.forbid)
        if both:
            raise PolicyError(f"{both} are both forced and forbidden; remove them from one of the two")

    def check(self, primitive: Primitive, backend: str | None) -> Reason:
        """Reason.OK if this policy allows ``primitive`` served by ``backend``.

        ``force`` is read on two axes that must both match: the primitive names it lists (if any) and
        the backend names it lists (if any). ``mpi4py`` is on both axes: it names the backend and its
        only primitive. So ``force="gloo,flat"`` allows flat buffers over Gloo only.
        """
        served_by = "mpi4py" if primitive is Primitive.MPI4PY else backend
        if primitive.value in self.forbid or (served_by is not None and served_by in self.forbid):
            return Reason.FORBIDDEN
        forced_prims = self.force & PRIMITIVE_NAMES
        forced_backends = self.force & BACKEND_NAMES
        if forced_prims and primitive.value not in forced_prims:
            return Reason.NOT_FORCED
        if forced_backends and served_by not in forced_backends:
            return Reason.NOT_FORCED
        return Reason.OK
