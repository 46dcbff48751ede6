"""The DeepSpeed adapter: the only module of collgrad that imports deepspeed.

It reads, without communicating, where DeepSpeed 0.19 keeps each rank's reduced, averaged gradient
partition (docs/notes/deepspeed-gradient-layout.md, verified on two CPU ranks):

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``): per param group ``i``, a flat buffer padded so that every rank
  owns ``partition_size[i]`` elements. The partition is read from, in this order: the CPU-offload
  fp32 ``single_partition_of_fp32_groups[i].grad``; the fp32 ``averaged_gradients[i].flat_partition``
  kept with bf16 + fp32 accumulation (preferred to the bf16 staging gradients); the list
  ``averaged_gradients[i]`` of fragments. Parameter offsets come from the flat buffer itself
  (parameters are views of ``bit16_groups_flat[i]``), never from ``_hp_mapping``: with
  ``round_robin_gradients`` DeepSpeed's mapping points at the wrong places.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter's partition, as DeepSpeed's own local
  accessor ``_get_fp32_grad_state_partition`` returns it (flat buffer, CPU offload or NVMe), grouped
  by the parameter's partition group.
- ``BF16_Optimizer`` (ZeRO-1 + bf16 + fp32 accumulation): every rank already holds every averaged fp32
  gradient (``p._hp_grad``); nothing to communicate. ``p.grad`` is the local, unreduced staging
  gradient there and is never read.
- ZeRO stage 0: ``param.grad`` is already all-reduced by the engine.
- Any other optimizer: DeepSpeed's per-parameter ``safe_get_full_grad``, recorded as a fallback.

Whether reading is valid now ("a backward() ran since the last step()") is told by state each
optimizer keeps for itself; see ``_problem``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import deepspeed
import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)
from torch import nn

from collgrad import _compat
from collgrad.core.buffers import Pieces, PiecesCache
from collgrad.errors import InvalidArgumentError
from collgrad.state.cache import PlanCache
from collgrad.state.adapters.base import LocalGrads, Problem, ReplicatedSource, Source
from collgrad.state.adapters.engine_hooks import hook_model_step, release_on_offload
from collgrad.state.adapters.layout import GradGroup, GradLayout, Kind, ParamSlot
from collgrad.state.adapters.swap import SwappedIn

__all__ = [
    "find_engine",
    "hook_model_step",
    "open_engine",
    "model_parallel_names",
    "DeepSpeedEngine",
    "zero3_group",
    "control_group",
    "initialize",
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_get_full_fp32_param",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "GatheredParameters",
    "VERSION",
]

VERSION: str = deepspeed.__version__
GatheredParameters = deepspeed.zero.GatheredParameters  # the documented way to change ZeRO-3 weights

# DeepSpeed's engine imports its Muon optimizer module on first initialize(), and with it torch.compile's
# torch._inductor (seconds, more on a loaded machine). Importing it with the adapter makes any process
# that has the adapter ready to build engines: run_local's preloaded forkserver (collgrad/launch.py)
# imports this module, so its ranks pay that once per process, not once per launch.
try:
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
except ImportError:  # a 0.19 release without it: the engine imports what it needs itself
    pass


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> DeepSpeedEngine:
    """``deepspeed.initialize`` for collgrad's own tools (the benchmark), so that they too reach
    DeepSpeed only through this module. Collective: every rank of the job calls it."""
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


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


def control_group(engine: DeepSpeedEngine):
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


def model_parallel_names(named: list[tuple[str, nn.Parameter]]) -> frozenset[str]:
    """The parameters that are shards of a model-parallel (AutoTP, Megatron) or expert (MoE) split: what
    a gather over the data-parallel group rebuilds stays that rank's shard."""
    return frozenset(n for n, p in named if is_model_parallel_parameter(p) or is_moe_param(p))


