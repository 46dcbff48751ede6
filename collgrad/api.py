"""Model-wide entry points: the full gradient of every parameter, one collective per bucket.

For each gradient group of the model (see sources/layout.py) one of these plans runs:

  local       nothing to communicate: every rank holds the full reduced gradients (BF16_Optimizer,
              no ZeRO), or the group has a single rank (expert-parallel experts, AutoTP shards).
  all_gather  ranks own equal contiguous partitions (ZeRO-1/2 flat groups, ZeRO-3 per-parameter
              partitions): every rank contributes its partition as it lies, and gathers the rest.
              Half the bytes of an all-reduce, and no zero fill.
  all_reduce  zero-padded: every rank writes the elements it owns into a zeroed buffer and the group
              sums it. Adding zeros is exact, so the result is bitwise what DeepSpeed's
              ``safe_get_full_grad`` returns (it does the same, one parameter at a time).
  per_param   DeepSpeed's own accessor, one collective per parameter: optimizers whose layout
              collgrad does not know.

``auto`` takes ``all_gather`` where the group's backend has a bucket primitive for it and the call
reads most of the group, else ``all_reduce``; streaming (``iter_full_model_grads``) takes
``all_reduce`` for ZeRO-1/2 (a bucket of whole parameters is then complete by itself).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.distributed import ProcessGroup

from collgrad import _compat, sources
from collgrad.agreement import exchange
from collgrad.backends.base import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.dispatch import Dispatcher
from collgrad.errors import CollgradError
from collgrad.planner import DEFAULT_BUCKET_BYTES
from collgrad.record import CallRecord
from collgrad.sources import LocalGrads, Problem, Source
from collgrad.buffers import Pieces
from collgrad.sources.layout import Fragment, GradGroup, Kind, ParamSlot, owned_fragments

__all__ = ["safe_get_full_model_grads", "iter_full_model_grads", "FullGrads", "GroupRecord", "FullGradRecord", "PLANS"]

PLANS = ("auto", "all_gather", "all_reduce")


@dataclass(frozen=True)
class GroupRecord:
    group: int
    kind: str
    plan: str
    ranks: tuple[int, ...]
    params: int
    calls: tuple[CallRecord, ...]

    @property
    def collectives(self) -> int:
        return sum(c.collectives for c in self.calls)


@dataclass(frozen=True)
class FullGradRecord:
    """What a full-gradient call did: per gradient group, the plan and the collectives' records."""

    variant: str
    groups: tuple[GroupRecord, ...]
    per_param_collectives: int
    loss_scale: float
    unscaled: bool
    plan_cached: bool  # the layout and plans were reused from an earlier call (no planning work)

    @property
    def collectives(self) -> int:
        return self.per_param_collectives + sum(g.collectives for g in self.groups)

    @property
    def buckets(self) -> int:
        return sum(len(c.buckets) for g in self.groups for c in g.calls)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for g in self.groups for c in g.calls)


class FullGrads(dict):
    """``dict[name, Tensor]`` of full gradients, plus ``record`` (what was done) and
    ``model_parallel`` (names of tensor- or expert-parallel shards: full across the data-parallel
    group, still local across tensor/expert-parallel ranks)."""

    record: FullGradRecord
    model_parallel: frozenset[str]


def safe_get_full_model_grads(
    model: Any,
    *,
    params: Iterable[Any] | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    unscale: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
) -> FullGrads:
    """The full, reduced gradient of every trainable parameter of ``model``, in one collective per
    bucket.

    ``model`` is a DeepSpeed engine, the module it wraps, or a plain module whose ``.grad`` is already
    reduced. Keys are ``named_parameters()`` names (tied parameters once), in that order; values are
    shaped like the parameter, in the dtype and on the device ``deepspeed.utils.safe_get_full_grad``
    returns, and for fp32 and bf16 with fp32 accumulation bitwise equal to it. fp16 gradients are
    divided by the current loss scale unless ``unscale=False``. ``params`` (names or parameters)
    limits the call to a subset.

    When and where: on every rank of the data-parallel group, after ``engine.backward()`` of the last
    micro-step of an accumulation boundary and before ``engine.step()``, with the same ``params`` on
    every rank. Otherwise every rank raises the same CollgradError before any gradient moves. The
    engine is not modified.
    """
    stream = _Stream(model, params, bucket_bytes, plan, unscale, policy, dispatcher, streaming=False)
    grads = FullGrads()
    found = {}
    for results in stream.steps():
        found.update(results)
    for name in stream.source.layout.order:
        if name in found:
            grads[name] = found[name]
    grads.record = stream.record()
    grads.model_parallel = stream.source.model_parallel
    return grads


