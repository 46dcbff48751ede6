"""Opening a model-wide call: its arguments checked, the model's gradient source and plans taken from
the cache (or built), this rank's gradients located, and the ranks agreed, before any gradient moves.

    arguments ok?  --no-->  join the argument check with INVALID, raise InvalidArgumentError here
        | yes
    source (cached per model while its buffers stay the same) -> LocalGrads (no communication)
        |
    one small all-gather over the data-parallel group: [readiness, layout fingerprint, plan=,
    bucket_bytes, streaming, policy]  ->  every rank raises the same error, or all go on
        |
    GradPlan + bucket plans (cached with the source: a second call plans nothing)

Every entry point of collgrad.state opens its call here, so they all fail together the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends.agreement import Field, agree_on_call, stable_hash, tell_invalid
from collgrad.backends.decide import Capabilities
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.core.dispatch import Dispatcher, checked_bucket_bytes, default_dispatcher, policy_print
from collgrad.core.record import CallRecord
from collgrad.errors import InvalidArgumentError, LayoutChangedError, NotReadyError
from collgrad.state import adapters
from collgrad.state import whole as whole_mode
from collgrad.state.adapters.base import LocalGrads, Problem, Source
from collgrad.state.cache import ShapePlans
from collgrad.state.kinds import GRAD, StateKind
from collgrad.state.layout import LayoutGroup
from collgrad.state.model_cache import MODELS, Context, ModelCache
from collgrad.state.placements import piece_count, placement_print
from collgrad.state.plan import PLANS, GradCall, GradPlan, PlanKind, Route, needs_capabilities, plan_grads

__all__ = ["OpenCall", "FIELDS", "source_of"]

#: What every rank must pass alike, in the order of the readiness check's row.
FIELDS = (
    "function called",
    "parameter names, shapes, dtypes or subsets (params=)",
    "plan=",
    "bucket_bytes",
    "streaming",
    "policy=",
    "where each rank's gradient pieces lie",  # told, not compared (see OpenCall.placements)
    "how many gradient pieces each rank holds",  # told, not compared (see OpenCall.piece_counts)
)


class OpenCall:
    """One call of a collgrad.state entry point, ready to execute.

    Construction is collective over the model's data-parallel group (one small all-gather); it raises
    on every rank together when any rank's arguments are invalid or different, or when gradients
    cannot be read now. ``extra``: a function of the opened source giving ``EXTRA`` more fields to
    compare (an entry point's own arguments); it may raise InvalidArgumentError. ``meanwhile``: local
    work on this rank's located gradients (it must not communicate), run while the check is in flight
    where this rank can read them; its result is ``early`` (None where it did not run), and it is
    discarded, with the call, if the check fails. It ends after the others may have gone on: it should
    return a failure rather than raise, and the caller tell the others in its next collective (as
    ``safe_get_full_model_grad_stats`` does with a flag), or they wait for this rank until the bounded wait runs out.
    """

    EXTRA = 3

    def __init__(
        self,
        entrance: adapters.Entrance,
        *,
        name: str,
        streaming: bool = False,
        kind: StateKind = GRAD,
        params: Iterable[object] | None = None,
        bucket_bytes: int | None = None,
        plan: str = "auto",
        unscale: bool = False,
        policy: Policy | None = None,
        dispatcher: Dispatcher | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Callable[[Source], Sequence[Field]] | None = None,
        meanwhile: Callable[[OpenCall], Any] | None = None,
        models: ModelCache = MODELS,
        model_parallel: str = whole_mode.LOCAL,
    ) -> None:
        """``entrance``: the model the caller passed, resolved at the public function's entrance
        (``adapters.enter``: once per call, however many sources it opens). ``name``: the public
        function, compared between ranks and named in errors; ``streaming``: results are handed over
        bucket by bucket; ``unscale``: fp16 gradients are divided by the loss scale; ``optimizer``: the
        one holding optimizer states where the model does not; ``model_parallel``: ``"whole"`` makes
        tensor- and expert-parallel shards whole (whole.py), and the ranks agree over every rank of the
        model (``Entrance.model_group``) instead of its data-parallel group."""
        self.name = name
        self.whole = model_parallel == whole_mode.WHOLE
        self.kind: StateKind = kind
        self.models = models
        self.dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
        try:  # every argument is checked before any collective; a rank with bad ones tells the others
            if entrance.error is not None:
                raise entrance.error
            assert entrance.model is not None
            self.model: adapters.Model = entrance.model
            cap = _checked(plan, bucket_bytes, policy)
            whole_mode.checked_mode(model_parallel)
            kind = kind.checked()
            self.source, self.layout_cached = models.source(self.dispatcher, entrance.model, params, kind, optimizer)
            if self.whole:
                whole_mode.refuse_unplaced(self.source)
            extra_fields = list(extra(self.source)) if extra is not None else []
            extra_fields += [Field(f"unused {i}", 0) for i in range(self.EXTRA - len(extra_fields))]
            self.local: LocalGrads = self.source.read()
        except (TypeError, ValueError, KeyError):  # InvalidArgumentError, and the adapter's own checks
            _tell_invalid(entrance.model_group if self.whole else entrance.group, self.dispatcher.timeout, name)
            raise
        #: The ranks that agree before anything moves: every rank that takes part in the call's collectives.
        self.agree_group = entrance.model_group if self.whole else self.source.control_group
        self.call = GradCall(plan, cap, streaming)
        self.policy = policy
        #: This call shape's plans, kept with the source (see cache.py).
        self.plans: ShapePlans = self.source.plans.shape(self.call, policy)
        self.unscale = unscale and self.local.loss_scale != 1.0
        #: What ``meanwhile`` returned, computed while the ranks were agreeing.
        self.early: Any = None

        def early() -> None:
            if meanwhile is not None and self.local.problem is Problem.OK:
                self.early = meanwhile(self)

        rows = _agree(self.agree_group, self.local, _fields(self) + extra_fields, self.dispatcher, name, early)
        #: Every rank's print of where its gradient pieces lie (its storage order), and how many pieces
        #: it holds, by global rank: a gather of partitions as they lie checks the print against what it
        #: cached, and sizes a placements exchange by the counts (no extra collective for either).
        self.placements: dict[int, int] = {}
        self.piece_counts: dict[int, int] = {}
        #: Every rank's ``extra`` fields as it told them (in the control group's order; none without a
        #: group): what an entry point compares itself where a field may differ (``compare=False``).
        self.extras: list[list[int]] = [row[1 + len(FIELDS) :] for row in rows] if rows is not None else []
        if rows is not None and self.agree_group is not None:
            ranks = _compat.group_ranks(self.agree_group)
            at = 1 + FIELDS.index("where each rank's gradient pieces lie")
            self.placements = dict(zip(ranks, (r[at] for r in rows)))
            self.piece_counts = dict(zip(ranks, (r[at + 1] for r in rows)))
        #: Nothing was planned for this call so far: everything came from the cache.
        self.cached = True

    @property
    def plan(self) -> GradPlan:
        """The GradPlan of this call, built on first use and cached with the source (asking the registry
        for capabilities, collective the first time, only for groups whose plan depends on them)."""
        if self.plans.gradient_plan is None:
            self.cached = False
            accessor = self.source.accessor is not None
            gather_ok = {}
            for i, group in enumerate(self.source.layout.groups):
                if needs_capabilities(group, self.call, accessor):  # collective on first use: only if needed
                    found = self.primitive(group, Op.ALL_GATHER, group.wire_dtype)
                    gather_ok[i] = found not in (None, Primitive.PER_TENSOR)
            layout = self.source.layout
            ranks = {i: adapters.rank_in(g) for i, g in enumerate(layout.groups)}
            self.plans.gradient_plan = plan_grads(layout, self.call, gather_ok, accessor, self._route, ranks)
        return self.plans.gradient_plan

    def _route(self, index: int, kind: PlanKind) -> Route:
        """How group ``index``'s collectives of ``kind`` run under this call's policy, from the agreed
        capabilities (collective the first time, on every rank alike)."""
        group = self.source.layout.groups[index]
        if kind is PlanKind.ALL_REDUCE:
            return Route(per_tensor=self.primitive(group, Op.ALL_REDUCE, group.out_dtype) is Primitive.PER_TENSOR)
        dtype = group.wire_dtype
        primitive = self.primitive(group, Op.ALL_GATHER, dtype)
        return Route(
            coalesced=primitive is Primitive.COALESCED,
            laid_out_by_backend=primitive is Primitive.FLAT and self.capabilities(group).strided_gather(dtype),
        )

    def primitive(self, group: LayoutGroup, op: Op, dtype: torch.dtype) -> Primitive | None:
        """The registry's choice of primitive for ``op`` on ``dtype`` over ``group``, under this call's
        policy. Asked once (collective the first time, on every rank alike), cached with the source."""
        key = (group.index, op, dtype)
        if key not in self.plans.primitives:
            self.plans.primitives[key] = self.capabilities(group).choice(op, dtype).primitive
        return self.plans.primitives[key]

    def capabilities(self, group: LayoutGroup) -> Capabilities:
        """What the registry agreed ``group`` can run, under this call's policy (the same on every
        rank; collective the first time, cached by the registry)."""
        return self.dispatcher.registry.capabilities(
            self.source.device.type, self.source.groups.get(group.index), self.policy
        )

    def run(
        self,
        step: Hashable,
        op: Op,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor] | None,
        group: ProcessGroup | None,
        *,
        bucket_bytes: int | None = None,
        done: Callable[[int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
        strided: bool = False,
        whole: bool = False,
    ) -> CallRecord:
        """One dispatcher call for ``step`` of this call, through its cached bucket plan (buckets of
        ``bucket_bytes``, default the call's). Not atomic and not re-checked: the tensors are collgrad's
        own buffers, and the ranks agreed when the call opened. ``done``, ``meanwhile``, ``strided``,
        ``whole``: see ``Dispatcher.run`` and ``Dispatcher.prepare``."""
        group = _compat.default_group() if group is None else group
        cap = self.call.bucket_bytes if bucket_bytes is None else bucket_bytes
        key = (self.name, step, cap, strided, whole)
        prepared = self.plans.bucket_plans.get(key)
        if prepared is None:  # the tensors of a step have the same specs every call (from the layout)
            self.cached = False
            prepared = self.dispatcher.prepare(
                op, inputs, group, bucket_bytes=cap, policy=self.policy, strided=strided, whole=whole
            )
            self.plans.bucket_plans[key] = prepared
        return self.dispatcher.run(prepared, inputs, outputs, group, atomic=False, done=done, meanwhile=meanwhile)


def _checked(plan: str, bucket_bytes: int | None, policy: Policy | None) -> int:
    """The call's own arguments checked on this rank (InvalidArgumentError); returns the bucket cap."""
    if plan not in PLANS:
        raise InvalidArgumentError(f"rank {_compat.rank()}: plan must be one of {PLANS}, got {plan!r}")
    cap = checked_bucket_bytes(bucket_bytes)
    if policy is not None:
        policy.validate()
    return cap


def _fields(call: OpenCall) -> list[Field]:
    """This rank's row of the readiness check (see ``FIELDS``)."""
    layout, buffers = call.source.layout, call.local.buffers
    # whole: the unsharded model's tensors, the same on every rank of the model (shards' layouts differ)
    layout_print = whole_mode.fingerprint(call.source) if call.whole else call.source.fingerprint
    return [
        Field(FIELDS[0], stable_hash((call.name, call.whole)), shown=False),
        Field(FIELDS[1], layout_print, shown=False),
        Field(FIELDS[2], PLANS.index(call.call.plan), shown=False),
        Field(FIELDS[3], call.call.bucket_bytes),
        Field(FIELDS[4], int(call.call.streaming)),
        Field(FIELDS[5], policy_print(call.policy), shown=False),
        Field(FIELDS[6], placement_print(layout, call.source.plans, buffers), compare=False),
        Field(FIELDS[7], piece_count(layout, buffers), compare=False),
    ]


def _agree(
    group: ProcessGroup | None,
    local: LocalGrads,
    fields: list[Field],
    dispatcher: Dispatcher,
    name: str,
    meanwhile: Callable[[], None],
) -> list[list[int]] | None:
    """Every rank of ``group`` (the call's: its model's data-parallel group, or every rank of the model)
    learns every rank's readiness and arguments, and all raise the same error if any rank cannot read
    now or asked for something else; ``meanwhile`` runs while the exchange is in flight. Returns every
    rank's row."""
    rank = _compat.rank()
    if group is None:
        if local.problem is not Problem.OK:
            raise NotReadyError(f"rank {rank}: {local.problem.describe()}")
        meanwhile()
        return None
    rows = agree_on_call(
        group,
        fields,
        timeout_s=dispatcher.timeout,
        call=name,
        status=int(local.problem),
        meanwhile=meanwhile,
        hook_failures=dispatcher.hook_failures,
    )
    ranks = _compat.group_ranks(group)
    bad = [(ranks[i], Problem(row[0])) for i, row in enumerate(rows) if row[0] != Problem.OK]
    if bad:
        detail = "; ".join(f"rank {r}: {p.describe()}" for r, p in bad)
        if local.detail:
            detail += f"; here: {local.detail}"
        error = LayoutChangedError if any(p is Problem.LAYOUT_CHANGED for _, p in bad) else NotReadyError
        raise error(f"full gradients cannot be read now ({detail}) [seen by rank {rank}]")
    return rows


def _tell_invalid(group: ProcessGroup | None, timeout_s: float, name: str) -> None:
    """This rank's arguments are invalid: take part in the readiness check with that verdict, so ranks
    whose arguments were fine raise too instead of waiting; the caller then re-raises its own error.
    ``group``: the model's (the default group where what was passed is no model)."""
    if group is not None:
        tell_invalid(group, len(FIELDS) + OpenCall.EXTRA, timeout_s, name)


def source_of(
    model: object,
    kind: StateKind = GRAD,
    optimizer: torch.optim.Optimizer | None = None,
    params: Iterable[object] | None = None,
    *,
    dispatcher: Dispatcher,
) -> tuple[Source, bool]:
    """The cached Source of ``kind`` of ``model``'s trainable parameters (``params``: that selection),
    and whether it came from the cache, opened under ``dispatcher`` in the default cache (as the public
    functions open it). ``model``: what a caller passed, or the ``Model`` it resolved. Local."""
    resolved = model if isinstance(model, adapters.Model) else adapters.resolve(model)
    return Context(dispatcher).source(resolved, kind, optimizer, params)