def open_engine(engine: DeepSpeedEngine, named: list[tuple[str, nn.Parameter]]) -> Source:
    opt = engine.optimizer
    if opt is None:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: this DeepSpeed engine has no optimizer, so DeepSpeed reduces no gradient: "
            "pass an optimizer to "
            "deepspeed.initialize, or pass the module itself if its .grad already holds reduced gradients"
        )
    kind = type(opt).__name__
    model_parallel = model_parallel_names(named)
    if kind == "DeepSpeedZeroOptimizer":
        return _Zero12(engine, named, model_parallel)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        return _Zero3(engine, named, model_parallel)
    group = control_group(engine)
    engine_ref = weakref.ref(engine)  # sources are cached keyed weakly by the engine: never hold it
    if kind == "BF16_Optimizer":
        # fp32_groups_has_gradients: set when backward adds into the fp32 accumulation buffer, cleared
        # by zero_grad() in step().
        return ReplicatedSource(
            "deepspeed-bf16-optimizer",
            named,
            lambda: [getattr(p, "_hp_grad", None) for _, p in named],
            group,
            problem=lambda: _problem(engine_ref(), any(any(f) for f in opt.fp32_groups_has_gradients)),
            model_parallel=model_parallel,
            dtype=torch.float32,
        )
    if engine.zero_optimization_stage() == 0:
        grads = lambda: [p.grad for _, p in named]  # noqa: E731
        return ReplicatedSource(
            "deepspeed-stage0",
            named,
            grads,
            group,
            problem=lambda: _problem(engine_ref(), not named or any(g is not None for g in grads())),
            loss_scale=lambda: _loss_scale(engine_ref()),
            model_parallel=model_parallel,
            set_grad=lambda p, g: setattr(p, "grad", g),
        )
    # An optimizer whose layout collgrad does not know: DeepSpeed's accessor, one collective per parameter.
    source = ReplicatedSource(
        f"deepspeed-accessor:{kind}",
        named,
        lambda: [None] * len(named),
        group,
        problem=lambda: _problem(engine_ref(), True),
        loss_scale=lambda: _loss_scale(engine_ref()),
        model_parallel=model_parallel,
        dtype=torch.float32,
    )
    source.accessor = safe_get_full_grad
    source.accessor_set = safe_set_full_grad
    return source


class _EngineSource(Source):
    def __init__(self, engine: DeepSpeedEngine, named, model_parallel) -> None:
        self._engine = weakref.ref(engine)  # cached keyed weakly by the engine: never hold it
        self.opt = engine.optimizer
        self.params = dict(named)
        self.names = {id(p): n for n, p in named}
        self.model_parallel = model_parallel
        self.device = named[0][1].device if named else torch.device("cpu")
        self.control_group = control_group(engine)
        self.groups = {}
        self.scratch = {}
        self.plans = PlanCache()
        release_on_offload(engine, self)

    @property
    def engine(self) -> DeepSpeedEngine:
        return self._engine()