def iter_full_model_grads(
    model: Any,
    *,
    params: Iterable[Any] | None = None,
    bucket_bytes: int | None = None,
    plan: str = "auto",
    unscale: bool = True,
    policy: Policy | None = None,
    dispatcher: Dispatcher | None = None,
) -> "_Stream":
    """The same gradients as ``safe_get_full_model_grads``, as ``(name, tensor)`` pairs streamed one
    bucket of whole parameters at a time (in bucket order), so that collgrad holds about two buckets
    at a time whatever the model size (a parameter larger than a bucket is one bucket by itself).

    Same calling rules, plus: every rank must consume the whole iteration (each bucket is a
    collective); a rank that stops early leaves the others waiting. The returned object's
    ``record()`` tells what was done so far.
    """
    return _Stream(model, params, bucket_bytes, plan, unscale, policy, dispatcher, streaming=True)


class _Stream:
    def __init__(self, model, params, bucket_bytes, plan, unscale, policy, dispatcher, *, streaming: bool) -> None:
        self.dispatcher = dispatcher if dispatcher is not None else _default_dispatcher()
        try:  # arguments are checked on every rank, and a rank with bad ones tells the others (below)
            if plan not in PLANS:
                raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
            if bucket_bytes is not None and int(bucket_bytes) <= 0:
                raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
            if policy is not None:
                policy.validate()
            self.source, self.cached = _source(self.dispatcher, model, params)
            if not self.source.layout.order:
                raise ValueError("no trainable parameter is selected (an empty model, or an empty params=)")
            self.local: LocalGrads = self.source.read()
        except (TypeError, ValueError, KeyError):
            _agree_on_bad_arguments(model, self.dispatcher.timeout)
            raise
        self.bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else int(bucket_bytes)
        self.plan = plan
        self.unscale = unscale and self.local.loss_scale != 1.0
        self.policy = policy
        self.streaming = streaming
        self.group_records: list[GroupRecord] = []
        self.per_param_collectives = 0
        # What every rank must also pass alike: it decides the number and size of collectives.
        forced = None if policy is None else (sorted(policy.force), sorted(policy.forbid))  # sets: sort for a stable repr
        self.call_print = zlib.crc32(repr((plan, self.bucket_bytes, streaming, forced)).encode())
        _agree(self.source, self.local, self.dispatcher.timeout, self.call_print)
        self._iter = self._generate()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iter

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._iter)

    def record(self) -> FullGradRecord:
        return FullGradRecord(self.source.layout.variant, tuple(self.group_records), self.per_param_collectives,
                              self.local.loss_scale, self.unscale, self.cached)

    # -- execution ------------------------------------------------------------------------------------
    def _finish(self, grad: torch.Tensor, slot: ParamSlot, out_dtype: torch.dtype) -> torch.Tensor:
        grad = grad.view(slot.shape)
        if grad.dtype is not out_dtype:
            grad = grad.to(out_dtype)
        if self.unscale:
            grad = grad.div_(self.local.loss_scale)
        return grad

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        for results in self.steps():
            results.reverse()
            while results:  # hand each tensor over and keep no reference: ~2 buckets alive at most
                yield results.pop()

    def steps(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The results one step (one bucket, or one whole group) at a time."""
        source, local = self.source, self.local
        if source.per_param is not None:
            for name in source.layout.order:
                grad = source.per_param(source.params[name])
                self.per_param_collectives += 1
                if self.unscale:
                    grad = grad / local.loss_scale
                yield [(name, grad)]
            return
        for group, buffer in zip(source.layout.groups, local.buffers):
            pg = source.groups.get(group.index)
            plan = self._choose(group, pg)
            calls: list[CallRecord] = []
            self.group_records.append(GroupRecord(group.index, group.kind.value, plan, group.group_ranks,
                                                  len(group.params), ()))
            for batch in self._batches(group, plan):
                if plan == "local":
                    results = list(self._local(group, buffer, batch))
                elif plan == "all_gather":
                    results = list(self._all_gather(group, buffer, batch, pg, calls))
                else:
                    results = list(self._all_reduce(group, buffer, batch, pg, calls))
                self.group_records[-1] = GroupRecord(group.index, group.kind.value, plan, group.group_ranks,
                                                     len(group.params), tuple(calls))
                yield results
                del results

    def _choose(self, group: GradGroup, pg: ProcessGroup | None) -> str:
        """The plan for one group: a function of the layout and the agreed capabilities only, so every
        rank of the group takes the same one."""
        if group.kind is Kind.REPLICATED or group.world == 1:
            return "local"
        if self.plan != "auto":
            return self.plan
        if self.streaming and group.kind is Kind.PARTITIONED_FLAT:
            return "all_reduce"
        device_type = self.source.device.type
        caps = self.dispatcher.registry.capabilities(device_type, pg, self.policy)
        choice = caps.choice(Op.ALL_GATHER, group.wire_dtype)
        if choice.primitive in (None, Primitive.PER_TENSOR):
            return "all_reduce"
        if group.kind is Kind.PARTITIONED_FLAT:
            wanted = sum(p.numel for p in group.params)
            if 2 * wanted < group.world * group.partition_numel:  # a small subset: gather less
                return "all_reduce"
        return "all_gather"

    def _batches(self, group: GradGroup, plan: str) -> list[list[int]]:
        """Indices of ``group.params`` per step, whole parameters each.

        ZeRO-3 all-gathers go by buckets of gathered bytes (the staging buffer is one bucket); when
        streaming, each step's staging and results together stay within a bucket. Streamed all-reduces
        go by buckets of result bytes. Everything else is one step.
        """
        everything = list(range(len(group.params)))
        per_param_gather = plan == "all_gather" and group.kind is Kind.PER_PARAM
        if plan == "local" or not (self.streaming or per_param_gather) or (
            plan == "all_gather" and group.kind is Kind.PARTITIONED_FLAT
        ):
            return [everything] if everything else []
        itemsize = torch.empty((), dtype=group.out_dtype).element_size()
        budget = self.bucket_bytes // 2 if (self.streaming and per_param_gather) else self.bucket_bytes
        batches, current, size = [], [], 0
        for k, p in enumerate(group.params):
            numel = p.slice_numel * group.world if per_param_gather else p.numel
            if current and (size + numel) * itemsize > budget:
                batches.append(current)
                current, size = [], 0
            current.append(k)
            size += numel
        if current:
            batches.append(current)
        return batches

    def _local(self, group, buffer, batch):
        if group.kind is Kind.REPLICATED:
            for k in batch:
                slot = group.params[k]
                yield slot.name, self._finish(buffer[k].detach().clone(), slot, group.out_dtype)
            return
        for frag in owned_fragments(group, 0):  # a group of one rank owns everything
            if frag.param in batch:
                slot = group.params[frag.param]
                piece = buffer.range(frag.local_offset, frag.numel).to(self.source.device, copy=True)
                yield slot.name, self._finish(piece, slot, group.out_dtype)

    def _all_gather(self, group, buffer, batch, pg, calls):
        device, world = self.source.device, group.world
        if group.kind is Kind.PARTITIONED_FLAT:
            full = torch.empty(world * group.partition_numel, dtype=group.wire_dtype, device=device)
            calls.append(self.dispatcher.all_gather([full], [buffer.whole().to(device)], pg, atomic=False,
                                                    bucket_bytes=self.bucket_bytes, policy=self.policy))
            slots = [group.params[k] for k in batch]
            # One split of the gathered flat group into [gap, param, gap, param, ...] (C++), then views.
            sizes, at = [], 0
            for s in slots:
                sizes += [s.offset - at, s.numel]
                at = s.offset + s.numel
            sizes.append(full.numel() - at)
            pieces = full.split(sizes)
            for s, piece in zip(slots, pieces[1::2]):
                yield s.name, self._finish(piece, s, group.out_dtype)
            return
        # ZeRO-3: gather this batch's slices, rank-major, into a staging buffer kept between calls, then
        # lay each parameter's slices end to end (the copy a rank-major gather always needs).
        slots = [group.params[k] for k in batch]
        lo = slots[0].offset
        span = slots[-1].offset + slots[-1].slice_numel - lo
        local = buffer.range(lo, span).to(device)  # a view of DeepSpeed's flat buffer, or one move
        staging = self._staging(group.wire_dtype, device, world * span)
        calls.append(self.dispatcher.all_gather([staging], [local], pg, atomic=False, bucket_bytes=self.bucket_bytes,
                                                policy=self.policy))
        sizes = [s.slice_numel for s in slots]
        result = torch.empty(world * span, dtype=group.wire_dtype, device=device)
        for s, src, dst in zip(slots, staging.view(world, span).split(sizes, dim=1), result.split([world * n for n in sizes])):
            dst.view(world, s.slice_numel).copy_(src)
            yield s.name, self._finish(dst[: s.numel], s, group.out_dtype)

    def _staging(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """Scratch for gathered slices, reused across calls (never returned: results are copies).
        At most one bucket, or one parameter's gathered size where that is larger."""
        key = (dtype, device)
        cache = self.source.scratch
        found = cache.get(key)
        if found is None or found.numel() < numel:
            found = cache[key] = torch.empty(numel, dtype=dtype, device=device)
        return found[:numel]

    def _all_reduce(self, group, buffer, batch, pg, calls):
        device = self.source.device
        slots = {k: group.params[k] for k in batch}
        starts, total = {}, 0
        for k in batch:
            starts[k] = total
            total += slots[k].numel
        result = torch.zeros(total, dtype=group.out_dtype, device=device)
        rank = group.group_ranks.index(torch.distributed.get_rank())
        mine = [f for f in owned_fragments(group, rank) if f.param in slots]
        if mine and buffer.device != device:  # offloaded: this rank's part moves once per bucket
            lo = min(f.local_offset for f in mine)
            moved = Pieces([buffer.range(lo, max(f.local_offset + f.numel for f in mine) - lo).to(device)])
            mine = [Fragment(f.param, f.param_offset, f.local_offset - lo, f.numel) for f in mine]
            buffer = moved
        for frag in mine:  # straight from where each fragment lies into the zeroed bucket
            at = starts[frag.param] + frag.param_offset
            result[at : at + frag.numel].copy_(buffer.range(frag.local_offset, frag.numel))
        # One tensor per parameter, back to back in ``result``: bucket primitives send them as one run
        # without copying, the per-tensor fallback sends one collective per parameter.
        views = [result[starts[k] : starts[k] + slots[k].numel] for k in batch]
        # Not atomic: these are collgrad's own buffers, returned only if the whole call succeeds.
        calls.append(self.dispatcher.all_reduce(views, pg, atomic=False, bucket_bytes=self.bucket_bytes,
                                                policy=self.policy))
        for k, view in zip(batch, views):
            yield slots[k].name, self._finish(view, slots[k], group.out_dtype)


_READINESS = "the readiness check of safe_get_full_model_grads"


def _agree(source: Source, local: LocalGrads, timeout_s: float, call_print: int = 0) -> None:
    """Every rank of the control group learns every rank's problem and layout fingerprint, and all raise
    the same error if any rank cannot read now or planned something else."""
    rank = _compat.rank()
    if source.control_group is None:
        if local.problem is not Problem.OK:
            raise CollgradError(f"rank {rank}: {local.problem.describe()}")
        return
    rows = exchange(source.control_group, [int(local.problem), source.fingerprint ^ call_print], timeout_s=timeout_s,
                    what=_READINESS)
    ranks = _compat.group_ranks(source.control_group)
    invalid = [ranks[i] for i, row in enumerate(rows) if row[0] == Problem.INVALID_ARGUMENTS]
    if invalid:
        raise CollgradError(
            f"rank(s) {invalid} passed invalid arguments to safe_get_full_model_grads (their own errors say "
            f"which) [seen by rank {rank}]"
        )
    bad = [(ranks[i], Problem(row[0])) for i, row in enumerate(rows) if row[0] != Problem.OK]
    if bad:
        detail = "; ".join(f"rank {r}: {p.describe()}" for r, p in bad)
        raise CollgradError(f"full gradients cannot be read now ({detail}) [seen by rank {rank}]")
    prints = [row[1] for row in rows]
    if len(set(prints)) != 1:
        groups: dict[int, list[int]] = {}
        for i, fp in enumerate(prints):
            groups.setdefault(fp, []).append(ranks[i])
        raise CollgradError(
            f"ranks asked for different gradients (parameter names, shapes, dtypes or subsets, or plan=, "
            f"bucket_bytes=, policy=, or one streaming and one not, differ; "
            f"ranks grouped by what they asked: {sorted(groups.values())}) [seen by rank {rank}]: pass the "
            "same params=, in the same order, on every rank"
        )


def _agree_on_bad_arguments(model: Any, timeout_s: float) -> None:
    """This rank's arguments are invalid: take part in the readiness check with that verdict, so ranks
    whose arguments were fine raise too instead of waiting; the caller then re-raises its own error."""
    try:
        group = sources.control_group_of(model)
    except Exception:  # noqa: BLE001 - the argument error is the one to report
        group = _compat.default_group() if torch.distributed.is_initialized() else None
    if group is None:
        return
    try:
        exchange(group, [int(Problem.INVALID_ARGUMENTS), 0], timeout_s=timeout_s, what=_READINESS)
    except CollgradError:
        pass  # the others are not in this check (a wait bounded by the timeout); this rank's error stands


def _source(dispatcher: Dispatcher, model: Any, params: Iterable[Any] | None) -> tuple[Source, bool]:
    """The cached Source of ``model`` for this ``params`` selection if its layout still holds, else a
    new one. Cached on the dispatcher, weakly per model: released with the model."""
    params = None if params is None else list(params)
    key = None if params is None else tuple(p if isinstance(p, str) else id(p) for p in params)
    try:
        per_model = dispatcher.model_cache.setdefault(model, {})
    except TypeError:  # not weakly referenceable, so not a model: let open_source say what is wrong
        return sources.open_source(model, params), False
    source = per_model.get(key)
    if source is not None and source.valid():
        return source, True
    source = sources.open_source(model, params)
    per_model[key] = source
    return source, False


def _default_dispatcher() -> Dispatcher:
    from collgrad import default_dispatcher

    return default_dispatcher()
