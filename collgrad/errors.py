"""Exception types raised by collgrad.

Every error that depends on the state of a process group is raised on *every* rank of that group
together (the decision to raise is taken from data all ranks share), so a mistake never leaves some
ranks waiting in a collective while others have already failed.
"""

from __future__ import annotations

__all__ = ["CollgradError", "NoPrimitiveError", "AgreementError", "PolicyError", "CollgradTimeout"]


class CollgradError(RuntimeError):
    """Base class of collgrad's errors."""


class PolicyError(CollgradError, ValueError):
    """A force/forbid override names something collgrad does not know, or is contradictory."""


class AgreementError(CollgradError):
    """The ranks of a group disagree on something they must share (backend, device, dtype set)."""


class NoPrimitiveError(CollgradError):
    """No primitive can carry a bucket of this (device, dtype) on every rank of the group."""


class CollgradTimeout(CollgradError, TimeoutError):
    """A collective did not complete within collgrad's bounded wait (see collgrad/waits.py)."""
