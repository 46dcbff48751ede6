"""The base types of the framework adapters: ``Model`` (what a caller passed, resolved into the adapter
of its framework), ``Source`` (one kind of a model's state: its layout and how to read and write this
rank's part of it), ``LocalGrads`` (one call's view of this rank's part), ``Problem`` (why it cannot be
read now), ``ReplicatedSource`` (every rank holds every parameter's state whole).

The adapters (deepspeed.py, fsdp2.py, plain.py) build on these; ``collgrad.state.adapters.resolve``
picks the one that holds what was passed.
"""

from __future__ import annotations

import bisect
import enum
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.core.buffers import Pieces, StorageSpans, cut_parts, joined_copies, joined_runs, joined_source
from collgrad.errors import InvalidArgumentError, UnknownParameterError
from collgrad.state.cache import PlanCache, WritePlan
from collgrad.state.kinds import GRAD, WEIGHTS, StateKind
from collgrad.state.layout import Expert, LayoutGroup, ParamSlot, Partitioning, Split, StateLayout, owned_fragments

__all__ = [
    "Model",
    "OptimizerView",
    "create_states",
    "Problem",
    "LocalGrads",
    "GroupBuffer",
    "Copies",
    "Source",
    "ReplicatedSource",
    "per_element_state",
    "whole_values",
    "always_ok",
    "copy_to_weights",
    "copy_all",
    "optimizer_states",
    "select",
    "rank_in",
    "TENSOR_PARALLEL",
]


