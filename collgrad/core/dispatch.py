"""Runs a plan: copy in, one collective per bucket, copy out; records what it did.

Two buckets are in flight at most: bucket i+1 is packed and issued while bucket i travels, then i
is waited on and unpacked. Memory held beyond the caller's tensors is therefore about two buckets,
and Gloo's two worker threads both have work.
"""

from __future__ import annotations

import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from collgrad import _compat
from collgrad.backends.policy import Policy
from collgrad.backends.registry import Registry
from collgrad.core import planner
from collgrad.backends.agreement import Field, agree_on_call, stable_hash, tell_invalid
from collgrad.core.buffers import adjacent_view
from collgrad.core.failures import BucketFailures, FaultPoint, next_call
from collgrad.backends.ops import Op, Primitive
from collgrad.core.plan import Bucket, BucketRule, Plan, TensorSpec
from collgrad.core.planner import DEFAULT_BUCKET_BYTES
from collgrad.core.primitives import Channel, Handle, make_channel
from collgrad.core.record import BucketRecord, CallRecord, Decision
from collgrad.backends.waits import timeout_from_env
from collgrad.errors import CollgradError, InvalidArgumentError, NoPrimitiveError

__all__ = ["Dispatcher", "Prepared", "default_dispatcher", "checked_bucket_bytes", "policy_print"]


@dataclass
class _InFlight:
    bucket: Bucket
    handles: list[Handle]
    buffers: tuple[Any, ...]
    in_place: bool = False  # the packed buffer *is* the working memory: nothing to unpack
    fallback: str = ""  # why this bucket went per tensor after its primitive raised on every rank


