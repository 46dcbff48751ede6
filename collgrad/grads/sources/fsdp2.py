"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the second gradient source, and the only module that
touches FSDP2 internals.

After the backward of a micro-step with gradient sync on, each parameter's ``.grad`` is a DTensor
sharded on dim 0 over the mesh dimension FSDP shards on: rank r holds rows
``[r * ceil(d0 / n), (r + 1) * ceil(d0 / n))`` (``torch.chunk``; the last ranks may hold fewer rows, or
none), unpadded. That is the PER_PARAM layout with a slice of ``ceil(d0 / n)`` rows::

    param (5 x 9), 2 shard ranks    rank 0: rows 0-2 (27 elements)   rank 1: rows 3-4 (18, padded to 27)

so every executor of collgrad.grads applies: one gather per bucket over the shard group, the
statistics from the local shards, writing each rank's rows of the given value into its local shard.
HSDP (mesh ``(replicate, shard)``): gathered over the shard dimension only; the replicate dimension
already holds equal values. FSDP2 internals used: ``FSDPModule`` and its state's
``_fsdp_param_group.fsdp_params`` (each ``FSDPParam``'s ``_unsharded_param.grad`` and
``unsharded_accumulated_grad``: where ``set_requires_gradient_sync(False)`` micro-steps leave the
unreduced gradients until a reducing backward clears them), torch 2.13.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from collgrad import _compat
from collgrad.core.buffers import Pieces
from collgrad.errors import InvalidArgumentError
from collgrad.grads.sources import LocalGrads, Problem, Source
from collgrad.grads.sources.layout import GradGroup, GradLayout, Kind, ParamSlot

__all__ = ["is_fsdp2", "open_fsdp2", "shard_whole"]


def is_fsdp2(model: Any) -> bool:
    """``model`` is (or contains, as its root) a module sharded with ``fully_shard``."""
    return isinstance(model, FSDPModule) or (
        isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())
    )


def _shard_dim(p: nn.Parameter, name: str) -> int:
    """The mesh dimension FSDP shards ``p`` on: its one ``Shard(0)`` placement, the others replicated."""
    placements = p.placements
    shards = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    if (
        len(shards) != 1
        or placements[shards[0]] != Shard(0)
        or not all(isinstance(pl, Replicate) for i, pl in enumerate(placements) if i != shards[0])
    ):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: {name} has placements {tuple(placements)}; collgrad reads FSDP2 parameters "
            "sharded on dim 0 over one mesh dimension (fully_shard, or HSDP: (Replicate(), Shard(0))). "
            "Tensor-parallel placements are not supported yet: use p.grad.full_tensor() for those"
        )
    return shards[0]


class FSDP2Source(Source):
    """Parameters grouped by the process group that shards them; each group PER_PARAM."""

    def __init__(self, model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
        self.model = model
        self.params = dict(named)
        self._ids = [(n, id(p)) for n, p in named]
        self.scratch, self.plans, self.groups = {}, {}, {}
        self.model_parallel = frozenset()
        self.control_group = _compat.default_group()
        self.device = named[0][1].device if named else torch.device("cpu")
        members: dict[Any, list[tuple[str, nn.Parameter]]] = {}
        pgs = {}
        for name, p in named:
            if not isinstance(p, DTensor):
                raise InvalidArgumentError(
                    f"rank {_compat.rank()}: {name} is not sharded (a plain tensor in a fully_shard model): "
                    "shard every trainable parameter with fully_shard, or leave it out with params="
                )
            dim = _shard_dim(p, name)
            pg = p.device_mesh.get_group(dim)
            key = (id(pg), str(p.to_local().dtype))
            pgs[key] = pg
            members.setdefault(key, []).append((name, p))
        groups = []
        for index, (key, params) in enumerate(members.items()):
            pg = pgs[key]
            world = pg.size()
            slots, offset = [], 0
            for name, p in params:
                rows = p.shape[0] if p.dim() else 1
                row = p.numel() // max(rows, 1)
                slice_numel = -(-rows // world) * row
                slots.append(ParamSlot(name, tuple(p.shape), p.numel(), offset, slice_numel))
                offset += slice_numel
            dtype = params[0][1].to_local().dtype
            groups.append(
                GradGroup(index, Kind.PER_PARAM, tuple(_compat.group_ranks(pg)), offset, dtype, dtype, tuple(slots))
            )
            self.groups[index] = pg
        self.layout = GradLayout("fsdp2", tuple(groups), tuple(n for n, _ in named))
        self.fingerprint = self.layout.fingerprint()
        self._accumulating = _accumulating_params(model)

    def valid(self) -> bool:
        return [(n, id(p)) for n, p in self.model.named_parameters() if n in self.params] == self._ids

    def read(self) -> LocalGrads:
        if any(self._accumulating()):
            return LocalGrads(Problem.NOT_BOUNDARY, [])
        grads = [p.grad for p in self.params.values()]
        if all(g is None for g in grads):
            return LocalGrads(Problem.NO_BACKWARD, [])
        buffers = []
        for group in self.layout.groups:
            rank = group.group_ranks.index(torch.distributed.get_rank()) if group.world > 1 else 0
            pieces = []
            for slot in group.params:
                p = self.params[slot.name]
                owned = max(0, min(slot.slice_numel, slot.numel - rank * slot.slice_numel))
                grad = p.grad
                if grad is None:  # took no part in backward: its gradient is zero
                    local = torch.zeros(owned, dtype=group.wire_dtype, device=self.device)
                else:
                    local = grad.to_local().reshape(-1) if isinstance(grad, DTensor) else None
                    if local is None or local.numel() != owned:
                        return LocalGrads(
                            Problem.LAYOUT_CHANGED,
                            [],
                            detail=f"{slot.name}: the local gradient shard is not the {owned} elements of dim-0 rows "
                            "FSDP2 gives this rank",
                        )
                pieces.append(local)
                if owned < slot.slice_numel:  # the padding every rank's slice has, so that gathers line up
                    pieces.append(_zeros(self.scratch, slot.slice_numel - owned, group.wire_dtype, self.device))
            buffers.append(Pieces(pieces))
        return LocalGrads(Problem.OK, buffers)


def _zeros(scratch: dict, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Read-only zero padding, kept between calls (never written: no fragment covers padding)."""
    key = ("padding", dtype, device)
    found = scratch.get(key)
    if found is None or found.numel() < numel:
        found = scratch[key] = torch.zeros(numel, dtype=dtype, device=device)
    return found[:numel]


def _accumulating_params(model: nn.Module):
    """A function telling, per FSDP parameter, whether it holds gradients accumulated without
    reduction (micro-steps under ``set_requires_gradient_sync(False)``)."""
    fsdp_params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                fsdp_params.extend(group.fsdp_params)

    def accumulating():
        # FSDP2's post-backward without reduction leaves the unreduced gradient on the unsharded
        # parameter, or upcast in unsharded_accumulated_grad (reduce_dtype); a reducing one clears both.
        for fp in fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            yield getattr(fp, "unsharded_accumulated_grad", None) is not None or (
                unsharded is not None and unsharded.grad is not None
            )

    return accumulating


def open_fsdp2(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> Source:
    return FSDP2Source(model, named)


def shard_whole(model: nn.Module, device_type: str, world: int) -> nn.Module:
    """``model`` sharded with ``fully_shard`` as one unit over all ``world`` ranks (the benchmark's
    model; it reaches FSDP2 through here, as it reaches DeepSpeed through the adapter)."""
    fully_shard(model, mesh=init_device_mesh(device_type, (world,)))
    return model
