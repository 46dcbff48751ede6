"""Exception types raised by collgrad: one per way a call can fail, all under ``CollgradError``.

Every error that depends on the state of a process group is raised on *every* rank of that group
together (the decision to raise is taken from data all ranks share), so a mistake never leaves some
ranks waiting in a collective while others have already failed::

    CollgradError (RuntimeError)
      InvalidArgumentError (also ValueError, TypeError)   this rank's arguments are wrong
        UnknownParameterError (also KeyError)            a name or tensor that is not a trainable parameter
        PolicyError                                      a force/forbid override collgrad cannot use
      ArgumentMismatchError     ranks passed different arguments, or another rank's were invalid
      NotReadyError             gradients cannot be read now (before backward, mid-accumulation, after step)
      LayoutChangedError        the gradient buffers no longer match the layout a cached plan was built from
      NoBackendError            the process group has no backend for the tensors' device
      AgreementError            the ranks disagree on something they must share (backend, device)
      NoPrimitiveError          no primitive can carry a bucket on every rank
      CollgradTimeoutError (also TimeoutError)   a bounded wait ran out (see collgrad/backends/waits.py)
      CheckpointError (also ValueError)   a checkpoint file refused: its header, index or contents
      PreStepHookError          a pre-step hook raised on another rank: the step was not taken
      RankFailedError           another rank failed inside the call after the ranks had agreed to go on
      NotInitializedError       no process group yet (init_process_group not called, no launcher found)
"""

from __future__ import annotations

__all__ = [
    "CollgradError",
    "InvalidArgumentError",
    "UnknownParameterError",
    "PolicyError",
    "ArgumentMismatchError",
    "NotReadyError",
    "LayoutChangedError",
    "NoBackendError",
    "AgreementError",
    "NoPrimitiveError",
    "CollgradTimeoutError",
    "CheckpointError",
    "PreStepHookError",
    "RankFailedError",
    "NotInitializedError",
]


class CollgradError(RuntimeError):
    """Base class of collgrad's errors."""


class InvalidArgumentError(CollgradError, ValueError, TypeError):
    """An argument of this rank's call is invalid. Also a ``ValueError``/``TypeError``, which is what
    code written against plain torch.distributed catches for bad arguments."""


class UnknownParameterError(InvalidArgumentError, KeyError):
    """``params=`` names a parameter (or holds a tensor) that is not a trainable parameter of the model."""

    # KeyError quotes its message; these messages are sentences.
    __str__ = BaseException.__str__


class PolicyError(InvalidArgumentError):
    """A force/forbid override names something collgrad does not know, or is contradictory."""


class ArgumentMismatchError(CollgradError):
    """The ranks of a group passed different arguments to one collective call (or another rank passed
    invalid ones): the message names the ranks and what differs; ``fields`` names what differs (empty
    when another rank's arguments were invalid), the same on every rank."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class NotReadyError(CollgradError):
    """Full gradients cannot be read or written now: before ``backward()``, at a micro-step that is not
    an accumulation boundary, or after ``step()``."""


class LayoutChangedError(CollgradError):
    """The gradient buffers no longer have the shape the (cached) layout describes."""


class NoBackendError(CollgradError):
    """The process group has no backend for the tensors' device type."""


class AgreementError(CollgradError):
    """The ranks of a group disagree on something they must share (backend, device, dtype set)."""


class NoPrimitiveError(CollgradError):
    """No primitive can carry a bucket of this (device, dtype) on every rank of the group."""


class CollgradTimeoutError(CollgradError, TimeoutError):
    """A collective did not complete within collgrad's bounded wait (see collgrad/backends/waits.py)."""


class CheckpointError(CollgradError, ValueError):
    """A checkpoint refused before anything was changed: a file missing, truncated or malformed, a header
    that disagrees with its file or index, a shard outside the checkpoint's directory, or names and
    shapes that do not match the model. The message names the file and the reason."""


class PreStepHookError(CollgradError):
    """A pre-step hook (``register_pre_step_hook``) raised on another rank of the group; this rank
    raises this instead of going on alone, and the optimizer step is not taken (the rank whose hook
    failed raises its own exception)."""


class RankFailedError(CollgradError):
    """Another rank of the group failed inside a collgrad call after the ranks had agreed to go on (its
    own error says why); this rank raises this instead of waiting for it, and returns nothing."""


class NotInitializedError(CollgradError):
    """A collective call before ``torch.distributed.init_process_group()`` (or, for
    ``collgrad.launch.init_from_environment``, outside any launcher's environment)."""