@dataclass(frozen=True)
class Prepared:
    """A bucket plan with what runs it: the channel per rule and the decisions taken. Built once per
    (tensor specs, group, bucket size, policy) and reusable for any tensors of those specs, so callers
    that run the same shapes every step (the full-gradient executors) plan once."""

    plan: Plan
    channels: Mapping[BucketRule, Channel]
    decisions: tuple[Decision, ...]

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
        #: Per model (weakly): gradient sources, layouts and plans, reused while valid (collgrad.grads).
        self.model_cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

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
        with _told_if_invalid(self, group, check, _CALL_NAMES[Op.ALL_REDUCE]):
            tensors = list(tensors)
            for i, t in enumerate(tensors):
                _check_tensor(t, f"tensors[{i}]")
            if op == ReduceOp.AVG:
                for i, t in enumerate(tensors):
                    if not (t.is_floating_point() or t.is_complex()):
                        raise InvalidArgumentError(
                            f"rank {_compat.rank()}: tensors[{i}] is {t.dtype}: ReduceOp.AVG needs floating-point "
                            "tensors"
                        )
            cap = _checked_options(bucket_bytes, policy)
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
        with _told_if_invalid(self, group, check, _CALL_NAMES[Op.ALL_GATHER]):
            outputs, inputs = list(outputs), list(inputs)
            if len(outputs) != len(inputs):
                raise InvalidArgumentError(f"rank {_compat.rank()}: {len(outputs)} outputs for {len(inputs)} inputs")
            world = group.size()
            for i, (out, inp) in enumerate(zip(outputs, inputs)):
                _check_tensor(inp, f"inputs[{i}]")
                _check_tensor(out, f"outputs[{i}]")
                if out.numel() != world * inp.numel() or out.dtype != inp.dtype or out.device != inp.device:
                    raise InvalidArgumentError(
                        f"rank {_compat.rank()}: outputs[{i}] must have world_size * inputs[{i}].numel() = "
                        f"{world * inp.numel()} elements, dtype {inp.dtype} and device {inp.device}; got "
                        f"{out.numel()}, {out.dtype}, {out.device}"
                    )
            cap = _checked_options(bucket_bytes, policy)
        return self._call(Op.ALL_GATHER, inputs, outputs, group, None, cap, policy, atomic, check)

    def _call(self, op, inputs, outputs, group, reduce_op, cap, policy, atomic, check) -> CallRecord:
        """A public call whose arguments this rank found valid: the argument check, then the plan."""
        if check:
            agree_on_call(
                group,
                _call_fields(op, inputs, reduce_op, cap, policy, atomic),
                timeout_s=self.timeout,
                call=_CALL_NAMES[op],
            )
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
    ) -> Prepared:
        """The plan for ``tensors``, the channel per rule, and the decisions taken. Collective the first
        time a (group, device type) is seen (the registry agrees on capabilities), local afterwards."""
        world = group.size()
        cap_bytes = checked_bucket_bytes(bucket_bytes)
        specs = tuple(TensorSpec(t.numel(), t.dtype, str(t.device)) for t in tensors)
        rules: dict[tuple[str, torch.dtype], BucketRule] = {}
        channels: dict[BucketRule, Channel] = {}
        decisions: list[Decision] = []
        for spec in specs:
            key = (spec.device, spec.dtype)
            if key in rules:
                continue
            device_type = torch.device(spec.device).type
            links = self.registry.links(device_type, group, policy)
            choice = links.capabilities.choice(op, spec.dtype)
            if choice.primitive is None:
                raise NoPrimitiveError(
                    f"rank {dist.get_rank()}: no primitive can {op.value} {spec.dtype} tensors on {device_type} "
                    f"in group {list(links.capabilities.group_ranks)} ({choice.why()}); allow one "
                    "(COLLGRAD_FORCE/COLLGRAD_FORBID, policy=) or cast the tensors"
                )
            capacity = planner.bucket_capacity(op, cap_bytes, choice.wire_dtype, world, choice.max_elements)
            rule = BucketRule(choice.primitive, choice.backend, choice.wire_dtype, capacity)
            rules[key] = rule
            channels[rule] = make_channel(choice.primitive, group, choice.backend, self.registry.mpi, links.mpi_comm)
            decisions.append(
                Decision(device_type, spec.dtype, choice.primitive, choice.backend, choice.wire_dtype, choice.why())
            )
        plan = planner.plan_buckets(op, specs, rules, world)
        plan.validate()
        return Prepared(plan, channels, tuple(decisions))

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
        wait, so it overlaps the transfer (views of the outputs, result bookkeeping: measured, 1.5 ms of
        Python between issue and wait adds nothing to a 20 ms Gloo all-gather here, while the same work
        after the wait adds all of it). It must not communicate nor read the outputs' data. If it
        raises, every bucket is still waited for (this rank leaves no collective behind), then its
        error is raised."""
        plan, op = prepared.plan, prepared.plan.op
        assert prepared.fits(inputs), "a prepared plan run on tensors it was not prepared for"
        left: dict[int, int] = {}
        if done is not None:
            assert not atomic and all(t.is_contiguous() for t in (outputs or inputs)), "done needs in-place outputs"
            for bucket in plan.buckets:
                for seg in bucket.segments:
                    left[seg.tensor] = left.get(seg.tensor, 0) + 1

        def finish(flight: _InFlight) -> None:
            _finish(flight, op, reduce_op, src, dst, plan, self.timeout, group, failures)
            if done is not None:
                for seg in flight.bucket.segments:
                    left[seg.tensor] -= 1
                    if not left[seg.tensor]:
                        done(seg.tensor)

        failures = BucketFailures(group, next_call(group))
        with torch.no_grad():
            # Atomic: every bucket works on private copies; the caller's tensors are written at the end.
            src = [_Work(t, private=atomic and op is Op.ALL_REDUCE) for t in inputs]
            dst = src if outputs is None else [_Work(t, private=atomic, fill=False) for t in outputs]
            records = []
            in_flight: deque[_InFlight] = deque()
            failed: BaseException | None = None
            for bucket in plan.buckets:
                channel = prepared.channels[bucket.rule]
                flight = self._start(op, bucket, channel, src, dst, reduce_op, plan, group, failures)
                in_flight.append(flight)
                records.append(_record(bucket, len(flight.handles), flight.fallback))
                if meanwhile is not None:
                    try:
                        meanwhile()
                    except BaseException as exc:  # noqa: BLE001 - raised below, once nothing is in flight
                        failed = exc
                    meanwhile = None
                if len(in_flight) == 2:
                    finish(in_flight.popleft())
            while in_flight:
                finish(in_flight.popleft())
            if failed is not None:
                raise failed
            for work in dst:
                work.write_back()
        return CallRecord(op, tuple(_compat.group_ranks(group)), tuple(records), prepared.decisions)

    def _start(self, op, bucket, channel, src, dst, reduce_op, plan, group, failures) -> _InFlight:
        """Issue one bucket. If this rank cannot (the primitive raised before any data moved), the
        ranks settle it through ``failures``: all fall back to one collective per tensor, or all raise."""
        try:
            if self.fault_hook is not None:
                self.fault_hook(FaultPoint(op.value, bucket.index, bucket.primitive.value, dist.get_rank()))
            return _start_bucket(op, bucket, channel, src, dst, reduce_op, plan.world_size)
        except CollgradError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to issue is settled with the other ranks
            failures.report(bucket.index, f"{bucket.primitive.value} raised {type(exc).__name__}: {exc}", self.timeout)
            fallback = make_channel(Primitive.PER_TENSOR, group, bucket.rule.backend)
            rule = replace(bucket.rule, primitive=Primitive.PER_TENSOR, wire_dtype=bucket.dtype)
            flight = _start_bucket(op, replace(bucket, rule=rule), fallback, src, dst, reduce_op, plan.world_size)
            flight.fallback = f"{bucket.primitive.value} raised on every rank ({type(exc).__name__}: {exc})"
            return flight


_default: Dispatcher | None = None


def default_dispatcher() -> Dispatcher:
    """The dispatcher behind the module-level functions (its registry reads COLLGRAD_FORCE/FORBID once)."""
    global _default
    if _default is None:
        _default = Dispatcher()
    return _default


def checked_bucket_bytes(bucket_bytes: int | None) -> int:
    """The bucket cap in bytes: ``bucket_bytes`` if it is a positive int, the default if None."""
    if bucket_bytes is None:
        return DEFAULT_BUCKET_BYTES
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidArgumentError(f"rank {_compat.rank()}: bucket_bytes must be positive, got {bucket_bytes!r}")
    return bucket_bytes


def policy_print(policy: Policy | None) -> int:
    """The call's ``policy=`` as a number every rank computes alike (names sorted: a frozenset's order
    follows str hashing, which is salted per process)."""
    return stable_hash(None if policy is None else (sorted(policy.force), sorted(policy.forbid)))


def _checked_options(bucket_bytes: int | None, policy: Policy | None) -> int:
    """Checks of the options every public call takes; returns the bucket cap in bytes."""
    cap = checked_bucket_bytes(bucket_bytes)
    if policy is not None:
        policy.validate()
    return cap


_CALL_NAMES = {Op.ALL_REDUCE: "all_reduce_coalesced", Op.ALL_GATHER: "all_gather_coalesced"}


@contextmanager
def _told_if_invalid(dispatcher: Dispatcher, group: ProcessGroup, check: bool, call: str) -> Iterator[None]:
    """Argument checks run inside this: an invalid argument on this rank is told to the other ranks in
    the argument check they are waiting in (so they raise too), then raised here."""
    try:
        yield
    except InvalidArgumentError:
        if check:
            tell_invalid(group, len(_CALL_FIELDS), dispatcher.timeout, call)
        raise


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


def _call_fields(
    op: Op, tensors: Sequence[torch.Tensor], reduce_op: Any, cap: int, policy: Policy | None, atomic: bool
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


def _start_bucket(op, bucket, channel, src, dst, reduce_op, world) -> _InFlight:
    if op is Op.ALL_REDUCE:
        return _start_reduce(bucket, channel, src, reduce_op)
    return _start_gather(bucket, channel, src, dst, world)


def _check_tensor(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"rank {_compat.rank()}: {name} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout is not torch.strided or t.is_meta:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {name}: only dense (strided) tensors with storage can be communicated, "
            f"got {t.layout}"
        )


class _Work:
    """A tensor as the dispatcher sees it: a contiguous flat view, or a contiguous copy that is written
    back once all buckets are done: for strided tensors (never hand a gapped view to a backend) and,
    with ``private``, for every tensor (atomic calls). ``fill``: the copy starts with the tensor's values."""

    def __init__(self, tensor: torch.Tensor, private: bool = False, fill: bool = True) -> None:
        self.tensor = tensor
        self.copied = private or not tensor.is_contiguous()
        if not self.copied:
            self.flat = tensor.view(-1)
        elif fill:  # contiguous() of a strided tensor already copies (reshape could return a gapped view)
            self.flat = tensor.contiguous().view(-1) if not tensor.is_contiguous() else tensor.view(-1).clone()
        else:
            self.flat = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)

    def write_back(self) -> None:
        if self.copied:
            self.tensor.copy_(self.flat.view(self.tensor.shape))