class _Zero12(_EngineSource):
    """ZeRO-1/2: equal contiguous partitions of one padded flat buffer per param group."""

    def __init__(self, engine, named, model_parallel) -> None:
        super().__init__(engine, named, model_parallel)
        opt, groups = self.opt, []
        self.group_ids = []
        for i, flat in enumerate(opt.bit16_groups_flat):
            slots = sorted(
                (
                    ParamSlot(
                        self.names[id(p)],
                        tuple(p.shape),
                        p.numel(),
                        (p.data_ptr() - flat.data_ptr()) // p.element_size(),
                        p.numel(),
                        self.names[id(p)] in model_parallel,
                    )
                    for p in opt.bit16_groups[i]
                    if id(p) in self.names
                ),
                key=lambda s: s.offset,
            )
            if not slots:
                continue
            pg = opt.real_dp_process_group[i]
            groups.append(
                GradGroup(
                    i,
                    Kind.PARTITIONED_FLAT,
                    tuple(_compat.group_ranks(pg)),
                    opt.partition_size[i],
                    self._wire_dtype(i),
                    torch.float32,
                    tuple(slots),
                )
            )
            self.groups[i] = pg
            self.group_ids.append(i)
        self.layout = GradLayout(
            f"deepspeed-zero{engine.zero_optimization_stage()}", tuple(groups), tuple(n for n, _ in named)
        )
        self.fingerprint = self.layout.fingerprint()
        self._signature = self._sign()

    def _wire_dtype(self, i: int) -> torch.dtype:
        """The dtype of group ``i``'s local partition: fp32 where DeepSpeed accumulates in fp32 (offload,
        or bf16 with grad_accum_dtype fp32), else the model's."""
        opt = self.opt
        return torch.float32 if (opt.cpu_offload or _fp32_accumulation(opt)) else opt.bit16_groups_flat[i].dtype

    def _sign(self):
        return tuple((f.data_ptr(), f.numel()) for f in self.opt.bit16_groups_flat)

    def valid(self) -> bool:
        return self._sign() == self._signature

    def _pieces_of(self, i: int, fragments: list) -> Pieces:
        """Group ``i``'s fragment list as Pieces, where they lie known from the last call while
        DeepSpeed holds the same fragment tensors (see PiecesCache)."""
        cache = self.scratch.get(("pieces", i))
        if cache is None:
            cache = self.scratch[("pieces", i)] = PiecesCache()
        return cache.pieces(fragments)

    def read(self) -> LocalGrads:
        opt = self.opt
        # step() resets micro_step_id to -1; the first gradient hook of a backward() advances it.
        problem = _problem(self.engine, opt.micro_step_id >= 0)
        if problem is not Problem.OK:
            return LocalGrads(problem, [])
        buffers = []
        for group in self.layout.groups:
            i = group.index
            if opt.cpu_offload:
                local = Pieces([opt.single_partition_of_fp32_groups[i].grad])
            else:
                averaged = opt.averaged_gradients.get(i) if isinstance(opt.averaged_gradients, dict) else None
                if averaged is None:
                    return LocalGrads(Problem.NO_GRADIENT_BUFFERS, [])
                flat_partition = getattr(averaged, "flat_partition", None)  # bf16 + fp32 accumulation
                local = self._pieces_of(i, [flat_partition] if flat_partition is not None else averaged)
            if local.numel() != group.partition_numel or local.dtype != group.wire_dtype:
                # Told to every rank in the readiness check, which then raises LayoutChangedError everywhere.
                return LocalGrads(
                    Problem.LAYOUT_CHANGED,
                    [],
                    detail=(
                        f"param group {i}: local gradient partition is {local.numel()} x {local.dtype}, "
                        "the layout says "
                        f"{group.partition_numel} x {group.wire_dtype}"
                    ),
                )
            buffers.append(local)
        return LocalGrads(problem, buffers, _loss_scale(self.engine))

    def after_write(self, values) -> None:
        """With CPU offload, ZeRO-1/2 clips with per-parameter norms it computed during backward
        (``norm_for_param_grads``, one per owned fragment): recompute them from the written values, as
        ``copy_grads_in_partition`` does, or the next step clips with the old norms."""
        opt = self.opt
        if not opt.cpu_offload:
            return
        for i in self.group_ids:
            grad = opt.single_partition_of_fp32_groups[i].grad.view(-1)
            for p in opt.params_in_partition[i]:
                if self.names.get(id(p)) in values:
                    param_id = opt.get_param_id(p)
                    _, _, dest_offset, numel = opt.grad_position[param_id]
                    opt.norm_for_param_grads[param_id] = grad.narrow(0, dest_offset, numel).to(get_norm_dtype()).norm(2)


def _fp32_accumulation(opt) -> bool:
    """bf16 + ``grad_accum_dtype: fp32`` keeps a compact fp32 partition (GradPartitionBufferGroup)."""
    accum = getattr(opt, "gradient_accumulation_dtype", None)
    return accum == torch.float32 and opt.bit16_groups_flat[0].dtype != torch.float32


def zero3_group(index: int, params: list, names: list[str], pg, model_parallel, wire, out) -> GradGroup:
    """ZeRO-3 ``params`` partitioned over ``pg`` as layout group ``index``: each rank holds
    ``partition_numel()`` elements of each, back to back in this order."""
    slots, offset = [], 0
    for p, name in zip(params, names):
        slots.append(
            ParamSlot(name, tuple(p.ds_shape), p.ds_numel, offset, p.partition_numel(), name in model_parallel)
        )
        offset += p.partition_numel()
    return GradGroup(index, Kind.SLICED, tuple(_compat.group_ranks(pg)), offset, wire, out, tuple(slots))


