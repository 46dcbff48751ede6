"""The DeepSpeed adapter: the only module of collgrad that imports deepspeed.

It reads, without communicating, where DeepSpeed 0.19 keeps each rank's reduced, averaged gradient
partition (../shared/notes/deepspeed-gradient-layout.md, verified on two CPU ranks):

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``): per param group ``i``, a flat buffer padded so that every rank
  owns ``partition_size[i]`` elements. The partition is read from, in this order: the CPU-offload
  fp32 ``single_partition_of_fp32_groups[i].grad``; the fp32 ``averaged_gradients[i].flat_partition``
  kept with bf16 + fp32 accumulation (preferred to the bf16 staging gradients); the list
  ``averaged_gradients[i]`` of fragments (one copy to make it contiguous). Parameter offsets come
  from the flat buffer itself (parameters are views of ``bit16_groups_flat[i]``), never from
  ``_hp_mapping``: with ``round_robin_gradients`` DeepSpeed's mapping points at the wrong places.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter's partition, as DeepSpeed's own local
  accessor ``_get_fp32_grad_state_partition`` returns it (flat buffer, CPU offload or NVMe), grouped
  by the parameter's partition group.
- ``BF16_Optimizer`` (ZeRO-1 + bf16 + fp32 accumulation): every rank already holds every averaged fp32
  gradient (``p._hp_grad``); nothing to communicate. ``p.grad`` is the local, unreduced staging
  gradient there and is never read.
- ZeRO stage 0: ``param.grad`` is already all-reduced by the engine.
- Any other optimizer: DeepSpeed's per-parameter ``safe_get_full_grad``, recorded as a fallback.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

import deepspeed  # noqa: F401  (the adapter's one dependency on DeepSpeed)
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import safe_get_full_grad

from collgrad import _compat
from collgrad.buffers import Pieces
from collgrad.sources import LocalGrads, Problem, replicated_grads
from collgrad.sources.layout import GradGroup, GradLayout, Kind, ParamSlot

__all__ = ["find_engine", "read"]


def find_engine(model: Any) -> DeepSpeedEngine | None:
    """``model`` itself if it is an engine, else the engine that wraps the module ``model``."""
    if isinstance(model, DeepSpeedEngine):
        return model
    if not isinstance(model, nn.Module):
        return None
    # DeepSpeed keeps no registry of engines; the engine holds the module in its _modules dict.
    for holder in gc.get_referrers(model):
        if isinstance(holder, dict):
            for owner in gc.get_referrers(holder):
                if isinstance(owner, DeepSpeedEngine) and owner.module is model:
                    return owner
    return None


def _control_group(engine: DeepSpeedEngine):
    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    return group if group is not None else _compat.default_group()


def _problem(engine: DeepSpeedEngine, backward_seen: bool) -> Problem:
    """Whether this is the window between the boundary backward() and step(). ``backward_seen``: the
    optimizer holds gradients of a backward() run since the last step() (each variant knows how)."""
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        return Problem.UNMANAGED_ACCUMULATION
    if not backward_seen:
        return Problem.NO_BACKWARD
    if not engine.is_gradient_accumulation_boundary():
        return Problem.NOT_BOUNDARY
    return Problem.OK


def _loss_scale(engine: DeepSpeedEngine) -> float:
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    scale = getattr(opt, "loss_scale", None)
    if scale is None:
        scale = getattr(opt, "cur_scale", 1.0)
    return float(scale)


def read(engine: DeepSpeedEngine, named: list[tuple[str, nn.Parameter]]) -> LocalGrads:
    opt = engine.optimizer
    kind = type(opt).__name__
    names = {id(p): n for n, p in named}
    model_parallel = frozenset(n for n, p in named if is_model_parallel_parameter(p) or is_moe_param(p))
    if kind == "DeepSpeedZeroOptimizer":
        # step() resets micro_step_id to -1; the first gradient hook of a backward() advances it.
        problem = _problem(engine, opt.micro_step_id >= 0)
        return _zero12(engine, opt, named, names, problem, model_parallel)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        # Set by the backward epilogue; cleared by zero_grad() in step() and at the next forward.
        problem = _problem(engine, bool(getattr(opt, "_epilogue_ran_this_backward", True)))
        return _zero3(engine, opt, named, names, problem, model_parallel)
    if kind == "BF16_Optimizer":
        # Set when backward adds into the fp32 accumulation buffer; cleared by zero_grad() in step().
        problem = _problem(engine, any(any(flags) for flags in opt.fp32_groups_has_gradients))
        grads = [getattr(p, "_hp_grad", None) for _, p in named]
        return replicated_grads("deepspeed-bf16-optimizer", named, grads, problem, _control_group(engine),
                                1.0, model_parallel)
    if engine.zero_optimization_stage() == 0:
        grads = [p.grad for _, p in named]
        problem = _problem(engine, not named or any(g is not None for g in grads))
        return replicated_grads("deepspeed-stage0", named, grads, problem, _control_group(engine),
                                _loss_scale(engine), model_parallel)
    # An optimizer whose layout collgrad does not know: DeepSpeed's accessor, one collective per parameter.
    problem = _problem(engine, True)
    local = replicated_grads(f"deepspeed-accessor:{kind}", named, [None] * len(named), problem,
                             _control_group(engine), _loss_scale(engine), model_parallel)
    local.per_param = safe_get_full_grad
    return local


def _offset_in(buffer: torch.Tensor, view: torch.Tensor) -> int:
    return (view.data_ptr() - buffer.data_ptr()) // view.element_size()


def _zero12(engine, opt, named, names, problem, model_parallel) -> LocalGrads:
    groups, buffers, pgs = [], [], {}
    device = named[0][1].device if named else torch.device("cpu")
    for i, flat in enumerate(opt.bit16_groups_flat):
        pg = opt.real_dp_process_group[i]
        ranks = tuple(_compat.group_ranks(pg))
        size = opt.partition_size[i]
        slots = sorted(
            (ParamSlot(names[id(p)], tuple(p.shape), p.numel(), _offset_in(flat, p), p.numel(), names[id(p)] in model_parallel)
             for p in opt.bit16_groups[i] if id(p) in names),
            key=lambda s: s.offset,
        )
        local = None
        if opt.cpu_offload:
            local = opt.single_partition_of_fp32_groups[i].grad
        else:
            averaged = opt.averaged_gradients.get(i) if isinstance(opt.averaged_gradients, dict) else None
            if averaged is not None:
                flat_partition = getattr(averaged, "flat_partition", None)  # bf16 + fp32 accumulation
                local = flat_partition if flat_partition is not None else Pieces(averaged)
        if local is None and problem is Problem.OK:
            problem = Problem.NO_GRADIENT_BUFFERS
        wire = local.dtype if local is not None else flat.dtype
        if local is not None and local.numel() != size:
            raise RuntimeError(
                f"rank {torch.distributed.get_rank()}: param group {i}: local gradient partition has "
                f"{local.numel()} elements, the layout says {size}; this DeepSpeed version's layout is "
                "not the one collgrad knows: report it, and use deepspeed.utils.safe_get_full_grad meanwhile"
            )
        if slots:
            groups.append(GradGroup(i, Kind.PARTITIONED_FLAT, ranks, size, wire, torch.float32, tuple(slots)))
            buffers.append(local if isinstance(local, Pieces) or local is None else Pieces([local]))
            pgs[i] = pg
    layout = GradLayout(f"deepspeed-zero{engine.zero_optimization_stage()}", tuple(groups), tuple(n for n, _ in named))
    return LocalGrads(layout, buffers if problem is Problem.OK else [], problem, _control_group(engine), pgs,
                      device, _loss_scale(engine), model_parallel, params=dict(named))


def _zero3(engine, opt, named, names, problem, model_parallel) -> LocalGrads:
    out_dtype = getattr(opt, "master_weights_and_grads_dtype", torch.float32)
    device = named[0][1].device if named else torch.device("cpu")
    by_group: dict[int, list] = {}
    pgs = {}
    swappable = getattr(opt, "_swappable_optimizer_subgroup", lambda g: False)
    for sub_group in opt.fp16_groups:
        for p in sub_group:
            if id(p) not in names:
                continue
            pg = opt._get_param_partition_group(p)
            key = id(pg)
            pgs.setdefault(key, pg)
            part = None
            if problem is Problem.OK:
                part, g = opt._get_fp32_grad_state_partition(p, release_swap_buffers=False)
                if swappable(g):  # NVMe: the swap buffer is released below, keep a copy
                    part = part.clone()
            by_group.setdefault(key, []).append((p, part))
    for g in range(len(opt.fp16_groups)):
        if problem is Problem.OK and swappable(g) and hasattr(opt, "_release_swap_buffers"):
            opt._release_swap_buffers(g)
    groups, buffers, group_pgs = [], [], {}
    for index, (key, entries) in enumerate(by_group.items()):
        pg = pgs[key]
        slots, offset = [], 0
        for p, _ in entries:
            name = names[id(p)]
            slots.append(ParamSlot(name, tuple(p.ds_shape), p.ds_numel, offset, p.partition_numel(), name in model_parallel))
            offset += p.partition_numel()
        parts = [part for _, part in entries]
        wire = parts[0].dtype if parts and parts[0] is not None else out_dtype
        groups.append(GradGroup(index, Kind.PER_PARAM, tuple(_compat.group_ranks(pg)), offset, wire, out_dtype, tuple(slots)))
        buffers.append(Pieces(parts) if problem is Problem.OK else None)
        group_pgs[index] = pg
    layout = GradLayout("deepspeed-zero3", tuple(groups), tuple(n for n, _ in named))
    return LocalGrads(layout, buffers if problem is Problem.OK else [], problem, _control_group(engine), group_pgs,
                      device, _loss_scale(engine), model_parallel, params=dict(named))