class Model:
    """What a caller passed, resolved once at the entrance of a call into the adapter of the framework
    that holds its state (``DeepSpeedModel``, ``FSDP2Model``, ``PlainModel``): each owns every internal
    of its framework and opens that framework's sources. Holds nothing but references the caller
    already holds. Local: nothing here communicates."""

    #: "deepspeed", "fsdp2" or "torch".
    framework: ClassVar[str]
    #: The module whose ``state_dict()`` the model has.
    module: nn.Module
    #: Keys of an optimizer's param groups that say what the group is in this model's layout rather than
    #: a hyperparameter of the run: a training state records them, a load keeps the destination's own.
    layout_keys: ClassVar[tuple[str, ...]] = ()
    #: What sources are cached for (weakly): the engine, or the module.
    target: object

    @property
    def control_group(self) -> ProcessGroup | None:
        """The group whose ranks must all call for this model (its data-parallel group); None without
        a process group."""
        return _compat.default_group() if torch.distributed.is_initialized() else None

    @property
    def model_group(self) -> ProcessGroup | None:
        """The group of every rank that holds a part of this model: its data-parallel group, and under
        tensor parallelism the ranks of every shard too (a whole-model checkpoint is agreed and written
        over it); None without a process group."""
        return self.control_group

    def open(self, params: Iterable[object] | None = None, kind: StateKind = GRAD, optimizer: Any = None) -> Source:
        """The Source of ``kind`` (default: the gradients) of this model's parameters (``params``: a
        selection; trainable ones unless ``kind`` is the weights). ``optimizer``: the one holding
        optimizer states where the model does not (FSDP2, a plain module)."""
        raise NotImplementedError

    def unsupported_layout(self) -> str | None:
        """The parallel layout this model is held in where collgrad cannot hold it whole (a pipeline's
        stages, sequence parallelism), described for an error; None where it can. Local."""
        return None

    def load_kinds(self) -> tuple[StateKind, ...]:
        """The kinds of state a load writes: the module's weights, and the fp32 master weights where an
        optimizer keeps its own; InvalidArgumentError (this rank) where collgrad cannot write them."""
        return (WEIGHTS,)

    def hook_step(self, run: Callable[[Any], None]) -> Callable[[], None]:
        """Have ``run(engine)`` called inside this model's fused step (at each accumulation boundary,
        before clipping and the update); returns the function that undoes it. InvalidArgumentError
        (this rank) where there is no such step."""
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {type(self.module).__name__} is not a DeepSpeed engine (or a module one "
            "wraps): there is no fused step to hook. With a torch optimizer, call your function between "
            "backward() and optimizer.step() (or register it with optimizer.register_step_pre_hook)"
        )

    def optimizer_view(self, optimizer: Any) -> OptimizerView:
        """Where ``optimizer`` (the torch optimizer stepping this module's parameters) keeps each trainable
        parameter's state; InvalidArgumentError (this rank) where none is given or it does not step
        them all. Local."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {type(self.module).__name__} keeps no optimizer of its own: pass "
                f"optimizer= (the torch.optim.Optimizer over its parameters), got {type(optimizer).__name__}"
            )
        groups = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        trainable = select(self.module, None, trainable=True)
        outside = [n for n, p in trainable if id(p) not in groups]
        if outside:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: the optimizer does not step {', '.join(outside[:4])}"
                f"{' and more' if len(outside) > 4 else ''}: pass the optimizer over every trainable parameter"
            )
        holders = {n: p for n, p in trainable}
        return OptimizerView(optimizer, holders, {n: groups[id(p)] for n, p in trainable}, optimizer.step)

    def lr_scheduler(self, given: Any) -> Any:
        """The LR scheduler whose ``state_dict()`` a training state holds: ``given``, or the one the
        framework keeps (a DeepSpeed engine's)."""
        return given

    def counters(self) -> dict[str, int | float]:
        """The framework's own counters of a run (a DeepSpeed engine's steps and samples, its fp16 loss
        scaler), by name; none for a module. Local."""
        return {}

    def set_counters(self, values: Mapping[str, int | float]) -> None:
        """``counters()`` put back (names as it gives them, each checked by the caller). Local."""


@dataclass(frozen=True)
class OptimizerView:
    """Where an optimizer keeps the state of each trainable parameter: ``optimizer``, the torch optimizer
    whose ``state`` and ``param_groups`` hold it; ``holders``, by parameter name, the tensor its state
    is keyed by in ``optimizer.state`` (the parameter itself; under ZeRO the flat fp32 partition of its
    group, which several share); ``groups``, by name, the index of its param group; ``step``, the
    optimizer's update over every holder (how a state an optimizer creates in its first step is made);
    ``linked``, what the framework must do once states exist (DeepSpeed links its accessors' fragments
    to them only in a step)."""

    optimizer: torch.optim.Optimizer
    holders: Mapping[str, torch.Tensor]
    groups: Mapping[str, int]
    step: Callable[[], Any]
    linked: Callable[[], None] = lambda: None
    unlinked: Callable[[], None] = lambda: None

    def distinct_holders(self) -> list[torch.Tensor]:
        """Every holder once, in the order of the parameters."""
        seen: dict[int, torch.Tensor] = {}
        for holder in self.holders.values():
            seen.setdefault(id(holder), holder)
        return list(seen.values())


def create_states(view: OptimizerView) -> Callable[[], None] | None:
    """The optimizer's states made where it has none yet, as its first step makes them (a zero gradient
    on every holder, every learning rate 0 for that one update, then both put back: the values it
    steps are unchanged, the states are the caller's to overwrite); returns what removes them again
    (a refused load leaves the optimizer as it was). As ``torch.distributed.checkpoint.state_dict``
    initializes an optimizer's states before loading them. None where every holder has its states
    already. Local."""
    holders = [h for h in view.distinct_holders() if not view.optimizer.state.get(h)]
    if not holders:
        return None
    grads = [h.grad for h in holders]
    rates = [g.get("lr") for g in view.optimizer.param_groups]
    try:
        for h in holders:
            h.grad = torch.zeros_like(h)
        for g in view.optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            view.step()
    finally:
        for h, grad in zip(holders, grads):
            h.grad = grad
        for g, lr in zip(view.optimizer.param_groups, rates):
            if lr is not None:
                g["lr"] = lr
    view.linked()

    def undo() -> None:
        for h in holders:
            view.optimizer.state.pop(h, None)
        view.unlinked()

    return undo


def optimizer_states(optimizer: Any, state: StateKind) -> Callable[[], Any]:
    """``optimizer.state`` as a function (the optimizer held weakly); InvalidArgumentError where
    ``optimizer`` is none, naming ``state``, which needs it."""
    if optimizer is None or not hasattr(optimizer, "state"):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: reading the {state.describe()} needs the optimizer that holds it: pass "
            "optimizer= (a torch.optim.Optimizer over this model's parameters)"
        )
    ref = weakref.ref(optimizer)

    def states() -> Any:
        owner = ref()
        return owner.state if owner is not None else {}

    return states


