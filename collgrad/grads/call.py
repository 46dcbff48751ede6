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

Every entry point of collgrad.grads opens its call here, so they all fail together the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.backends.decide import Capabilities
from collgrad.backends.policy import Policy
from collgrad.backends.agreement import Field, agree_on_call, stable_hash, tell_invalid
from collgrad.core.buffers import Pieces
from collgrad.core.dispatch import Dispatcher, Prepared, checked_bucket_bytes, default_dispatcher, policy_print
from collgrad.backends.ops import Op, Primitive
from collgrad.core.record import CallRecord
from collgrad.errors import InvalidArgumentError, LayoutChangedError, NotReadyError
from collgrad.grads import sources
from collgrad.grads.plan import PLANS, GradCall, GradPlan, needs_capabilities, plan_grads
from collgrad.grads.sources import LocalGrads, Problem, Source
from collgrad.grads.sources.layout import GradGroup, Kind

__all__ = ["OpenCall", "FIELDS"]

#: What every rank must pass alike, in the order of the readiness check's row.
FIELDS = (
    "function called",
    "parameter names, shapes, dtypes or subsets (params=)",
    "plan=",
    "bucket_bytes",
    "streaming",
    "policy=",
    "where each rank's gradient pieces lie",  # told, not compared (see OpenCall.placements)
)


class OpenCall:
    """One call of a collgrad.grads entry point, ready to execute.

    Construction is collective over the model's data-parallel group (one small all-gather); it raises
    on every rank together when any rank's arguments are invalid or different, or when gradients
    cannot be read now. ``extra``: a function of the opened source giving ``EXTRA`` more fields to
    compare (an entry point's own arguments); it may raise InvalidArgumentError. ``meanwhile``: local
    work on this rank's located gradients (it must not communicate), run while the check is in flight
    where this rank can read them; its result is ``early`` (None where it did not run), and it is
    discarded, with the call, if the check fails. It ends after the others may have gone on: it should
    return a failure rather than raise, and the caller tell the others in its next collective (as
    ``model_grad_stats`` does with a flag), or they wait for this rank until the bounded wait runs out.
    """

    EXTRA = 2

    def __init__(
        self,
        model: Any,
        params: Iterable[Any] | None,
        bucket_bytes: int | None,
        plan: str,
        unscale: bool,
        policy: Policy | None,
        dispatcher: Dispatcher | None,
        *,
        streaming: bool,
        name: str,
        extra: Callable[[Source], Sequence[Field]] | None = None,
        meanwhile: Callable[[OpenCall], Any] | None = None,
    ) -> None:
        self.name = name
        self.dispatcher = dispatcher if dispatcher is not None else default_dispatcher()
        try:  # every argument is checked before any collective; a rank with bad ones tells the others
            if plan not in PLANS:
                raise InvalidArgumentError(f"rank {_compat.rank()}: plan must be one of {PLANS}, got {plan!r}")
            cap = checked_bucket_bytes(bucket_bytes)
            if policy is not None:
                policy.validate()
            self.source, self.layout_cached = _source(self.dispatcher, model, params)
            if not self.source.layout.order:
                raise InvalidArgumentError(
                    f"rank {_compat.rank()}: no trainable parameter is selected (an empty model, or an empty params=)"
                )
            extra_fields = list(extra(self.source)) if extra is not None else []
            extra_fields += [Field(f"unused {i}", 0) for i in range(self.EXTRA - len(extra_fields))]
            self.local: LocalGrads = self.source.read()
        except (TypeError, ValueError, KeyError):  # InvalidArgumentError, and the adapter's own checks
            _tell_invalid(model, self.dispatcher.timeout, name)
            raise
        self.call = GradCall(plan, cap, streaming)
        self.policy = policy
        self.unscale = unscale and self.local.loss_scale != 1.0
        #: What ``meanwhile`` returned, computed while the ranks were agreeing.
        self.early: Any = None

        def early() -> None:
            if meanwhile is not None and self.local.problem is Problem.OK:
                self.early = meanwhile(self)

        rows = _agree(self.source, self.local, self._fields() + extra_fields, self.dispatcher.timeout, name, early)
        #: Every rank's print of where its gradient pieces lie (its storage order), by global rank: a
        #: gather of partitions as they lie checks it against what it cached (no extra collective).
        self.placements: dict[int, int] = {}
        if rows is not None:
            at = 1 + FIELDS.index("where each rank's gradient pieces lie")
            self.placements = dict(zip(_compat.group_ranks(self.source.control_group), (r[at] for r in rows)))
        #: Nothing was planned for this call so far: everything came from the cache.
        self.cached = True
        self._plan: GradPlan | None = None

    def _fields(self) -> list[Field]:
        return [
            Field(FIELDS[0], stable_hash(self.name), shown=False),
            Field(FIELDS[1], self.source.fingerprint, shown=False),
            Field(FIELDS[2], PLANS.index(self.call.plan), shown=False),
            Field(FIELDS[3], self.call.bucket_bytes),
            Field(FIELDS[4], int(self.call.streaming)),
            Field(FIELDS[5], policy_print(self.policy), shown=False),
            Field(FIELDS[6], _placement_print(self.source, self.local), compare=False),
        ]

    @property
    def plan(self) -> GradPlan:
        """The GradPlan of this call, built on first use and cached with the source (asking the registry
        for capabilities, collective the first time, only for groups whose plan depends on them)."""
        if self._plan is None:
            key = ("gradient plan", self.call, self.policy)
            found = self.source.plans.get(key)
            if found is None:
                self.cached = False
                found = self.source.plans[key] = self._build_plan()
            self._plan = found
        return self._plan

    def _build_plan(self) -> GradPlan:
        layout = self.source.layout
        per_param = self.source.per_param is not None
        gather_ok = {}
        for i, group in enumerate(layout.groups):
            if needs_capabilities(group, self.call, per_param):  # collective on first use: only if needed
                gather_ok[i] = self.primitive(group, Op.ALL_GATHER, group.wire_dtype) not in (
                    None,
                    Primitive.PER_TENSOR,
                )
        return plan_grads(layout, self.call, gather_ok, per_param)

    def primitive(self, group: GradGroup, op: Op, dtype: torch.dtype) -> Primitive | None:
        """The registry's choice of primitive for ``op`` on ``dtype`` over ``group``, under this call's
        policy. Asked once (collective the first time, on every rank alike), cached with the source."""
        key = ("primitive", group.index, op, dtype, self.policy)
        found = self.source.plans.get(key, False)
        if found is False:
            found = self.source.plans[key] = self.capabilities(group).choice(op, dtype).primitive
        return found

    def capabilities(self, group: GradGroup) -> Capabilities:
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
    ) -> CallRecord:
        """One dispatcher call for ``step`` of this call, through its cached bucket plan (buckets of
        ``bucket_bytes``, default the call's). Not atomic and not re-checked: the tensors are collgrad's
        own buffers, and the ranks agreed when the call opened. ``done``, ``meanwhile``: see
        ``Dispatcher.run``."""
        group = _compat.default_group() if group is None else group
        cap = self.call.bucket_bytes if bucket_bytes is None else bucket_bytes
        prepared = self._prepared(step, op, inputs, group, cap)
        return self.dispatcher.run(prepared, inputs, outputs, group, atomic=False, done=done, meanwhile=meanwhile)

    def _prepared(
        self, step: Hashable, op: Op, tensors: Sequence[torch.Tensor], group: ProcessGroup, cap: int
    ) -> Prepared:
        """The dispatcher's bucket plan for one step of this call, built once and cached with the source
        (the tensors of a step have the same specs every call: they come from the layout)."""
        key = ("bucket plan", self.name, self.call, self.policy, step, cap)
        found = self.source.plans.get(key)
        if found is None:
            self.cached = False
            found = self.source.plans[key] = self.dispatcher.prepare(
                op, tensors, group, bucket_bytes=cap, policy=self.policy
            )
        return found


