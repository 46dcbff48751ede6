"""Runs a plan: copy in, one collective per bucket, copy out; records what it did.

Two buckets are in flight at most: bucket i+1 is packed and issued while bucket i travels, then i
is waited on and unpacked. Memory held beyond the caller's tensors is therefore about two buckets,
and Gloo's two worker threads both have work. How one bucket travels is ``flight``; the checks a
public call makes before any data moves are ``calls``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from collgrad import _compat
from collgrad.backends.agreement import HookFailures, agree_on_call
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.backends.registry import Registry
from collgrad.backends.waits import timeout_from_env
from collgrad.core import flight, planner
from collgrad.core.calls import (
    CALL_NAMES,
    call_fields,
    checked_bucket_bytes,
    checked_gather,
    checked_options,
    checked_reduce,
    policy_print,
    told_if_invalid,
)
from collgrad.core.failures import BucketFailures, FaultPoint, next_call
from collgrad.core.plan import Bucket, BucketRule, Plan, TensorSpec
from collgrad.core.primitives import Channel, make_channel
from collgrad.core.record import BucketRecord, CallRecord, Decision
from collgrad.errors import CollgradError, NoPrimitiveError

__all__ = ["Dispatcher", "Prepared", "default_dispatcher", "checked_bucket_bytes", "policy_print"]


@dataclass(frozen=True)
class Prepared:
    """A bucket plan with what runs it: the channel per rule and the decisions taken. Built once per
    (tensor specs, group, bucket size, policy) and reusable for any tensors of those specs, so callers
    that run the same shapes every step (the full-gradient executors) plan once."""

    plan: Plan
    channels: Mapping[BucketRule, Channel]
    decisions: tuple[Decision, ...]
    #: the tensors go to the backend as they are (see ``Dispatcher.prepare(strided=True)``)
    strided: bool = False

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        specs = self.plan.tensors
        return len(specs) == len(tensors) and all(
            s.numel == t.numel() and s.dtype == t.dtype for s, t in zip(specs, tensors)
        )


class Dispatcher:
    """Owns a Registry and runs coalesced collectives through it.

    Its methods are collective: every rank of ``group`` must call them with tensors of the same
    shapes, dtypes and device types, in the same order (as for any torch.distributed collective).
    With ``check=True`` (the default) each call first exchanges a fingerprint of its arguments in one
    small all-gather, so a rank with invalid or different arguments makes every rank raise
    (InvalidArgumentError on that rank, ArgumentMismatchError on the others) instead of hanging.
    """

    def __init__(self, registry: Registry | None = None, timeout: float | None = None) -> None:
        self.registry = registry if registry is not None else Registry(timeout=timeout)
        #: Test hook: called with a FaultPoint just before each bucket's collective is issued; an
        #: exception it raises is handled as a primitive failing on this rank (see failures.py).
        self.fault_hook: Callable[[FaultPoint], None] | None = None
        #: Seconds any collective of this dispatcher may wait (COLLGRAD_TIMEOUT, default 120).
        self.timeout = timeout_from_env(timeout) if timeout is not None or registry is None else registry.timeout
        #: Another rank's pre-step hook failures seen by this dispatcher's calls (collgrad/state/hook.py).
        self.hook_failures = HookFailures()

    # -- public operations --------------------------------------------------------------------------
    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        group: ProcessGroup | None = None,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        *,
        bucket_bytes: int | None = None,
        policy: Policy | None = None,
        atomic: bool = True,
        check: bool = True,
    ) -> CallRecord:
        """``atomic``: write ``tensors`` only once every bucket has completed (a failure leaves them as
        they were), at the cost of one more copy of each; False reduces buckets in place as they go.
        ``check=False`` skips the argument exchange: for callers that already agreed on the call."""
        group = group if group is not None else _compat.default_group()
        with told_if_invalid(group, check, self.timeout, CALL_NAMES[Op.ALL_REDUCE]):
            tensors = checked_reduce(tensors, op)
            cap = checked_options(bucket_bytes, policy)
        return self._call(Op.ALL_REDUCE, tensors, None, group, op, cap, policy, atomic, check)

    def all_gather(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: ProcessGroup | None = None,
        *,
        bucket_bytes: int | None = None,
        policy: Policy | None = None,
        atomic: bool = True,
        check: bool = True,
    ) -> CallRecord:
        """``atomic``: write ``outputs`` only once every bucket has completed (see ``all_reduce``)."""
        group = group if group is not None else _compat.default_group()
        with told_if_invalid(group, check, self.timeout, CALL_NAMES[Op.ALL_GATHER]):
            outputs, inputs = checked_gather(outputs, inputs, group.size())
            cap = checked_options(bucket_bytes, policy)
        return self._call(Op.ALL_GATHER, inputs, outputs, group, None, cap, policy, atomic, check)

    def _call(
        self,
        op: Op,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor] | None,
        group: ProcessGroup,
        reduce_op: ReduceOp.RedOpType | None,
        cap: int,
        policy: Policy | None,
        atomic: bool,
        check: bool,
    ) -> CallRecord:
        """A public call whose arguments this rank found valid: the argument check, then the plan."""
        if check:
            fields = call_fields(op, inputs, reduce_op, cap, policy, atomic)
            agree_on_call(group, fields, timeout_s=self.timeout, call=CALL_NAMES[op], hook_failures=self.hook_failures)
        prepared = self.prepare(op, inputs, group, bucket_bytes=cap, policy=policy)
        return self.run(prepared, inputs, outputs, group, reduce_op, atomic=atomic)

    # -- planning ---------------------------------------------------------------------------------------
    def prepare(
        self,
        op: Op,
        tensors: Sequence[torch.Tensor],
        group: ProcessGroup,
        *,
        bucket_bytes: int | None = None,
        policy: Policy | None = None,
        strided: bool = False,
        whole: bool = False,
    ) -> Prepared:
        """The plan for ``tensors``, the channel per rule, and the decisions taken. Collective the first
        time a (group, device type) is seen (the registry agrees on capabilities), local afterwards.

        ``strided`` (all-gathers only): the tensors are views the group's backend lays out itself
        (``Capabilities.strided_gather``): the coalesced primitive, each tensor whole in one bucket
        (a bucket holds whole tensors up to ``bucket_bytes``, a larger one alone), handed over as
        they are. NoPrimitiveError, on every rank alike, where the group did not agree on that.

        ``whole``: the agreed primitive, but no tensor is cut either (a bucket holds whole tensors up to
        ``bucket_bytes``, a larger one alone): each tensor is gathered straight into its output when it
        is alone in its bucket (``bucket_bytes=1``: every tensor alone, one collective each)."""
        world = group.size()
        cap_bytes = checked_bucket_bytes(bucket_bytes)
        specs = tuple(TensorSpec(t.numel(), t.dtype, str(t.device)) for t in tensors)
        rules: dict[tuple[str, torch.dtype], BucketRule] = {}
        channels: dict[BucketRule, Channel] = {}
        decisions: list[Decision] = []
        for spec in specs:
            key = (spec.device, spec.dtype)
            if key not in rules:
                # never cut: the largest tensor must fit the primitive's largest message
                widest = max(t.numel for t in specs if (t.device, t.dtype) == key) if strided or whole else 0
                rule, channel, decision = _rule(self.registry, op, spec, group, cap_bytes, policy, widest, strided)
                rules[key], channels[rule] = rule, channel
                decisions.append(decision)
        plan = planner.plan_buckets(op, specs, rules, world, whole=strided or whole)
        plan.validate()
        return Prepared(plan, channels, tuple(decisions), strided)

    # -- execution ----------------------------------------------------------------------------------------
    def run(
        self,
        prepared: Prepared,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
        group: ProcessGroup,
        reduce_op: ReduceOp.RedOpType | None = ReduceOp.SUM,
        *,
        atomic: bool = True,
        done: Callable[[int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> CallRecord:
        """Run a prepared plan on ``inputs`` (and ``outputs`` for an all-gather), tensors of the specs it
        was prepared for. Collective: every rank runs the same plan (no argument check here).

        ``done(i)``: called as soon as output ``i`` is complete (its last bucket finished), while the
        next bucket is still in flight, so a caller can work on it meanwhile. Only for non-atomic runs
        whose outputs are contiguous (nothing is written back at the end).

        ``meanwhile()``: host work run once, as soon as the first bucket is in flight and before any
        wait, so it overlaps the transfer (views of the outputs, result bookkeeping). It must not
        communicate nor read the outputs' data. If it raises, every bucket is still waited for (this
        rank leaves no collective behind), then its error is raised."""
        assert prepared.fits(inputs), "a prepared plan run on tensors it was not prepared for"
        assert not (prepared.strided and atomic), "strided outputs are written in place"
        with torch.no_grad():
            run = _Run(self, prepared, inputs, outputs, group, reduce_op, atomic, done)
            records = run.buckets(meanwhile)
        return CallRecord(prepared.plan.op, tuple(_compat.group_ranks(group)), records, prepared.decisions)


def _rule(
    registry: Registry,
    op: Op,
    spec: TensorSpec,
    group: ProcessGroup,
    cap_bytes: int,
    policy: Policy | None,
    widest: int,
    strided: bool,
) -> tuple[BucketRule, Channel, Decision]:
    """How tensors of ``spec``'s device and dtype travel: the agreed choice, or, for ``strided`` tensors,
    the coalesced primitive the group agreed lays strided outputs out; its channel and the record.
    ``widest``: the largest tensor where tensors are never cut (0 where they may be)."""
    device_type = torch.device(spec.device).type
    links = registry.links(device_type, group, policy)
    caps = links.capabilities
    choice = caps.choice(op, spec.dtype)
    if strided:
        if op is not Op.ALL_GATHER or not caps.strided_gather(spec.dtype):
            raise NoPrimitiveError(
                f"rank {dist.get_rank()}: group {list(caps.group_ranks)} cannot {op.value} {spec.dtype} "
                f"tensors on {device_type} into strided outputs (its {caps.backend} backend does not lay "
                "a coalesced gather out itself, or the coalesced primitive is not allowed); pass contiguous "
                "tensors instead"
            )
        status = caps.status(op, Primitive.COALESCED, spec.dtype)
        why = f"{caps.backend} lays a coalesced gather out into strided outputs itself"
        primitive, backend, wire, limit = Primitive.COALESCED, status.backend, spec.dtype, status.max_elements
    elif choice.primitive is None:
        raise NoPrimitiveError(
            f"rank {dist.get_rank()}: no primitive can {op.value} {spec.dtype} tensors on {device_type} "
            f"in group {list(caps.group_ranks)} ({choice.why()}); allow one "
            "(COLLGRAD_FORCE/COLLGRAD_FORBID, policy=) or cast the tensors"
        )
    else:
        primitive, backend, wire, limit = choice.primitive, choice.backend, choice.wire_dtype, choice.max_elements
        why = choice.why()
    if widest > limit:
        raise NoPrimitiveError(
            f"rank {dist.get_rank()}: a {spec.dtype} tensor of {widest} elements, never cut, is larger than the "
            f"largest message {primitive.value} over {backend} takes ({limit}); gather it in parts"
        )
    capacity = planner.bucket_capacity(op, cap_bytes, wire, group.size(), limit)
    rule = BucketRule(primitive, backend, wire, capacity)
    channel = make_channel(primitive, group, backend, registry.mpi, links.mpi_comm)
    return rule, channel, Decision(device_type, spec.dtype, primitive, backend, wire, why)


class _Run:
    """One run of a prepared plan: its buckets issued in order, two in flight at most, each finished
    (waited for, unpacked) while the next travels; ``done(i)`` told as output ``i`` completes."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        prepared: Prepared,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
        group: ProcessGroup,
        reduce_op: ReduceOp.RedOpType | None,
        atomic: bool,
        done: Callable[[int], None] | None,
    ) -> None:
        self.prepared, self.plan, self.op = prepared, prepared.plan, prepared.plan.op
        self.group, self.reduce_op, self.done = group, reduce_op, done
        self.timeout, self.fault_hook = dispatcher.timeout, dispatcher.fault_hook
        self.failures = BucketFailures(group, next_call(group))
        # Atomic: every bucket works on private copies; the caller's tensors are written at the end.
        strided = prepared.strided
        self.src = [flight.Work(t, private=atomic and self.op is Op.ALL_REDUCE, strided=strided) for t in inputs]
        self.dst = self.src
        if outputs is not None:
            self.dst = [flight.Work(t, private=atomic, fill=False, strided=strided) for t in outputs]
        self.left: dict[int, int] = {}  # per output: buckets not yet finished (for ``done``)
        if done is not None:
            assert not atomic and all(w.tensor.is_contiguous() for w in self.dst), "done needs in-place outputs"
            for bucket in self.plan.buckets:
                for seg in bucket.segments:
                    self.left[seg.tensor] = self.left.get(seg.tensor, 0) + 1

    def buckets(self, meanwhile: Callable[[], None] | None) -> tuple[BucketRecord, ...]:
        records = []
        in_flight: deque[flight.InFlight] = deque()
        failed: BaseException | None = None
        for bucket in self.plan.buckets:
            started = self.start(bucket)
            in_flight.append(started)
            records.append(flight.record(bucket, len(started.handles), started.fallback))
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException as exc:  # noqa: BLE001 - raised below, once nothing is in flight
                    failed = exc
                meanwhile = None
            if len(in_flight) == 2:
                self.finish(in_flight.popleft())
        while in_flight:
            self.finish(in_flight.popleft())
        if failed is not None:
            raise failed
        for work in self.dst:
            work.write_back()
        return tuple(records)

    def start(self, bucket: Bucket) -> flight.InFlight:
        """Issue one bucket. If this rank cannot (the primitive raised before any data moved), the
        ranks settle it through ``failures``: all fall back to one collective per tensor, or all raise."""
        op, world = self.op, self.group.size()
        try:
            if self.fault_hook is not None:
                self.fault_hook(FaultPoint(op.value, bucket.index, bucket.primitive.value, dist.get_rank()))
            channel = self.prepared.channels[bucket.rule]
            return flight.start(op, bucket, channel, self.src, self.dst, self.reduce_op, world)
        except CollgradError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to issue is settled with the other ranks
            why = f"{bucket.primitive.value} raised {type(exc).__name__}: {exc}"
            self.failures.report(bucket.index, why, self.timeout)
            fallback = make_channel(Primitive.PER_TENSOR, self.group, bucket.rule.backend)
            rule = replace(bucket.rule, primitive=Primitive.PER_TENSOR, wire_dtype=bucket.dtype)
            started = flight.start(op, replace(bucket, rule=rule), fallback, self.src, self.dst, self.reduce_op, world)
            started.fallback = f"{bucket.primitive.value} raised on every rank ({type(exc).__name__}: {exc})"
            return started

    def finish(self, started: flight.InFlight) -> None:
        flight.finish(
            started, self.op, self.reduce_op, self.src, self.dst, self.plan, self.timeout, self.group, self.failures
        )
        if self.done is not None:
            for seg in started.bucket.segments:
                self.left[seg.tensor] -= 1
                if not self.left[seg.tensor]:
                    self.done(seg.tensor)


_default: Dispatcher | None = None


def default_dispatcher() -> Dispatcher:
    """The dispatcher behind the module-level functions (its registry reads COLLGRAD_FORCE/FORBID once)."""
    global _default
    if _default is None:
        _default = Dispatcher()
    return _default