def _wire(op: ReduceOp.RedOpType) -> ReduceOp.RedOpType:
    # AVG travels as SUM and is divided here: torch's MPI backend, oneCCL and mpi4py have no AVG, and one
    # home for the division keeps every primitive's result the same.
    return ReduceOp.SUM if op == ReduceOp.AVG else op


def _segment_views(bucket: Bucket, works: list[_Work]) -> list[torch.Tensor]:
    """The part of its tensor that each segment of ``bucket`` covers (contiguous 1-D views)."""
    return [works[s.tensor].flat[s.tensor_offset : s.tensor_offset + s.numel] for s in bucket.segments]


def _pack(bucket: Bucket, src: list[_Work]) -> tuple[torch.Tensor, bool]:
    """This rank's contribution to a packing primitive as one contiguous buffer.

    A bucket whose pieces already lie back to back in memory, in the wire dtype, is sent as that run
    itself (no copy): a tensor split across buckets, or per-parameter views of one flat buffer
    (DeepSpeed's ZeRO-3 gradient partitions).
    """
    views = _segment_views(bucket, src)
    if bucket.rule.wire_dtype == bucket.dtype:
        run = views[0] if len(views) == 1 else adjacent_view(views)
        if run is not None:
            return run, True
    buf = torch.empty(bucket.numel, dtype=bucket.rule.wire_dtype, device=bucket.device)
    for s, view in zip(bucket.segments, views):
        buf[s.bucket_offset : s.bucket_offset + s.numel].copy_(view)
    return buf, False