def whole_values(
    named: Sequence[tuple[str, nn.Parameter]], state: StateKind, states: Callable[[], Mapping[Any, Any]] | None = None
) -> Callable[[], list[torch.Tensor]]:
    """Where every rank holds ``state`` of each parameter whole (a plain module, stage 0, the weights
    below ZeRO-3): the parameters themselves (weights, or fp32 where they are the master), or each
    one's per-element optimizer state ``state.key`` from ``states()`` (``optimizer.state``)."""
    key = state.key
    if key is None:
        return lambda: [p.detach() for _, p in named]
    assert states is not None, "an optimizer state needs the optimizer's states"
    return lambda: [per_element_state(states().get(p), key, p.numel(), n) for n, p in named]


def always_ok() -> Problem:
    """A state source's readiness: weights and optimizer states need no backward."""
    return Problem.OK


def copy_to_weights(params: Mapping[str, nn.Parameter], values: Mapping[str, torch.Tensor]) -> None:
    """The module's own weights ``params`` made the full fp32 master weights ``values`` (the same on every
    rank), as an optimizer step leaves them: rounded to fp32 (what the master holds), then to the
    weight's dtype. Local."""
    # the parameters themselves, written under no_grad (``.data`` makes a new tensor each: ~2 us a weight)
    weights: list[torch.Tensor] = list(map(params.__getitem__, values))
    sources = list(values.values())
    # the usual case in C loops (fp32 values shaped like their weights); else each value made so
    if set(map(_dtype, sources)) != {torch.float32} or list(map(_shape, sources)) != list(map(_shape, weights)):
        sources = [
            (v if v.shape == w.shape else v.reshape(w.shape)).to(torch.float32) for v, w in zip(sources, weights)
        ]
    with torch.no_grad():
        copy_all(*joined_copies(weights, sources))  # where weights and values lie in order: a copy each run