class _Zero3(_EngineSource):
    """ZeRO-3: every parameter cut into equal slices; a rank's slices lie back to back."""

    def __init__(self, engine, named, model_parallel) -> None:
        super().__init__(engine, named, model_parallel)
        opt = self.opt
        self.out_dtype = getattr(opt, "master_weights_and_grads_dtype", torch.float32)
        self.members: dict[int, list[nn.Parameter]] = {}
        pgs = {}
        for sub_group in opt.fp16_groups:
            for p in sub_group:
                if id(p) in self.names:
                    pg = opt._get_param_partition_group(p)
                    pgs.setdefault(id(pg), pg)
                    self.members.setdefault(id(pg), []).append(p)
        self.swaps = any(
            getattr(opt, "_swappable_optimizer_subgroup", lambda g: False)(g) for g in range(len(opt.fp16_groups))
        )
        groups = []
        wire = self._wire_dtype()
        for index, (key, params) in enumerate(self.members.items()):
            names = [self.names[id(p)] for p in params]
            groups.append(zero3_group(index, params, names, pgs[key], model_parallel, wire, self.out_dtype))
            self.groups[index] = pgs[key]
        self.layout = GradLayout("deepspeed-zero3", tuple(groups), tuple(n for n, _ in named))
        self.fingerprint = self.layout.fingerprint()
        self._pieces: list[Pieces] | None = None
        self._signature = self._sign()

    def _wire_dtype(self) -> torch.dtype:
        opt = self.opt
        if getattr(opt, "offload_optimizer", False):
            return opt.fp32_partitioned_groups_flat[0].dtype
        buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        return buffer.dtype if buffer is not None else self.out_dtype

    def _sign(self):
        opt = self.opt
        buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        grads = tuple(
            getattr(g.grad, "data_ptr", lambda: 0)()
            for g in getattr(opt, "fp32_partitioned_groups_flat", [])
            if g.grad is not None
        )
        return (None if buffer is None else buffer.data_ptr(), grads)

    def valid(self) -> bool:
        return self._sign() == self._signature

    def release(self) -> None:
        super().release()
        self._pieces = None

    def read(self) -> LocalGrads:
        opt = self.opt
        # Set by the backward epilogue; cleared by zero_grad() in step() and at the next forward.
        problem = _problem(self.engine, bool(getattr(opt, "_epilogue_ran_this_backward", True)))
        if problem is not Problem.OK:
            return LocalGrads(problem, [])
        if self._pieces is not None and not self.swaps and self._sign() == self._signature:
            return LocalGrads(problem, self._pieces, _loss_scale(self.engine))  # views of live buffers
        pieces = []
        with SwappedIn(opt, write_back=False) as swapped:
            for params in self.members.values():
                parts = []
                for p in params:
                    grad = swapped.grad(p) if self.swaps else None
                    if grad is None:  # in memory: a view of DeepSpeed's own buffer
                        parts.append(opt._get_fp32_grad_state_partition(p, release_swap_buffers=False)[0])
                    else:  # in swap buffers that go back to their pool: a copy
                        parts.append(grad.clone())
                pieces.append(Pieces(parts))
        self._signature = self._sign()
        self._pieces = None if self.swaps else pieces
        return LocalGrads(problem, pieces, _loss_scale(self.engine))

    def write(self, local: LocalGrads, values, scale: float) -> None:
        """Through DeepSpeed's own local setter, parameter by parameter (no communication): it writes
        this rank's slice where the step reads it (flat buffer, CPU offload, NVMe swap write-back) and
        refreshes the per-parameter norms offload clips with. NVMe: that setter swaps the parameter's
        whole sub-group in and its gradients out again, per parameter; here once per sub-group."""
        opt = self.opt
        with SwappedIn(opt, write_back=True) as swapped:
            for name, new in values.items():
                p = self.params[name]
                rank = torch.distributed.get_rank(group=opt._get_param_partition_group(p))
                size = p.partition_numel()
                flat = new.detach().reshape(-1).to(torch.float32)
                part = torch.zeros(size, dtype=torch.float32, device=flat.device)
                lo, hi = min(rank * size, flat.numel()), min((rank + 1) * size, flat.numel())
                part[: hi - lo] = flat[lo:hi]
                if scale != 1.0:
                    part.mul_(scale)
                grad = swapped.grad(p) if self.swaps else None
                if grad is None:
                    opt.set_local_grad_for_param(part, p)
                else:  # what set_local_grad_for_param does, less its swap-in and write-back per parameter
                    opt.norm_for_param_grads[opt.get_param_id(p)] = opt._constant_buffered_norm2(part)
                    grad.copy_(part)
