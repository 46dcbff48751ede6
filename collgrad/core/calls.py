"""The checks every public collective call makes before any data moves: each argument on this rank,
then one small exchange (``agree_on_call``) in which every rank compares what it was passed.

A rank whose own arguments are invalid still takes part in that exchange with an INVALID verdict
(``told_if_invalid``), so the ranks whose arguments were fine raise too instead of waiting.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch.distributed import ProcessGroup, ReduceOp

from collgrad import _compat
from collgrad.backends.agreement import Field, stable_hash, tell_invalid
from collgrad.backends.ops import Op
from collgrad.backends.policy import Policy
from collgrad.core.planner import DEFAULT_BUCKET_BYTES
from collgrad.errors import InvalidArgumentError

__all__ = [
    "CALL_NAMES",
    "call_fields",
    "checked_bucket_bytes",
    "checked_gather",
    "checked_options",
    "checked_reduce",
    "policy_print",
    "told_if_invalid",
]

#: How each operation is named in errors: the torch.distributed call it stands in for.
CALL_NAMES = {Op.ALL_REDUCE: "all_reduce_coalesced", Op.ALL_GATHER: "all_gather_coalesced"}

_CALL_FIELDS = (
    "operation",
    "reduce op",
    "bucket_bytes",
    "atomic",
    "policy",
    "number of tensors",
    "dtypes and devices",
    "shapes",
)


def checked_bucket_bytes(bucket_bytes: int | None) -> int:
    """The bucket cap in bytes: ``bucket_bytes`` if it is a positive int, the default if None."""
    if bucket_bytes is None:
        return DEFAULT_BUCKET_BYTES
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidArgumentError(f"rank {_compat.rank()}: bucket_bytes must be positive, got {bucket_bytes!r}")
    return bucket_bytes


def checked_options(bucket_bytes: int | None, policy: Policy | None) -> int:
    """Checks of the options every public call takes; returns the bucket cap in bytes."""
    cap = checked_bucket_bytes(bucket_bytes)
    if policy is not None:
        policy.validate()
    return cap


def policy_print(policy: Policy | None) -> int:
    """The call's ``policy=`` as a number every rank computes alike (names sorted: a frozenset's order
    follows str hashing, which is salted per process)."""
    return stable_hash(None if policy is None else (sorted(policy.force), sorted(policy.forbid)))


def checked_reduce(tensors: Sequence[object], op: ReduceOp.RedOpType) -> list[torch.Tensor]:
    """This rank's arguments of an all-reduce, checked; InvalidArgumentError names the first bad one."""
    out = [_check_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, t in enumerate(out):
        if op == ReduceOp.AVG and not (t.is_floating_point() or t.is_complex()):
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: tensors[{i}] is {t.dtype}: ReduceOp.AVG needs floating-point tensors"
            )
    return out


def checked_gather(
    outputs: Sequence[object], inputs: Sequence[object], world: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's arguments of an all-gather, checked: every output holds ``world`` inputs' elements,
    in the input's dtype, on its device."""
    given_outs, given_ins = list(outputs), list(inputs)
    if len(given_outs) != len(given_ins):
        raise InvalidArgumentError(f"rank {_compat.rank()}: {len(given_outs)} outputs for {len(given_ins)} inputs")
    outs: list[torch.Tensor] = []
    ins: list[torch.Tensor] = []
    for i, (given_out, given_in) in enumerate(zip(given_outs, given_ins)):
        inp = _check_tensor(given_in, f"inputs[{i}]")
        out = _check_tensor(given_out, f"outputs[{i}]")
        outs.append(out)
        ins.append(inp)
        if out.numel() != world * inp.numel() or out.dtype != inp.dtype or out.device != inp.device:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: outputs[{i}] must have world_size * inputs[{i}].numel() = "
                f"{world * inp.numel()} elements, dtype {inp.dtype} and device {inp.device}; got "
                f"{out.numel()}, {out.dtype}, {out.device}"
            )
    return outs, ins


@contextmanager
def told_if_invalid(group: ProcessGroup, check: bool, timeout_s: float, call: str) -> Iterator[None]:
    """Argument checks run inside this: an invalid argument on this rank is told to the other ranks in
    the argument check they are waiting in (so they raise too), then raised here."""
    try:
        yield
    except InvalidArgumentError:
        if check:
            tell_invalid(group, len(_CALL_FIELDS), timeout_s, call)
        raise


def call_fields(
    op: Op,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp.RedOpType | None,
    cap: int,
    policy: Policy | None,
    atomic: bool,
) -> list[Field]:
    """What every rank must pass alike for a coalesced call: it decides the number, size and kind of the
    collectives each rank issues."""
    names = iter(_CALL_FIELDS)
    return [
        Field(next(names), list(Op).index(op), shown=False),
        Field(next(names), stable_hash(str(reduce_op)), shown=False),
        Field(next(names), cap),
        Field(next(names), int(atomic)),
        Field(next(names), policy_print(policy), shown=False),
        Field(next(names), len(tensors)),
        Field(next(names), stable_hash([(str(t.dtype), t.device.type) for t in tensors]), shown=False),
        Field(next(names), stable_hash([tuple(t.shape) for t in tensors]), shown=False),
    ]


def _check_tensor(t: object, name: str) -> torch.Tensor:
    """``t``, once found to be a dense tensor with storage (InvalidArgumentError naming ``name`` if not)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"rank {_compat.rank()}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout is not torch.strided or t.is_meta:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {name}: only dense (strided) tensors with storage can be communicated, "
            f"got {t.layout}"
        )
    return t
