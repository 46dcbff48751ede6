"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the second gradient source, and the only module that
touches FSDP2 internals.

After the backward of a micro-step with gradient sync on, each parameter's ``.grad`` is a DTensor
sharded on dim 0 over the mesh dimension FSDP shards on: rank r holds rows
``[r * ceil(d0 / n), (r + 1) * ceil(d0 / n))`` (``torch.chunk``; the last ranks may hold fewer rows, or
none), unpadded. That is the SLICED layout with a slice of ``ceil(d0 / n)`` rows::

    param (5 x 9), 2 shard ranks    rank 0: rows 0-2 (27 elements)   rank 1: rows 3-4 (18, padded to 27)

so every executor of collgrad.state applies: one gather per bucket over the shard group, the
statistics from the local shards, writing each rank's rows of the given value into its local shard.
HSDP (mesh ``(replicate, shard)``): gathered over the shard dimension only; the replicate dimension
already holds equal values. Tensor parallel (a DTensor parameter before ``fully_shard``): FSDP shards
the rank's TP shard, so the gather over FSDP's dimension rebuilds that TP shard, which stays local
and is named in ``model_parallel`` (as AutoTP shards are); where it is one slice of one dimension
(``Shard(d)`` over the tensor-parallel mesh), ``splits`` says where it lies in the whole tensor, which
checkpoints write and read.

