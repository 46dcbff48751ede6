"""The kinds of training state a call reads or writes, as typed values.

    GRAD                    the reduced gradients (what the optimizer steps with)
    FP32                    the fp32 master weights (the module's own weights where there is no master copy)
    WEIGHTS                 the module's own weights as they are (its dtype), frozen parameters too
    OptimizerState(key)     the optimizer's per-element state ``key`` (``"exp_avg"``, ...), shaped like
                            the parameter

Every kind lies as the parameters do (collgrad/state/layout.py): a source of any kind has the same
layout type, and every plan, executor and record serves them all. Kinds are frozen and hashable: they
key caches and are compared between ranks by their ``label``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from collgrad import _compat
from collgrad.errors import InvalidArgumentError

__all__ = ["Grad", "FP32Master", "ModuleWeights", "OptimizerState", "StateKind", "GRAD", "FP32", "WEIGHTS"]


@dataclass(frozen=True)
class Grad:
    """The reduced, averaged gradients, between the boundary ``backward()`` and ``step()``."""

    label: ClassVar[str] = "grad"
    key: ClassVar[None] = None
    #: Held scaled by the loss scale under fp16 (true values are scaled on the way in and out).
    scaled: ClassVar[bool] = True
    #: Valid only between the boundary backward() and step().
    needs_backward: ClassVar[bool] = True

    def describe(self) -> str:
        return "gradients"

    def checked(self) -> Grad:
        return self


@dataclass(frozen=True)
class FP32Master:
    """The fp32 master weights the optimizer steps (the module's own where there is no master copy)."""

    label: ClassVar[str] = "fp32"
    key: ClassVar[None] = None
    scaled: ClassVar[bool] = False
    needs_backward: ClassVar[bool] = False

    def describe(self) -> str:
        return "fp32 master weights"

    def checked(self) -> FP32Master:
        return self


@dataclass(frozen=True)
class ModuleWeights:
    """The module's own weights as they are (its dtype), every parameter, frozen ones too: what a
    consolidated checkpoint holds."""

    label: ClassVar[str] = "weights"
    key: ClassVar[None] = None
    scaled: ClassVar[bool] = False
    needs_backward: ClassVar[bool] = False

    def describe(self) -> str:
        return "module weights"

    def checked(self) -> ModuleWeights:
        return self


@dataclass(frozen=True)
class OptimizerState:
    """The optimizer's per-element state ``key`` of each parameter (one value per element)."""

    key: str
    label: ClassVar[str] = "optimizer"
    scaled: ClassVar[bool] = False
    needs_backward: ClassVar[bool] = False

    def describe(self) -> str:
        return f"optimizer state {self.key!r}"

    def checked(self) -> OptimizerState:
        """This state, if its key can name one; InvalidArgumentError (this rank) otherwise. Called where
        a call checks its arguments, so that a rank with a bad key tells the others."""
        if not isinstance(self.key, str) or not self.key:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: key must name an optimizer state, e.g. 'exp_avg', got {self.key!r}"
            )
        return self


StateKind = Union[Grad, FP32Master, ModuleWeights, OptimizerState]

GRAD = Grad()
FP32 = FP32Master()
WEIGHTS = ModuleWeights()