_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i (each converted to its target's dtype), in one call
    where every tensor lies on one device (``torch._foreach_copy_`` needs one), else one by one. Local."""
    if not targets:
        return
    try:
        torch._foreach_copy_(targets, sources)  # one call, not one per tensor
    except RuntimeError:  # tensors on more than one device (foreach needs one): copies are idempotent
        for target, source in zip(targets, sources):
            target.copy_(source)


def per_element_state(held: Mapping[str, Any] | None, key: str, numel: int, what: str) -> torch.Tensor:
    """``held[key]``, one tensor's optimizer state (``optimizer.state[tensor]``), checked to be a tensor
    of ``numel`` elements, one per element of ``what`` (named in the error); InvalidArgumentError,
    saying what the optimizer holds, otherwise. Local."""
    found = None if held is None else held.get(key)
    if isinstance(found, torch.Tensor) and found.numel() == numel:
        return found
    rank = _compat.rank()
    if held is None or not held:
        raise InvalidArgumentError(
            f"rank {rank}: the optimizer holds no state for {what} yet (torch optimizers create it in their "
            "first step()): read optimizer states after a step"
        )
    per_element = sorted(k for k, v in held.items() if isinstance(v, torch.Tensor) and v.numel() == numel)
    reason = "holds no such key" if found is None else "holds it, but not one value per element"
    raise InvalidArgumentError(
        f"rank {rank}: the optimizer state {key!r} of {what}: the optimizer {reason}; its per-element "
        f"states are {per_element}"
    )


#: ``Source.parallel_groups``' name of the tensor-parallel group.
TENSOR_PARALLEL = "tensor"


def rank_in(group: LayoutGroup) -> int:
    """This process's position among ``group``'s ranks (0 in a group of one, which needs no process group)."""
    return group.group_ranks.index(torch.distributed.get_rank()) if group.world > 1 else 0


class Problem(enum.IntEnum):
    """Why the gradients cannot be read now. Codes travel between ranks: never renumber."""

    OK = 0
    NO_BACKWARD = 1
    NOT_BOUNDARY = 2
    UNMANAGED_ACCUMULATION = 3
    NO_GRADIENT_BUFFERS = 4
    LAYOUT_CHANGED = 5

    def describe(self) -> str:
        return {
            Problem.OK: "ready",
            Problem.NO_BACKWARD: "called before backward() or after step(): the gradient buffers hold no "
            "gradient of this step (call it after engine.backward() and before engine.step())",
            Problem.NOT_BOUNDARY: "called at a micro-step that is not a gradient accumulation boundary: "
            "gradients are not reduced yet (call it after the backward() of the last micro-step)",
            Problem.UNMANAGED_ACCUMULATION: "managed_gradient_accumulation is off: DeepSpeed reduces inside "
            "step(), so there is no moment at which reduced gradients exist before step()",
            Problem.NO_GRADIENT_BUFFERS: "the optimizer holds no reduced gradient buffers",
            Problem.LAYOUT_CHANGED: "the local gradient buffers no longer match the layout collgrad read from "
            "this DeepSpeed version (that rank's log says how); report it, and use "
            "deepspeed.utils.safe_get_full_grad meanwhile",
        }[self]


class Copies(NamedTuple):
    """A write's copies, made ready: ``targets[i].copy_(sources[i])`` for every i."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]


#: One layout group's local tensors: a ``Pieces`` (PARTITIONED_FLAT, SLICED), or the full tensor of each
#: parameter (REPLICATED).
GroupBuffer = Pieces | list[torch.Tensor]


@dataclass
class LocalGrads:
    """One call's view of this rank's gradients."""

    problem: Problem
    #: per layout group: a ``buffers.Pieces`` (PARTITIONED_FLAT, SLICED) or a list of full
    #: gradients per parameter (REPLICATED); empty when ``problem`` is set.
    buffers: Sequence[GroupBuffer]
    loss_scale: float = 1.0
    detail: str = ""  # what exactly is wrong, for this rank's own message


class Source:
    """A model's gradient layout and how to read this rank's part of it."""

    layout: StateLayout
    control_group: ProcessGroup | None  # the ranks that must all call, and agree before data moves
    groups: dict[int, ProcessGroup | None]  # layout group index -> process group
    device: torch.device  # where results are returned
    model_parallel: frozenset[str] = frozenset()
    #: Of ``model_parallel``, the tensor-parallel shards that are one slice of their whole tensor, and
    #: where that slice lies (a fused layout has no entry).
    splits: Mapping[str, Split] = {}
    #: This rank's index in its tensor-parallel group (0 without one).
    tensor_parallel_rank: int = 0
    #: Of ``model_parallel``, the experts of MoE layers whose experts are spread over ranks: each whole
    #: here, and what it is named in the unsharded model.
    experts: Mapping[str, Expert] = {}
    #: The process group of each model-parallel set this rank is in, by name: ``TENSOR_PARALLEL`` (the
    #: ranks whose shards ``splits`` join into whole tensors), each expert's ``group``.
    parallel_groups: Mapping[str, ProcessGroup] = {}
    #: DeepSpeed's per-parameter accessor (optimizers without a known layout): parameter -> full
    #: gradient, one collective per parameter.
    accessor: Callable[[nn.Parameter], torch.Tensor] | None = None
    #: The accessor for writing: (parameter, full gradient) -> None; local (this rank's part).
    accessor_set: Callable[[nn.Parameter, torch.Tensor], None] | None = None
    #: The accessor all-gathers each rank's partition (ZeRO-3) instead of all-reducing the whole
    #: parameter in fp32 (ZeRO-1/2, BF16_Optimizer): what it sends, for the record.
    accessor_gathers: bool = False
    params: dict[str, nn.Parameter]
    #: Scratch buffers the reader keeps with the source between calls (staging for gathers, padding).
    scratch: dict[Hashable, Any]
    #: Gradient plans, bucket plans and steps built for this source (see cache.py).
    plans: PlanCache

    @property
    def fingerprint(self) -> int:
        """The layout's fingerprint, compared between ranks before any data moves."""
        return self.layout.fingerprint()

    def valid(self) -> bool:
        """Whether the layout still describes the model (cheap; checked before reusing a cached source)."""
        return True

    def read(self) -> LocalGrads:
        raise NotImplementedError

    def write(
        self, local: LocalGrads, values: Mapping[str, torch.Tensor], scale: float, copies: Copies | None = None
    ) -> None:
        """Store the full gradients ``values`` (by name; true values, multiplied here by ``scale``, the
        loss scale) where the optimizer will step from: this rank writes the elements it owns, in
        place, and nothing else. No communication. ``local`` is this call's ``read()``; ``copies``:
        ``prepare_write``'s for these arguments, where it was made ahead (while the ranks agreed).

        Every owned part of every partitioned group is copied in one ``torch._foreach_copy_``."""
        targets, sources = copies if copies is not None else self.prepare_write(local, values, scale)
        for position, group in enumerate(self.layout.groups):
            if group.kind is Partitioning.REPLICATED:
                buffer = local.buffers[position]
                assert isinstance(buffer, list)
                held = self._full_targets(buffer)
                for k, slot in enumerate(group.params):
                    if slot.name in values:
                        self._write_full(k, slot, held, _scaled(values[slot.name], scale))
        copy_all(targets, sources)
        self.after_write(values)

    def prepare_write(self, local: LocalGrads, values: Mapping[str, torch.Tensor], scale: float) -> Copies:
        """``write``'s copies into the partitioned groups, made ready and nothing written: per owned part,
        a view of the value (times ``scale``, in fp32 at least, where it is not 1) and one of the buffer
        where it goes (the parts were worked out once per layout, ``_write_plan``). Local; under
        ``torch.no_grad()``."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for position, group in enumerate(self.layout.groups):
            if group.kind is Partitioning.REPLICATED:
                continue
            buffer = local.buffers[position]
            assert isinstance(buffer, Pieces)
            spans = buffer.storage_spans()
            plan = self._write_plan(group, buffer, spans)
            try:
                given: list[torch.Tensor] | None = list(map(values.__getitem__, plan.order))
            except KeyError:
                given = None  # a subset
            if given is not None:
                joined = _joined_copies(plan, buffer, spans[0] if spans is not None else None, given)
                if joined is not None:
                    targets += joined.targets
                    sources += joined.sources
                    continue
            # every part's view of the buffer in one call per storage span (a piece each where the pieces
            # are not contiguous): a slice each costs ~4x
            views: list[torch.Tensor] = []
            for into, sizes in plan.cuts:
                if into < 0:
                    assert spans is not None  # the plan cuts spans only where the pieces have them
                    whole_of = spans[0][-1 - into]
                else:
                    whole_of = buffer.piece(into)
                views += whole_of.split_with_sizes(sizes) if len(sizes) > 1 else (whole_of,)
            if given is not None:  # every row, in C loops (ZeRO-3: a slice of every parameter, none adjacent)
                sources += cut_parts(given, plan.los, plan.numels)
                targets += map(views.__getitem__, plan.views)
                continue
            for name, lo, numel, view in zip(plan.order, plan.los, plan.numels, plan.views):  # a subset: row by row
                new = values.get(name)
                if new is not None:
                    sources.append(new.reshape(-1).narrow(0, lo, numel))
                    targets.append(views[view])
        if scale != 1.0 and sources:  # in fp32 at least (the stored dtype may be fp16: scale first, round once)
            sources = list(torch._foreach_mul([_promoted(s) for s in sources], scale))
        return Copies(targets, sources)

    def _write_plan(self, group: LayoutGroup, buffer: Pieces, spans: StorageSpans | None) -> WritePlan:
        """This rank's owned fragments of ``group`` to write, each cut where it crosses from one piece
        into the next, and placed in its storage span (``spans``: ``buffer.storage_spans()``; else in its
        piece), with the cuts that give every part's view in one ``split_with_sizes`` per span: worked
        out once while the pieces lie where they did (DeepSpeed keeps its buffers), not per fragment per
        call. Where the pieces come from a PiecesCache that found them unmoved, ``where`` is the very
        tuple the plan was made for, and nothing is compared."""
        where = spans[1] if spans is not None else None
        found = self.plans.write_plans.get(group.index)
        if found is not None and (
            (where is not None and found.where is where)
            or (found.where == where and found.starts == tuple(buffer.starts))
        ):
            return found
        parts: dict[int, list[tuple[int, int, str, int]]] = {}  # into -> (offset, numel, name, lo)
        for f in owned_fragments(group, rank_in(group)):
            slot = group.params[f.param]
            for part, at in buffer.spans(f.local_offset, f.numel):
                k = bisect.bisect_right(buffer.starts, f.local_offset + at) - 1
                inside = f.local_offset + at - buffer.starts[k]
                n = part.numel()
                into, offset = (-1 - where[k][0], where[k][1] + inside) if where is not None else (k, inside)
                parts.setdefault(into, []).append((offset, n, slot.name, f.param_offset + at))
        # the rows, in the buffer's order (a partition's tail, whole parameters, a head), as columns
        order: list[str] = []
        los: list[int] = []
        numels: list[int] = []
        places: list[tuple[int, int]] = []
        views: list[int] = []
        cuts: list[tuple[int, tuple[int, ...]]] = []
        cut = 0  # the views of the cuts so far
        for into, found_parts in parts.items():
            total = spans[0][-1 - into].numel() if into < 0 and spans is not None else buffer.piece(into).numel()
            sizes: list[int] = []
            end = 0
            for offset, n, name, lo in sorted(found_parts):
                if offset > end:
                    sizes.append(offset - end)  # a gap no part of this rank's covers
                order.append(name)
                los.append(lo)
                numels.append(n)
                places.append((into, offset))
                views.append(cut + len(sizes))
                sizes.append(n)
                end = offset + n
            if end < total:
                sizes.append(total - end)
            cuts.append((into, tuple(sizes)))
            cut += len(sizes)
        # row b can take one copy with row a where b's view follows a's in the buffer, and a's part ends its
        # parameter where b's begins its own (only then can the values follow each other: ZeRO-3's
        # slices of every parameter never do)
        whole = {slot.name: slot.numel for slot in group.params}
        follows = tuple(
            places[a + 1] == (places[a][0], places[a][1] + numels[a])
            and los[a] + numels[a] == whole[order[a]]
            and los[a + 1] == 0
            for a in range(len(order) - 1)
        )
        found = WritePlan(
            where,
            tuple(buffer.starts),
            tuple(cuts),
            follows,
            tuple(order),
            tuple(los),
            tuple(numels),
            tuple(places),
            tuple(views),
        )
        self.plans.write_plans[group.index] = found
        return found

    def _full_targets(self, buffer: list[Any]) -> Sequence[Any]:
        """Where a replicated group's full gradients are written: ``read()``'s tensors, asked for once
        per call (once per parameter, it made writing quadratic)."""
        return buffer

    def _write_full(self, k: int, slot: ParamSlot, targets: Sequence[Any], value: torch.Tensor) -> None:
        targets[k].copy_(value.reshape(targets[k].shape))

    def reads(self, rank: int) -> tuple[tuple[str, int, int], ...]:
        """What global rank ``rank`` reads of the full values it is given when it writes them: per part
        (parameter name, first element, count), in layout order: its owned fragments of each
        partitioned group, every value of a replicated group whole, and whole the values it refreshes
        other state from (``refreshed_whole``). The same answer on every rank (from the layout); worked
        out once per rank asked about while the values read whole stay the same."""
        whole = self.refreshed_whole()  # may change between calls (ZeRO-3: a parameter gathered now)
        key = ("reads", rank)
        kept: tuple[frozenset[str], tuple[tuple[str, int, int], ...]] | None = self.scratch.get(key)
        if kept is not None and kept[0] == whole:
            return kept[1]
        parts: list[tuple[str, int, int]] = []
        for group in self.layout.groups:
            if group.kind is Partitioning.REPLICATED:
                parts += [(slot.name, 0, slot.numel) for slot in group.params]
                continue
            if group.world > 1 and rank not in group.group_ranks:
                continue
            parts += [(slot.name, 0, slot.numel) for slot in group.params if slot.name in whole]
            position = group.group_ranks.index(rank) if group.world > 1 else 0
            for f in owned_fragments(group, position):
                slot = group.params[f.param]
                if slot.name not in whole:
                    parts.append((slot.name, f.param_offset, f.numel))
        found = tuple(parts)
        self.scratch[key] = (whole, found)
        return found

    def refreshed_whole(self) -> frozenset[str]:
        """The parameters whose full values a write reads whole on every rank, besides the fragments it
        owns (where it refreshes the module's weights from them: ``after_write``)."""
        return frozenset()

    def held_whole(self) -> dict[str, torch.Tensor]:
        """Tensors this rank holds whole besides its part in the layout (ZeRO-3's persistent parameters),
        by name: a load writes them whole too. Local."""
        return {}

    def after_write(self, values: Mapping[str, torch.Tensor]) -> None:
        """Bring state the optimizer derived from the gradients up to date with what was written."""

    def release(self) -> None:
        """Let go of every tensor kept between calls (views of the optimizer's buffers, staging), so
        that memory the owner frees is really freed. The next call reads afresh."""
        self.scratch.clear()


#: ``_joined_copies`` serves a write where its values join into at most this many copies, or one in
#: eight rows; else (a tensor per value, as a caller computed them) every row's view is cut at once.
_FEW_RUNS = 16


def _joined_copies(
    plan: WritePlan, buffer: Pieces, spans: list[torch.Tensor] | None, given: list[torch.Tensor]
) -> Copies | None:
    """A group's copies where the values of every row of ``plan`` (``given``, in the plan's order) join
    into few runs (what collgrad's own reads return: a bucket's values back to back): per run one view of
    the buffer (of its storage span, ``spans``, or its piece) and one of the values, with no view cut per
    row. None where they do not: ``prepare_write`` then cuts every row's view."""
    if not any(plan.follows):  # no two rows can be one copy (ZeRO-3): not asked of the values
        return None
    runs = joined_runs(given, plan.los, plan.numels, plan.follows)
    if runs is None or len(runs) > max(_FEW_RUNS, len(given) // 8):
        return None
    copies = Copies([], [])
    los, numels, places = plan.los, plan.numels, plan.places
    for first, end in runs:
        numel = places[end - 1][1] + numels[end - 1] - places[first][1]
        source = joined_source(given[first], los[first], given[end - 1], numel)
        if source is not None:
            copies.targets.append(_cut(buffer, spans, places[first], numel))
            copies.sources.append(source)
            continue
        # back to back, but in two storages (allocations that abut): one copy each
        copies.targets.extend(_cut(buffer, spans, places[k], numels[k]) for k in range(first, end))
        copies.sources.extend(cut_parts(given[first:end], los[first:end], numels[first:end]))
    return copies


def _cut(buffer: Pieces, spans: list[torch.Tensor] | None, place: tuple[int, int], numel: int) -> torch.Tensor:
    """``numel`` elements of ``buffer`` at a write plan's ``place`` (its cut: storage span ``-1 - i`` of
    ``spans``, or piece ``i``; its offset there), as a view."""
    into, offset = place
    whole_of = spans[-1 - into] if into < 0 and spans is not None else buffer.piece(into)
    return whole_of.narrow(0, offset, numel)


def _scaled(value: torch.Tensor, scale: float) -> torch.Tensor:
    """``value * scale`` computed in fp32 at least (the stored dtype may be fp16: scale first, round once)."""
    if scale == 1.0:
        return value.detach()
    return _promoted(value.detach()) * scale


def _promoted(value: torch.Tensor) -> torch.Tensor:
    """``value`` in fp32 at least: what a loss scale multiplies."""
    wanted = torch.promote_types(value.dtype, torch.float32)
    return value if value.dtype == wanted else value.to(wanted)


def select(module: nn.Module, params: Iterable[Any] | None, trainable: bool = True) -> list[tuple[str, nn.Parameter]]:
    """The trainable (``trainable=False``: all) ``(name, parameter)`` pairs of ``module`` in
    ``named_parameters()`` order (tied parameters once), limited to ``params`` (names or parameters) if
    given."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad or not trainable]
    if params is None:
        return named
    by_id = {id(p): n for n, p in named}
    names = {n for n, _ in named}
    wanted: set[str] = set()
    for item in params:
        if isinstance(item, str):
            if item not in names:
                raise UnknownParameterError(
                    f"rank {_compat.rank()}: {item!r} is not a {'trainable ' if trainable else ''}parameter of "
                    "this model; pass names from model.named_parameters()"
                )
            wanted.add(item)
        elif isinstance(item, torch.Tensor):
            if id(item) not in by_id:
                raise UnknownParameterError(
                    f"rank {_compat.rank()}: a parameter of shape {tuple(item.shape)} is not a "
                    "trainable parameter of this model; pass this model's parameters or their names"
                )
            wanted.add(by_id[id(item)])
        else:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: params must hold parameter names or tensors, got {type(item).__name__}"
            )
    return [(n, p) for n, p in named if n in wanted]


class ReplicatedSource(Source):
    """Every rank holds every full, reduced gradient: ``grads()`` returns them (None where absent)."""

    def __init__(
        self,
        variant: str,
        named: Sequence[tuple[str, nn.Parameter]],
        grads: Callable[[], Sequence[torch.Tensor | None]],
        group: ProcessGroup | None,
        *,
        problem: Callable[[], Problem] | None = None,
        loss_scale: Callable[[], float] = lambda: 1.0,
        model_parallel: frozenset[str] = frozenset(),
        dtype: torch.dtype | None = None,
        reselect: Callable[[], Sequence[tuple[str, nn.Parameter]]] | None = None,
        set_grad: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
        full_shape: Callable[[nn.Parameter], tuple[int, ...]] | None = None,
    ) -> None:
        """``full_shape(p)``: a parameter's whole shape where its own is not (a partitioned one's)."""
        self._grads = grads
        self._set_grad = set_grad  # (parameter, tensor): where a parameter without a gradient gets one
        self._reselect = reselect  # a plain module: trainable parameters can change between calls
        self._selection = [(n, id(p)) for n, p in named]
        self._problem = problem
        self._loss_scale = loss_scale
        self.params = dict(named)
        self.device = named[0][1].device if named else torch.device("cpu")
        self.control_group = group
        self.groups = {0: group}
        self.scratch = {}
        self.plans = PlanCache()
        self.model_parallel = frozenset(model_parallel)
        out = dtype or (named[0][1].dtype if named else torch.float32)
        shapes = [full_shape(p) if full_shape is not None else tuple(p.shape) for _, p in named]
        slots = tuple(
            ParamSlot(n, shape, math.prod(shape), 0, math.prod(shape), n in model_parallel)
            for (n, _), shape in zip(named, shapes)
        )
        ranks = tuple(_compat.group_ranks(group)) if group is not None else (0,)
        self.layout = StateLayout(
            variant, (LayoutGroup(0, Partitioning.REPLICATED, ranks, 0, out, out, slots),), tuple(n for n, _ in named)
        )

    def valid(self) -> bool:
        if self._reselect is None:
            return True
        return [(n, id(p)) for n, p in self._reselect()] == self._selection

    def read(self) -> LocalGrads:
        grads = self._grads()
        if self._problem is not None:
            problem = self._problem()
        else:
            problem = Problem.NO_BACKWARD if grads and all(g is None for g in grads) else Problem.OK
        if problem is not Problem.OK:
            return LocalGrads(problem, [])
        out = self.layout.groups[0].out_dtype
        full = [
            g if g is not None else torch.zeros(p.shape, dtype=out, device=p.device)
            for p, g in zip(self.params.values(), grads)
        ]
        return LocalGrads(problem, [full], self._loss_scale())

    def _full_targets(self, buffer: list[Any]) -> Sequence[Any]:
        # The gradients as they are now, None where there is none (read() put zeros there, which a
        # write would not reach).
        return self._grads()

    def _write_full(self, k: int, slot: ParamSlot, targets: Sequence[Any], value: torch.Tensor) -> None:
        current = targets[k]
        if current is not None:
            current.copy_(value.reshape(current.shape))
        elif self._set_grad is not None:  # e.g. stage 0: a parameter that got no gradient in backward
            param = self.params[slot.name]
            self._set_grad(param, value.reshape(param.shape).to(dtype=param.dtype, device=param.device).clone())
        else:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {slot.name} has no gradient buffer to write into (it took no part in "
                "backward); leave it out of grads="
            )