FSDP2 internals used (torch 2.13): ``FSDPModule`` and its state's ``_fsdp_param_group.fsdp_params``;
of each ``FSDPParam``: ``sharded_param`` (the model's parameter), ``fsdp_placement`` (dim 0 unless a
``shard_placement_fn`` chose another), ``mesh_info.shard_process_group`` (FSDP's shard dimension),
``_orig_size`` (the local shape FSDP shards: the TP shard under TP), ``is_dtensor`` and ``_unsharded_dtensor_spec``
(TP before FSDP, and whether it shards),
``DTensor._local_tensor`` (the local shard, without ``to_local()``'s autograd cost), and
``_unsharded_param.grad`` / ``unsharded_accumulated_grad`` (where a
``set_requires_gradient_sync(False)`` micro-step leaves unreduced gradients until a reducing
backward clears them).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, ClassVar, Hashable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from collgrad import _compat
from collgrad.core.buffers import Pieces, SameTensors, flat_alias
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import (
    TENSOR_PARALLEL,
    GroupBuffer,
    LocalGrads,
    Model,
    Problem,
    Source,
    optimizer_states,
    per_element_state,
    rank_in,
    select,
)
from collgrad.state.cache import PlanCache
from collgrad.state.kinds import GRAD, WEIGHTS, OptimizerState, StateKind
from collgrad.state.layout import LayoutGroup, ParamSlot, Partitioning, Split, StateLayout, owned_fragments

__all__ = [
    "adapt_sharded",
    "FSDP2Model",
]


def is_fsdp2(model: Any) -> bool:
    """``model`` is (or contains, as its root) a module sharded with ``fully_shard``."""
    return isinstance(model, FSDPModule) or (
        isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())
    )


class FSDP2Source(Source):
    """Parameters grouped by the process group that shards them (FSDP's shard dimension of the mesh);
    each group SLICED over the parameter's local shape before FSDP (the tensor-parallel shard under
    TP, else the whole parameter). ``kind``: the gradients' local shards; the sharded parameters
    themselves (``FP32``: FSDP2 steps them, and with mixed precision they stay in their own dtype, only
    the unsharded copies are cast; ``WEIGHTS``: frozen ones too); or one state of ``optimizer`` per
    parameter (DTensors sharded as the parameters are)."""

    def __init__(
        self, model: nn.Module, named: list[tuple[str, nn.Parameter]], kind: StateKind = GRAD, optimizer: Any = None
    ) -> None:
        self.kind = kind
        self.model = model
        self.params = dict(named)
        # Where each parameter is registered: valid() checks these slots instead of walking
        # named_parameters() (measurements: docs/notes/).
        self._registered = []
        for n, p in named:
            path, _, attr = n.rpartition(".")
            self._registered.append((model.get_submodule(path), attr, p))
        #: This step's local shards as Pieces, while FSDP2 holds the same shards (see read()): let go
        #: as soon as FSDP2 frees any of them.
        self._held: Sequence[GroupBuffer] | None = None
        me = weakref.ref(self)  # the callback must not keep the source alive

        def forget() -> None:
            owner = me()
            if owner is not None:
                owner._held = None

        self._shards = SameTensors(gone=forget)
        self.scratch, self.plans, self.groups = {}, PlanCache(), {}
        self.control_group = _compat.default_group()
        self.device = named[0][1].device if named else torch.device("cpu")
        managed = {id(fp.sharded_param): fp for fp in _fsdp_params(model)}
        members: dict[Any, list[tuple[str, Any]]] = {}
        pgs, tensor_parallel = {}, set()
        splits: dict[str, Split] = {}
        for name, p in named:
            fp = managed.get(id(p))
            if fp is None or not isinstance(p, DTensor):
                raise InvalidArgumentError(
                    f"rank {_compat.rank()}: {name} is not sharded by fully_shard (a plain parameter of a "
                    "fully_shard model): shard every trainable parameter with fully_shard, or leave it out with params="
                )
            if fp.fsdp_placement != Shard(0) or not hasattr(fp.mesh_info, "shard_process_group"):
                raise InvalidArgumentError(
                    f"rank {_compat.rank()}: {name} is sharded as {fp.fsdp_placement} over "
                    f"{type(fp.mesh_info).__name__}; collgrad reads FSDP2 parameters sharded on dim 0 "
                    "(fully_shard's default, HSDP included). Use p.grad.full_tensor() for this one"
                )
            tp_spec = getattr(fp, "_unsharded_dtensor_spec", None) if fp.is_dtensor else None
            if tp_spec is not None and any(pl.is_shard() for pl in tp_spec.placements):
                tensor_parallel.add(name)  # a tensor-parallel shard before FSDP: it stays this rank's TP shard
                placed = _tensor_parallel_split(tp_spec, tuple(fp._orig_size))
                if placed is not None:
                    splits[name], self.tensor_parallel_rank, group = placed
                    self.parallel_groups = {TENSOR_PARALLEL: group}
            pg = fp.mesh_info.shard_process_group
            key = (id(pg), str(p.to_local().dtype))
            pgs[key] = pg
            members.setdefault(key, []).append((name, fp))
        self.model_parallel = frozenset(tensor_parallel)
        self.splits = splits
        groups = []
        for index, (key, params) in enumerate(members.items()):
            pg = pgs[key]
            world = pg.size()
            slots, offset = [], 0
            for name, fp in params:
                shape = tuple(fp._orig_size)  # the local shape FSDP shards (TP-local under TP)
                numel = math.prod(shape)
                rows = shape[0] if shape else 1
                slice_numel = -(-rows // world) * (numel // max(rows, 1))
                slots.append(ParamSlot(name, shape, numel, offset, slice_numel, name in tensor_parallel))
                offset += slice_numel
            first: Any = self.params[params[0][0]]  # a DTensor
            dtype = first.to_local().dtype
            groups.append(
                LayoutGroup(
                    index, Partitioning.SLICED, tuple(_compat.group_ranks(pg)), offset, dtype, dtype, tuple(slots)
                )
            )
            self.groups[index] = pg
        self.layout = StateLayout("fsdp2", tuple(groups), tuple(n for n, _ in named))
        self._accumulating = _accumulating_params(model)
        self._optimizer = optimizer_states(optimizer, kind) if isinstance(kind, OptimizerState) else None
        # Per group, per parameter: (name, elements this rank holds, padding to a full slice): pure layout.
        self._owned = []
        for group in groups:
            held = {f.param: f.numel for f in owned_fragments(group, rank_in(group))}
            self._owned.append(
                [(s.name, held.get(k, 0), s.slice_numel - held.get(k, 0)) for k, s in enumerate(group.params)]
            )

    def valid(self) -> bool:
        """Every parameter is still the one registered under its name, and still trainable (frozen ones
        count too for the module's weights)."""
        frozen_too = self.kind == WEIGHTS
        return all(m._parameters.get(a) is p and (frozen_too or p.requires_grad) for m, a, p in self._registered)

    def release(self) -> None:
        super().release()
        self._held = None

    def read(self) -> LocalGrads:
        if self.kind != GRAD:
            return self._read_state()
        if any(self._accumulating()):
            return LocalGrads(Problem.NOT_BOUNDARY, [])
        grads = {name: p.grad for name, p in self.params.items()}
        if all(g is None for g in grads.values()):
            return LocalGrads(Problem.NO_BACKWARD, [])
        return self._held_or_read(grads)

    def _read_state(self) -> LocalGrads:
        """The sharded parameters, or their optimizer state: readable at any time outside the step."""
        if self._optimizer is None:
            return self._held_or_read(dict(self.params))
        held, key = self._optimizer(), self.kind.key or ""
        return self._held_or_read(
            {name: per_element_state(held.get(p), key, p.numel(), name) for name, p in self.params.items()}
        )

    def _held_or_read(self, grads: dict[str, Any]) -> LocalGrads:
        """The local shards of ``grads`` (DTensors by name, None where absent) as Pieces, kept while
        FSDP2 holds the same shards."""
        shards = [g._local_tensor if isinstance(g, DTensor) else g for g in grads.values()]
        complete = all(t is not None for t in shards)
        if self._held is not None and complete and self._shards.matches(shards):
            return LocalGrads(Problem.OK, self._held)  # the same shards, where they lay: the same Pieces
        found = self._read(grads)
        if found.problem is Problem.OK and complete:
            # Kept for the calls of this step, weakly: the Pieces alias the shards' memory (not the
            # shards), and go as soon as FSDP2 lets go of any shard (zero_grad, the next reduction), so
            # they never keep a step's gradients alive. Their placement is then worked out once a step.
            self._shards.remember(shards)
            self._held = found.buffers
        return found

    def _read(self, grads: dict[str, Any]) -> LocalGrads:
        buffers = []
        for group, slots in zip(self.layout.groups, self._owned):
            pieces = []
            for name, owned, pad in slots:
                grad = grads[name]
                if grad is None:  # took no part in backward: its gradient is zero
                    local = torch.zeros(owned, dtype=group.wire_dtype, device=self.device)
                else:
                    # DTensor's local shard itself (to_local() is an autograd function, costly per
                    # call), flat, as an alias that does not keep the shard tensor alive (see read())
                    shard = grad._local_tensor if isinstance(grad, DTensor) else None
                    alias = flat_alias(shard) if shard is not None and shard.is_contiguous() else None
                    if alias is None or alias.numel() != owned:
                        return LocalGrads(
                            Problem.LAYOUT_CHANGED,
                            [],
                            detail=f"{name}: the local gradient shard is not the {owned} elements of dim-0 rows "
                            "FSDP2 gives this rank",
                        )
                    local = alias
                pieces.append(local)
                if pad:  # the padding every rank's slice has, so that gathers line up
                    pieces.append(_zeros(self.scratch, pad, group.wire_dtype, self.device))
            buffers.append(Pieces(pieces))
        return LocalGrads(Problem.OK, buffers)


def _tensor_parallel_split(spec: Any, local: tuple[int, ...]) -> tuple[Split, int, Any] | None:
    """Where this rank's tensor-parallel shard of a parameter lies in the whole tensor, its index on
    the mesh dimension that shards it and that dimension's process group: from the parameter's DTensor
    layout before FSDP (``spec``: one
    ``Shard(d)`` over its tensor-parallel mesh, each rank ``torch.chunk``'s piece of dimension ``d``);
    ``local``: the shard's shape, which the slice must give. None for a layout that is not one slice of
    one dimension (shards along more than one dimension; a strided or uneven one): collgrad cannot
    place it. Local."""
    sharded = [(k, pl) for k, pl in enumerate(spec.placements) if pl.is_shard()]
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard:  # not one plain Shard (_StridedShard subclasses it)
        return None
    mesh_dim, placement = sharded[0]
    whole, dim = tuple(spec.shape), placement.dim
    index, size = spec.mesh.get_coordinate()[mesh_dim], spec.mesh.size(mesh_dim)
    chunk = -(-whole[dim] // size)
    bounds = tuple(min(k * chunk, whole[dim]) for k in range(size + 1))
    split = Split(dim, whole, bounds[index], bounds[index + 1], bounds)
    return (split, index, spec.mesh.get_group(mesh_dim)) if split.shard_shape() == local else None


def _zeros(scratch: dict[Hashable, Any], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Read-only zero padding, kept between calls (never written: no fragment covers padding)."""
    key = ("padding", dtype, device)
    found = scratch.get(key)
    if found is None or found.numel() < numel:
        found = scratch[key] = torch.zeros(numel, dtype=dtype, device=device)
    return found[:numel]


def _fsdp_params(model: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of the ``fully_shard`` units in ``model``."""
    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def _accumulating_params(model: nn.Module) -> Callable[[], Iterator[bool]]:
    """A function telling, per FSDP parameter, whether it holds gradients accumulated without
    reduction (micro-steps under ``set_requires_gradient_sync(False)``)."""
    fsdp_params = _fsdp_params(model)

    def accumulating() -> Iterator[bool]:
        # FSDP2's post-backward without reduction leaves the unreduced gradient on the unsharded
        # parameter, or upcast in unsharded_accumulated_grad (reduce_dtype); a reducing one clears both.
        for fp in fsdp_params:
            if fp.unsharded_accumulated_grad is not None:
                yield True
            unsharded = fp.__dict__.get("_unsharded_param")
            yield unsharded is not None and unsharded.grad is not None

    return accumulating


def adapt_sharded(model: nn.Module) -> FSDP2Model | None:
    """The adapter of ``model`` where it is a ``fully_shard`` root (or a module under one), else None. Local."""
    return FSDP2Model(model) if is_fsdp2(model) else None


class FSDP2Model(Model):
    """A model sharded with ``fully_shard``. Built by ``adapt_sharded``."""

    framework: ClassVar[str] = "fsdp2"

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.target = module

    def open(self, params: Iterable[object] | None = None, kind: StateKind = GRAD, optimizer: Any = None) -> Source:
        named = select(self.module, params, trainable=kind != WEIGHTS)
        return FSDP2Source(self.module, named, kind, optimizer)