def _start_reduce(bucket: Bucket, channel: Channel, src: list[_Work], reduce_op) -> _InFlight:
    if bucket.primitive.packs:
        buf, in_place = _pack(bucket, src)
        return _InFlight(bucket, channel.all_reduce([buf], _wire(reduce_op)), (buf,), in_place)
    views = _segment_views(bucket, src)
    return _InFlight(bucket, channel.all_reduce(views, _wire(reduce_op)), tuple(views))


def _start_gather(bucket: Bucket, channel: Channel, src: list[_Work], dst: list[_Work], world: int) -> _InFlight:
    wire = bucket.rule.wire_dtype
    if bucket.primitive.packs:
        buf, _ = _pack(bucket, src)
        (first,) = bucket.segments[:1]
        if len(bucket.segments) == 1 and first.numel == src[first.tensor].flat.numel() and wire == bucket.dtype:
            out = dst[first.tensor].flat  # the whole tensor in one bucket: gather straight into its output
        else:
            out = torch.empty(world * bucket.numel, dtype=wire, device=bucket.device)
        return _InFlight(bucket, channel.all_gather([out], [buf]), (out,))
    inputs, outputs = _segment_views(bucket, src), []
    for s in bucket.segments:
        whole = s.numel == src[s.tensor].flat.numel()
        outputs.append(dst[s.tensor].flat if whole else torch.empty(world * s.numel, dtype=wire, device=bucket.device))
    return _InFlight(bucket, channel.all_gather(outputs, inputs), tuple(outputs))


def _finish(flight: _InFlight, op: Op, reduce_op, src, dst, plan: Plan, timeout_s: float, group, failures) -> None:
    bucket, world = flight.bucket, plan.world_size
    what = (
        f"{op.value} of bucket {bucket.index} ({bucket.numel} x {bucket.rule.wire_dtype} on {bucket.device}, "
        f"{bucket.primitive.value} over {bucket.rule.backend}, group {_compat.group_ranks(group)})"
    )

    def watch() -> None:  # another rank reported that it cannot send this bucket: stop waiting
        if failures.failed_elsewhere(bucket.index):
            who = failures.acknowledge(bucket.index)
            raise CollgradError(
                f"rank {dist.get_rank()}: {what} cannot complete: {who}, before sending its data. The group is "
                "no longer usable; no output buffer of this call was written. Stop the job and look at that "
                "rank's error."
            )

    for handle in flight.handles:
        # A bucket that already fell back has its failure notices in the store: nothing to watch.
        handle.wait(timeout_s, what, None if flight.fallback else watch)
    if op is Op.ALL_REDUCE:
        if bucket.primitive.packs:
            (buf,) = flight.buffers
            if reduce_op == ReduceOp.AVG:
                buf.div_(world)
            if not flight.in_place:
                for s, view in zip(bucket.segments, _segment_views(bucket, src)):
                    view.copy_(buf[s.bucket_offset : s.bucket_offset + s.numel])
        elif reduce_op == ReduceOp.AVG:
            for view in flight.buffers:
                view.div_(world)
        return
    for i, s in enumerate(bucket.segments):
        target = dst[s.tensor].flat.view(world, -1)[:, s.tensor_offset : s.tensor_offset + s.numel]
        if bucket.primitive.packs:
            (out,) = flight.buffers
            if out is not dst[s.tensor].flat:
                target.copy_(out.view(world, bucket.numel)[:, s.bucket_offset : s.bucket_offset + s.numel])
        elif flight.buffers[i] is not dst[s.tensor].flat:
            target.copy_(flight.buffers[i].view(world, s.numel))


def _record(bucket: Bucket, collectives: int, fallback: str = "") -> BucketRecord:
    wire = bucket.rule.wire_dtype
    return BucketRecord(
        index=bucket.index,
        device=bucket.device,
        dtype=bucket.dtype,
        wire_dtype=wire,
        primitive=Primitive.PER_TENSOR if fallback else bucket.primitive,
        backend=bucket.rule.backend,
        numel=bucket.numel,
        bytes=bucket.numel * torch.empty((), dtype=wire).element_size(),
        tensors=len({s.tensor for s in bucket.segments}),
        collectives=collectives,
        fallback=fallback,
    )