def _placement_print(source: Source, local: LocalGrads) -> int:
    """What this rank tells the others of where its gradient pieces lie: a print of them if the
    placements cached with the source (by a gather of partitions as they lie) still hold for every
    group, else -1, which makes every rank exchange placements again before such a gather."""
    from collgrad.grads.execute import placed_pieces  # execute imports this module

    prints = []
    for position, buffer in enumerate(local.buffers):
        if not isinstance(buffer, Pieces) or source.layout.groups[position].kind is not Kind.PARTITIONED_FLAT:
            continue
        pieces = placed_pieces(buffer)
        cached = source.plans.get(("placements", source.layout.groups[position].index))
        if cached is None or cached[0] != pieces:
            return -1
        if "placed print" not in buffer.memo:
            buffer.memo["placed print"] = stable_hash(pieces)
        prints.append(buffer.memo["placed print"])
    return stable_hash(prints) & ((1 << 62) - 1)


def _agree(
    source: Source,
    local: LocalGrads,
    fields: list[Field],
    timeout_s: float,
    name: str,
    meanwhile: Callable[[], None],
) -> list[list[int]] | None:
    """Every rank of the control group learns every rank's readiness and arguments, and all raise the
    same error if any rank cannot read now or asked for something else; ``meanwhile`` runs while the
    exchange is in flight. Returns every rank's row."""
    rank = _compat.rank()
    if source.control_group is None:
        if local.problem is not Problem.OK:
            raise NotReadyError(f"rank {rank}: {local.problem.describe()}")
        meanwhile()
        return None
    rows = agree_on_call(
        source.control_group, fields, timeout_s=timeout_s, call=name, status=int(local.problem), meanwhile=meanwhile
    )
    ranks = _compat.group_ranks(source.control_group)
    bad = [(ranks[i], Problem(row[0])) for i, row in enumerate(rows) if row[0] != Problem.OK]
    if bad:
        detail = "; ".join(f"rank {r}: {p.describe()}" for r, p in bad)
        if local.detail:
            detail += f"; here: {local.detail}"
        error = LayoutChangedError if any(p is Problem.LAYOUT_CHANGED for _, p in bad) else NotReadyError
        raise error(f"full gradients cannot be read now ({detail}) [seen by rank {rank}]")
    return rows


def _tell_invalid(model: Any, timeout_s: float, name: str) -> None:
    """This rank's arguments are invalid: take part in the readiness check with that verdict, so ranks
    whose arguments were fine raise too instead of waiting; the caller then re-raises its own error."""
    try:
        group = sources.control_group_of(model)
    except Exception:  # noqa: BLE001 - the argument error is the one to report
        group = _compat.default_group() if torch.distributed.is_initialized() else None
    if group is not None:
        tell_invalid(group, len(FIELDS) + OpenCall.EXTRA, timeout_s, name)


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
