"""The DeepSpeed adapter: the only module of collgrad that imports deepspeed or reads its internals
(the drop-in in collgrad/integrations/deepspeed.py reaches them through here).

``open_engine(engine, named, kind)`` reads, without communicating, where DeepSpeed 0.19 keeps each
rank's part of every kind of state. Gradients, each rank's reduced, averaged partition
(docs/notes/deepspeed-gradient-layout.md, verified on two CPU ranks):

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
optimizer keeps for itself; see ``_problem``. The fp32 masters, their optimizer states and the module's
weights: see ``open_engine``. One source class per layout (``_Zero12``, ``_Zero3``, ``_Zero3Weights``,
the replicated and accessor sources), each told the kind of state it reads.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any, Callable, ClassVar, Hashable, Iterable, Mapping, Sequence

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META as _AUTOTP_META
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils import (
    groups,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)
from torch import nn
from torch.distributed import ProcessGroup

from collgrad import _compat
from collgrad.core.buffers import Pieces, PiecesCache
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import (
    TENSOR_PARALLEL,
    Copies,
    LocalGrads,
    Model,
    OptimizerView,
    Problem,
    ReplicatedSource,
    Source,
    always_ok,
    copy_all,
    copy_to_weights,
    per_element_state,
    select,
    whole_values,
)
from collgrad.state.adapters.engine_hooks import hook_model_step, release_on_offload
from collgrad.state.adapters.swap import SwappedIn
from collgrad.state.cache import PlanCache
from collgrad.state.kinds import FP32, GRAD, WEIGHTS, StateKind
from collgrad.state.layout import Expert, LayoutGroup, ParamSlot, Partitioning, Split, StateLayout

__all__ = [
    "adapt_engine",
    "DeepSpeedModel",
    "find_engine",
    "accessor_module",
    "zero_managed",
    "own_grad",
    "full_numel",
    "DeepSpeedEngine",
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_get_full_fp32_param",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "GatheredParameters",
    "VERSION",
]

#: A selection of parameters by name, in module order.
Named = list[tuple[str, nn.Parameter]]

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
# Likewise DeepSpeed's probe of which of its ops this machine can build: computed on first access and
# kept in deepspeed.ops (0.19), asked by every engine's communication backend (for its shared-memory
# collective op), a compiler check per op (~0.4 s). Asked here, a forkserver's ranks inherit the answer;
# any other process that builds an engine asks it anyway.
deepspeed.ops.__compatible_ops__  # noqa: B018


def find_engine(model: Any) -> DeepSpeedEngine | None:
    """``model`` itself if it is an engine, else the engine that wraps the module ``model``, else None.

    DeepSpeed keeps no registry of its engines, and a module does not point at its engine; but every
    engine registers a forward pre-hook on its module (``DeepSpeedEngine._create_module_forward_pre_hook``
    in 0.19: a closure over the engine), so the engine is found among the module's own hooks. DeepCompile
    removes that hook while it is active: ``refuse_unfound`` then asks for the engine itself."""
    if isinstance(model, DeepSpeedEngine):
        return model
    if not isinstance(model, nn.Module):
        return None
    for hook in model._forward_pre_hooks.values():
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                owner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(owner, DeepSpeedEngine) and owner.module is model:
                return owner
    return None


def adapt_engine(model: object) -> DeepSpeedModel | None:
    """The adapter of the engine ``model`` is or wraps (``find_engine``), else None; InvalidArgumentError
    (this rank) for a module whose parameters DeepSpeed manages but whose engine cannot be found
    (``refuse_unfound``). Local."""
    engine = find_engine(model)
    if engine is None and isinstance(model, nn.Module):
        refuse_unfound(model)
    return DeepSpeedModel(engine) if engine is not None else None


class DeepSpeedModel(Model):
    """A DeepSpeed engine (ZeRO-0/1/2/3, BF16_Optimizer, any optimizer it wraps), found once. Built by
    ``adapt_engine``; holds the engine only for the call that resolved it."""

    framework: ClassVar[str] = "deepspeed"
    #: DeepSpeed names a MoE layer's param group by its expert-parallel size (``ep_size_<E>``: its ZeRO
    #: optimizer finds the expert-data-parallel group by it) and flags it ``moe``: from a checkpoint written
    #: at another ``ep_size`` they would name a group this engine does not have.
    layout_keys: ClassVar[tuple[str, ...]] = ("name", "moe")

    def __init__(self, engine: DeepSpeedEngine) -> None:
        self.engine = engine
        self.module = engine.module
        self.target = engine

    @property
    def control_group(self) -> ProcessGroup | None:
        return control_group(self.engine) if dist.is_initialized() else None

    @property
    def model_group(self) -> ProcessGroup | None:
        """Under AutoTP, every rank (DeepSpeed spreads one model over the whole world: its tensor-parallel
        groups times its data-parallel ones); else the data-parallel group."""
        if dist.is_initialized() and autotp(self.module):
            return _compat.default_group()
        return self.control_group

    def open(self, params: Iterable[object] | None = None, kind: StateKind = GRAD, optimizer: Any = None) -> Source:
        """The engine's own optimizer holds every state: ``optimizer`` is not used."""
        return open_engine(self.engine, select(self.module, params, trainable=kind != WEIGHTS), kind)

    def unsupported_layout(self) -> str | None:
        """A ``PipelineEngine`` (each stage holds its own layers: no rank knows the others' names) and
        Ulysses sequence parallelism (its data-parallel group folds in the sequence ranks, which collgrad's
        checkpoints have not been shown to place)."""
        engine = self.engine
        if getattr(engine, "pipeline_parallelism", False):
            return (
                f"DeepSpeed pipeline parallelism (stage {engine.stage_id} of {engine.num_stages}: each stage "
                "holds only its own layers)"
            )
        size = getattr(engine, "sequence_parallel_size", 1)
        if size > 1:
            return f"DeepSpeed Ulysses sequence parallelism (sequence_parallel_size {size})"
        return None

    def load_kinds(self) -> tuple[StateKind, ...]:
        return load_kinds(self.engine)

    def hook_step(self, run: Callable[[Any], None]) -> Callable[[], None]:
        return hook_model_step(self.engine, run)

    def optimizer_view(self, optimizer: Any) -> OptimizerView:
        """The engine's own optimizer (``optimizer`` is not used): see ``optimizer_view``."""
        return optimizer_view(self.engine)

    def lr_scheduler(self, given: Any) -> Any:
        return given if given is not None else self.engine.lr_scheduler

    def counters(self) -> dict[str, int | float]:
        engine = self.engine
        out: dict[str, int | float] = {name: int(getattr(engine, name)) for name in ENGINE_COUNTERS}
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if engine.fp16_enabled() and scaler is not None:
            for name in LOSS_SCALER_STATE:
                if isinstance(getattr(scaler, name, None), (int, float)):
                    out[f"loss_scaler.{name}"] = getattr(scaler, name)
        return out

    def set_counters(self, values: Mapping[str, int | float]) -> None:
        engine = self.engine
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        for name, value in values.items():
            if name.startswith("loss_scaler."):
                if scaler is not None:
                    setattr(scaler, name.removeprefix("loss_scaler."), value)
            else:
                setattr(engine, name, value)


#: What a DeepSpeed engine counts of a run (its ``save_checkpoint`` keeps the same).
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
#: The state of DeepSpeed's fp16 loss scaler (``DynamicLossScaler``; a static scaler has ``cur_scale``).
LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def optimizer_view(engine: DeepSpeedEngine) -> OptimizerView:
    """Where ``engine``'s optimizer keeps each trainable parameter's state (DeepSpeed 0.19):

    - ZeRO-1/2: the torch optimizer it wraps (``opt.optimizer``) keys each param group's state by the
      group's flat fp32 partition ``single_partition_of_fp32_groups[i]``; DeepSpeed links its accessors'
      fragments to those states lazily, in its first step (``_lazy_init_hp_params_optimizer_state``).
      ``BF16_Optimizer`` the same, its partitions ``fp32_groups_flat_partition[i]`` of ``bf16_groups[i]``.
    - ZeRO-3: by each sub-group's flat fp32 partition ``fp32_partitioned_groups_flat[i]``, of param group
      ``sub_group_to_group_id[i]``; the wrapped optimizer holds a sub-group's partition in its group's
      params only while DeepSpeed steps it (``_optimizer_step(i)``, which the update here runs too).
    - Stage 0 with a torch optimizer: each parameter itself.

    InvalidArgumentError (this rank) for any other optimizer (fp16 stage 0's, NVMe-swapped sub-groups):
    collgrad does not read their states in place. Local."""
    opt = engine.optimizer
    names = {id(p): n for n, p in select(engine.module, None, trainable=True)}
    kind = type(opt).__name__
    holders: dict[str, torch.Tensor] = {}
    groups: dict[str, int] = {}
    if kind in ("DeepSpeedZeroOptimizer", "BF16_Optimizer"):
        inner = opt.optimizer
        groups_of = opt.bit16_groups if kind == "DeepSpeedZeroOptimizer" else opt.bf16_groups
        flats = (
            opt.single_partition_of_fp32_groups if kind == "DeepSpeedZeroOptimizer" else opt.fp32_groups_flat_partition
        )
        for i, params in enumerate(groups_of):
            flat = flats[i]
            group = next(k for k, g in enumerate(inner.param_groups) if any(p is flat for p in g["params"]))
            for p in params:
                if id(p) in names:
                    holders[names[id(p)]], groups[names[id(p)]] = flat, group

        def linked() -> None:
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

        def unlinked() -> None:
            opt._hp_optimizer_states_linked = False

        return OptimizerView(inner, holders, groups, inner.step, linked, unlinked)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        if any(opt._swappable_optimizer_subgroup(i) for i in range(len(opt.fp16_groups))):
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: this ZeRO-3 engine swaps optimizer states to NVMe, which a training "
                "state does not read yet: save it with engine.save_checkpoint"
            )
        for i, params in enumerate(opt.fp16_groups):
            flat = opt.fp32_partitioned_groups_flat[i]
            for p in params:
                if id(p) in names:
                    holders[names[id(p)]], groups[names[id(p)]] = flat, opt.sub_group_to_group_id[i]

        def step() -> None:
            for i in range(len(opt.fp16_groups)):
                opt._optimizer_step(i)

        return OptimizerView(opt.optimizer, holders, groups, step)
    if isinstance(opt, torch.optim.Optimizer):
        return Model.optimizer_view(DeepSpeedModel(engine), opt)
    raise InvalidArgumentError(
        f"rank {_compat.rank()}: {kind} keeps optimizer states a training state does not read yet: "
        "save this engine with engine.save_checkpoint"
    )


def refuse_unfound(module: nn.Module) -> None:
    """A module whose parameters DeepSpeed partitions or links (``ds_id``: ZeRO-3; ``_hp_mapping``:
    ZeRO-1/2) but whose engine ``find_engine`` cannot see: InvalidArgumentError (this rank), since read
    as a plain module it would give this rank's partitions as if they were whole."""
    if any(hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None for p in module.parameters()):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: the parameters of this {type(module).__name__} belong to a DeepSpeed engine "
            "collgrad cannot find from the module (its forward pre-hook is gone, e.g. under DeepCompile): pass "
            "the engine itself"
        )


def zero_managed(param: nn.Parameter) -> bool:
    """DeepSpeed's accessors answer for ``param``: ZeRO-3 partitions it (``ds_id``) or ZeRO-1/2 (and
    BF16_Optimizer) linked it to its fp32 fragment (``_hp_mapping``)."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def own_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient ``param`` holds itself, as DeepSpeed's ``safe_get_full_grad`` answers first: its
    ``.grad`` where BF16_Optimizer keeps no fp32 accumulation (``_hp_grad``) for it; else None."""
    return param.grad if getattr(param, "_hp_grad", None) is None else None


def _whole_here(param: Any) -> bool:
    """Whether ZeRO-3 holds ``param`` whole on this rank now (persistent, below
    ``stage3_param_persistence_threshold``, or gathered): its ``data`` is the whole parameter."""
    return bool(param.data.numel() == param.ds_numel)


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param`` whole (a ZeRO-3 parameter's own shape is empty outside a gather)."""
    return int(getattr(param, "ds_numel", param.numel()))


def accessor_module() -> types.ModuleType:
    """The module that defines DeepSpeed's six full accessors (``deepspeed.utils`` re-exports them), from
    ``sys.modules``: ``deepspeed.utils`` also has a class named ``tensor_fragment``."""
    return sys.modules["deepspeed.utils.tensor_fragment"]


def control_group(engine: DeepSpeedEngine) -> ProcessGroup:
    """The engine's data-parallel group (its sequence-data-parallel one where it has one)."""
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
    scale: Any = getattr(opt, "loss_scale", None)
    if scale is None:
        scale = getattr(opt, "cur_scale", 1.0)
    return float(scale)


def load_kinds(engine: DeepSpeedEngine) -> tuple[StateKind, ...]:
    """What a load writes into ``engine``: the module's weights, and the fp32 master weights where the
    optimizer keeps its own (ZeRO-1/2/3, BF16_Optimizer); a torch optimizer at stage 0 steps the
    module's weights themselves. InvalidArgumentError (this rank) for masters collgrad cannot write."""
    opt = engine.optimizer
    if type(opt).__name__ in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer"):
        return (WEIGHTS, FP32)
    if opt is None or isinstance(opt, torch.optim.Optimizer):
        return (WEIGHTS,)
    raise InvalidArgumentError(
        f"rank {_compat.rank()}: {type(opt).__name__} keeps fp32 master weights collgrad cannot write: load the "
        "weights into the module before deepspeed.initialize"
    )


def model_parallel_names(named: list[tuple[str, nn.Parameter]]) -> frozenset[str]:
    """The parameters that are shards of a model-parallel (AutoTP, Megatron) or expert (MoE) split: what
    a gather over the data-parallel group rebuilds stays that rank's shard. An expert of a MoE layer at
    ``ep_size`` 1 is whole on every rank: not a shard."""
    return frozenset(n for n, p in named if is_model_parallel_parameter(p) or (is_moe_param(p) and _experts_split(p)))


def _experts_split(param: Any) -> bool:
    """Whether an expert parameter's experts are spread over more than one rank (its MoE layer's
    ``ep_size``, which DeepSpeed names its expert-parallel group by: ``group_name`` ``ep_size_<E>``)."""
    return bool(groups._get_expert_parallel_world_size(param.group_name) > 1)


def tensor_parallel_splits(named: list[tuple[str, nn.Parameter]]) -> dict[str, Split]:
    """Where each AutoTP shard of ``named`` lies in its whole tensor, read from the layout DeepSpeed
    records on the parameter (``ds_autotp_universal_checkpoint_meta``: the split's dimension, the whole
    shape and every tensor-parallel rank's size along it; DeepSpeed 0.19's universal checkpoint reads
    the same), and this rank's index in the tensor-parallel group. A replicated parameter (a row-parallel
    layer's bias) is whole: no entry; nor has a shard whose layout is not one slice (a fused layer's
    sub-parameters: ``sub_param_shard_widths``), which stays a model-parallel shard of no known place.
    Local."""
    out: dict[str, Split] = {}
    for name, param in named:
        meta = getattr(param, _AUTOTP_META, None)
        if not is_model_parallel_parameter(param) or not isinstance(meta, dict) or meta.get("replicated"):
            continue
        dim, whole, sizes = meta.get("partition_dim"), meta.get("logical_shape"), meta.get("partition_sizes")
        if dim is None or not whole or not sizes or meta.get("sub_param_shard_widths"):
            continue
        index = groups.get_tensor_model_parallel_rank()
        bounds = tuple(sum(int(n) for n in sizes[:k]) for k in range(len(sizes) + 1))
        split = Split(int(dim), tuple(int(n) for n in whole), bounds[index], bounds[index + 1], bounds)
        shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps the shape aside
        if len(sizes) == groups.get_tensor_model_parallel_world_size() and split.shard_shape() == shape:
            out[name] = split
    return out


def autotp(module: nn.Module) -> bool:
    """Whether DeepSpeed AutoTP split ``module`` (its split parameters carry their layout; only then are
    DeepSpeed's tensor-parallel groups made)."""
    return any(hasattr(p, _AUTOTP_META) for p in module.parameters())


def spread_experts(module: nn.Module) -> dict[str, Expert]:
    """Where each expert of ``module``'s MoE layers whose experts are spread over expert-parallel ranks
    (``ep_size`` > 1) lies in the unsharded model, by the parameter's name here: DeepSpeed 0.19 builds an
    ``Experts`` module per layer holding ``num_local_experts`` experts (``deepspeed_experts.<i>``), the
    experts of expert-parallel rank ``e`` being global indexes ``e * num_local_experts + i`` (the names the
    same model has at ``ep_size`` 1), their parameters tagged with the group's name (``ep_size_<E>``).
    Under tensor parallelism too (DeepSpeed folds the expert groups across the tensor-parallel ones) no
    entry: such an expert stays a shard of no known place. Local."""
    from deepspeed.moe.experts import Experts

    if autotp(module):
        return {}
    out: dict[str, Expert] = {}
    for prefix, layer in module.named_modules():
        if not isinstance(layer, Experts):
            continue
        local = len(layer.deepspeed_experts)
        for i, expert in enumerate(layer.deepspeed_experts):
            for rest, param in expert.named_parameters():
                if not (is_moe_param(param) and _experts_split(param)):
                    continue
                name = param.group_name
                size = groups._get_expert_parallel_world_size(name)
                names = tuple(f"{prefix}.deepspeed_experts.{e * local + i}.{rest}" for e in range(size))
                position = groups._get_expert_parallel_rank(name)
                holders = tuple(groups._get_expert_data_parallel_group_ranks(name))
                out[f"{prefix}.deepspeed_experts.{i}.{rest}"] = Expert(names, position, holders, name, prefix)
    return out


def open_engine(engine: DeepSpeedEngine, named: list[tuple[str, nn.Parameter]], kind: StateKind = GRAD) -> Source:
    """The Source of ``kind`` of ``engine``'s ``named`` parameters, chosen by the optimizer DeepSpeed
    built:

    - ZeRO-1/2 and ZeRO-3: the partitions the optimizer steps (gradients, fp32 masters, optimizer
      states alike); ZeRO-3 sub-groups swapped to NVMe: DeepSpeed's per-parameter accessor.
    - The module's weights: whole on every rank below ZeRO-3; ZeRO-3: each rank's ``ds_tensor``.
    - Otherwise every rank holds each parameter's state whole, or DeepSpeed's accessor reads it
      (``_replicated``).

    States are readable at any time outside ``step()``: no backward is needed. Local: no communication."""
    opt = engine.optimizer
    if opt is None:
        what = "reduces no gradient" if kind == GRAD else f"keeps no {kind.describe()}"
        fix = ", or pass the module itself if its .grad already holds reduced gradients" if kind == GRAD else ""
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: this DeepSpeed engine has no optimizer, so DeepSpeed {what}: pass an "
            f"optimizer to deepspeed.initialize{fix}"
        )
    source = _open(engine, named, kind, type(opt).__name__, model_parallel_names(named))
    source.splits = tensor_parallel_splits(named) if source.model_parallel else {}
    if source.splits:
        source.tensor_parallel_rank = groups.get_tensor_model_parallel_rank()
        source.parallel_groups = {TENSOR_PARALLEL: groups.get_tensor_model_parallel_group()}
    if source.model_parallel - source.splits.keys():
        experts = spread_experts(engine.module)
        source.experts = {n: experts[n] for n in source.model_parallel if n in experts}
        ep = {e.group: groups._get_expert_parallel_group(e.group) for e in source.experts.values()}
        source.parallel_groups = {**source.parallel_groups, **ep}
    return source


def _open(
    engine: DeepSpeedEngine, named: Named, kind: StateKind, optimizer: str, model_parallel: frozenset[str]
) -> Source:
    if kind == WEIGHTS and optimizer == "DeepSpeedZeroOptimizer_Stage3":
        return _Zero3Weights(engine, named, model_parallel)
    if kind != WEIGHTS and optimizer == "DeepSpeedZeroOptimizer":
        return _Zero12(engine, named, model_parallel, kind)
    if kind != WEIGHTS and optimizer == "DeepSpeedZeroOptimizer_Stage3":
        source = _Zero3(engine, named, model_parallel, kind)
        if kind == GRAD or not source.swaps:
            return source
    return _replicated(engine, named, model_parallel, kind, optimizer)


class _EngineSource(Source):
    def __init__(self, engine: DeepSpeedEngine, named: Named, model_parallel: frozenset[str]) -> None:
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
    """ZeRO-1/2: equal contiguous partitions of one padded flat buffer per param group. Every kind lies
    so: the reduced gradient partition, the fp32 master partition ``single_partition_of_fp32_groups[i]``
    and each of its optimizer states are flat tensors of ``partition_size[i]`` elements in the flat
    buffer's order (one piece per rank for the master and its states)."""

    def __init__(self, engine: DeepSpeedEngine, named: Named, model_parallel: frozenset[str], kind: StateKind) -> None:
        self.kind = kind
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
                LayoutGroup(
                    i,
                    Partitioning.PARTITIONED_FLAT,
                    tuple(_compat.group_ranks(pg)),
                    opt.partition_size[i],
                    self._wire_dtype(i),
                    torch.float32,
                    tuple(slots),
                )
            )
            self.groups[i] = pg
            self.group_ids.append(i)
        self.layout = StateLayout(
            f"deepspeed-zero{engine.zero_optimization_stage()}", tuple(groups), tuple(n for n, _ in named)
        )
        self._signature = self._sign()

    def _wire_dtype(self, i: int) -> torch.dtype:
        """The dtype of group ``i``'s local partition: the master's for the fp32 weights and their
        states; for gradients fp32 where DeepSpeed accumulates in fp32 (offload, or bf16 with
        grad_accum_dtype fp32), else the model's."""
        opt = self.opt
        if self.kind != GRAD:
            master: torch.dtype = opt.single_partition_of_fp32_groups[i].dtype
            return master
        model: torch.dtype = opt.bit16_groups_flat[i].dtype
        return torch.float32 if (opt.cpu_offload or _fp32_accumulation(opt)) else model

    def _sign(self) -> Hashable:
        return tuple((f.data_ptr(), f.numel()) for f in self.opt.bit16_groups_flat)

    def valid(self) -> bool:
        return bool(self._sign() == self._signature)

    def _pieces_of(self, i: int, fragments: Sequence[torch.Tensor]) -> Pieces:
        """Group ``i``'s fragment list as Pieces, where they lie known from the last call while
        DeepSpeed holds the same fragment tensors (see PiecesCache)."""
        cache = self.scratch.get(("pieces", i))
        if cache is None:
            cache = self.scratch[("pieces", i)] = PiecesCache()
        return cache.pieces(fragments)

    def read(self) -> LocalGrads:
        if self.kind != GRAD:
            return self._read_master()
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

    def _read_master(self) -> LocalGrads:
        """The fp32 master partition of each param group, or one of its optimizer states."""
        opt, buffers = self.opt, []
        for group in self.layout.groups:
            master = opt.single_partition_of_fp32_groups[group.index]
            local = master
            if self.kind.key is not None:
                held = opt.optimizer.state.get(master)
                local = per_element_state(held, self.kind.key, master.numel(), f"param group {group.index}")
            buffers.append(self._pieces_of(group.index, [local]))
        return LocalGrads(Problem.OK, buffers)

    def refreshed_whole(self) -> frozenset[str]:
        return frozenset(self.params) if self.kind == FP32 else frozenset()  # after_write's weights

    def after_write(self, values: Mapping[str, torch.Tensor]) -> None:
        """New fp32 weights: the low-precision copy every rank holds whole made from them now, as the
        step's all-gather would (DeepSpeed's own setter leaves it, so the next forward used old weights).
        New gradients, with CPU offload: ZeRO-1/2 clips with per-parameter norms it computed during
        backward (``norm_for_param_grads``, one per owned fragment): recompute them from the written
        values, as ``copy_grads_in_partition`` does, or the next step clips with the old norms."""
        opt = self.opt
        if self.kind == FP32:
            copy_to_weights(self.params, values)
        if self.kind != GRAD or not opt.cpu_offload:
            return
        for i in self.group_ids:
            grad = opt.single_partition_of_fp32_groups[i].grad.view(-1)
            for p in opt.params_in_partition[i]:
                if self.names.get(id(p)) in values:
                    param_id = opt.get_param_id(p)
                    _, _, dest_offset, numel = opt.grad_position[param_id]
                    opt.norm_for_param_grads[param_id] = grad.narrow(0, dest_offset, numel).to(get_norm_dtype()).norm(2)


def _fp32_accumulation(opt: Any) -> bool:
    """bf16 + ``grad_accum_dtype: fp32`` keeps a compact fp32 partition (GradPartitionBufferGroup)."""
    accum = getattr(opt, "gradient_accumulation_dtype", None)
    return accum == torch.float32 and opt.bit16_groups_flat[0].dtype != torch.float32


def zero3_group(
    index: int,
    params: Sequence[Any],
    names: list[str],
    pg: ProcessGroup,
    model_parallel: frozenset[str],
    wire: torch.dtype,
    out: torch.dtype,
) -> LayoutGroup:
    """ZeRO-3 ``params`` partitioned over ``pg`` as layout group ``index``: each rank holds
    ``partition_numel()`` elements of each, back to back in this order."""
    slots, offset = [], 0
    for p, name in zip(params, names):
        slots.append(
            ParamSlot(name, tuple(p.ds_shape), p.ds_numel, offset, p.partition_numel(), name in model_parallel)
        )
        offset += p.partition_numel()
    return LayoutGroup(index, Partitioning.SLICED, tuple(_compat.group_ranks(pg)), offset, wire, out, tuple(slots))


class _Zero3(_EngineSource):
    """ZeRO-3: every parameter cut into equal slices; a rank's slices lie back to back. Gradients: each
    parameter's partition as DeepSpeed's own local accessor ``_get_fp32_grad_state_partition`` returns
    it; fp32 masters and their states: the slice ``_get_fp32_opt_state_partition`` returns
    (``grad_position``'s place in ``fp32_partitioned_groups_flat[i]`` or in its state)."""

    def __init__(self, engine: DeepSpeedEngine, named: Named, model_parallel: frozenset[str], kind: StateKind) -> None:
        self.kind = kind
        super().__init__(engine, named, model_parallel)
        opt = self.opt
        self.out_dtype = getattr(opt, "master_weights_and_grads_dtype", torch.float32)
        self.members: dict[int, list[nn.Parameter]] = {}
        pgs: dict[int, ProcessGroup] = {}
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
        self.layout = StateLayout("deepspeed-zero3", tuple(groups), tuple(n for n, _ in named))
        self._pieces: list[Pieces] | None = None
        self._signature = self._sign()

    def _wire_dtype(self) -> torch.dtype:
        opt = self.opt
        if self.kind != GRAD or getattr(opt, "offload_optimizer", False):
            master: torch.dtype = opt.fp32_partitioned_groups_flat[0].dtype
            return master
        buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        return buffer.dtype if buffer is not None else self.out_dtype

    def _sign(self) -> Hashable:
        opt = self.opt
        if self.kind != GRAD:
            return tuple(flat.data_ptr() for flat in opt.fp32_partitioned_groups_flat)
        buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        grads = tuple(
            getattr(g.grad, "data_ptr", lambda: 0)()
            for g in getattr(opt, "fp32_partitioned_groups_flat", [])
            if g.grad is not None
        )
        return (None if buffer is None else buffer.data_ptr(), grads)

    def valid(self) -> bool:
        return bool(self._sign() == self._signature)

    def release(self) -> None:
        super().release()
        self._pieces = None

    def read(self) -> LocalGrads:
        if self.kind != GRAD:
            return self._read_master()
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

    def _flats(self) -> list[torch.Tensor]:
        """Per sub-group the tensor the masters' kinds read: the fp32 partition, or its optimizer state."""
        flats = list(self.opt.fp32_partitioned_groups_flat)
        if self.kind.key is None:
            return flats
        states, key = self.opt.optimizer.state, self.kind.key
        return [per_element_state(states.get(f), key, f.numel(), f"sub-group {i}") for i, f in enumerate(flats)]

    def _read_master(self) -> LocalGrads:
        """Each parameter's slice of the fp32 master partitions, or of one of their optimizer states."""
        opt = self.opt
        flats = self._flats()
        held = tuple(f.data_ptr() for f in flats)
        if self._pieces is not None and self.scratch.get("read") == held:
            return LocalGrads(Problem.OK, self._pieces)  # views of the same live tensors
        pieces = []
        for group, params in zip(self.layout.groups, self.members.values()):
            parts = []
            for slot, p in zip(group.params, params):
                # where DeepSpeed's _get_fp32_opt_state_partition finds this parameter's slice
                i, offset, numel = opt.grad_position[opt.get_param_id(p)]
                if numel != slot.slice_numel:
                    detail = (
                        f"{slot.name}: DeepSpeed keeps {numel} elements of it here, the layout says {slot.slice_numel}"
                    )
                    return LocalGrads(Problem.LAYOUT_CHANGED, [], detail=detail)
                parts.append(flats[i].narrow(0, offset, numel))
            pieces.append(Pieces(parts))
        self._pieces, self.scratch["read"] = pieces, held
        return LocalGrads(Problem.OK, pieces)

    def refreshed_whole(self) -> frozenset[str]:
        """New fp32 weights of the parameters held whole now (persistent ones): ``after_write`` copies
        them into the module's weights."""
        if self.kind != FP32:
            return frozenset()
        return frozenset(n for n, p in self.params.items() if _whole_here(p))

    def after_write(self, values: Mapping[str, torch.Tensor]) -> None:
        """New gradients, with CPU offload: the per-parameter norms the step clips with recomputed from
        the written partitions, as DeepSpeed's ``set_local_grad_for_param`` does. New fp32 weights: each
        parameter's own partition (``ds_tensor``) made from this rank's new fp32 slice, and a parameter
        held whole (persistent, or gathered) made the new value, as the step leaves them."""
        opt = self.opt
        if self.kind == GRAD:
            if getattr(opt, "offload_optimizer", False):
                for name in values:
                    param = self.params[name]
                    part = opt._get_fp32_grad_state_partition(param, release_swap_buffers=False)[0]
                    opt.norm_for_param_grads[opt.get_param_id(param)] = opt._constant_buffered_norm2(part)
            return
        if self.kind != FP32:
            return
        partitions, slices, whole = [], [], {}
        for name in values:
            p: Any = self.params[name]  # a ZeRO-3 parameter: ds_tensor, ds_numel
            i, offset, numel = opt.grad_position[opt.get_param_id(p)]
            partitions.append(p.ds_tensor.data)
            slices.append(opt.fp32_partitioned_groups_flat[i].narrow(0, offset, numel))
            if _whole_here(p):
                whole[name] = p
        with torch.no_grad():
            copy_all(partitions, slices)
        if whole:
            copy_to_weights(whole, {name: values[name] for name in whole})

    def write(
        self, local: LocalGrads, values: Mapping[str, torch.Tensor], scale: float, copies: Copies | None = None
    ) -> None:
        """Into the partitions ``read()`` views, where the step reads them (gradients: DeepSpeed's grad
        partitions, or with CPU offload the fp32 partition's ``.grad``; the masters' kinds: their slices).
        Gradients with the optimizer on NVMe: through DeepSpeed's own local setter, parameter by
        parameter (no communication): it writes this rank's slice into the swap buffers and back to the
        file. That setter swaps the parameter's whole sub-group in and its gradients out again, per
        parameter; here once per sub-group."""
        if self.kind != GRAD or not self.swaps:
            Source.write(self, local, values, scale, copies)
            return
        opt = self.opt
        with SwappedIn(opt, write_back=True) as swapped:
            for name, new in values.items():
                p: Any = self.params[name]  # a ZeRO-3 parameter: partition_numel, ds_tensor, ...
                rank = torch.distributed.get_rank(group=opt._get_param_partition_group(p))
                size = p.partition_numel()
                flat = new.detach().reshape(-1).to(torch.float32)
                part = torch.zeros(size, dtype=torch.float32, device=flat.device)
                lo, hi = min(rank * size, flat.numel()), min((rank + 1) * size, flat.numel())
                part[: hi - lo] = flat[lo:hi]
                if scale != 1.0:
                    part.mul_(scale)
                grad = swapped.grad(p)
                if grad is None:
                    opt.set_local_grad_for_param(part, p)
                else:  # what set_local_grad_for_param does, less its swap-in and write-back per parameter
                    opt.norm_for_param_grads[opt.get_param_id(p)] = opt._constant_buffered_norm2(part)
                    grad.copy_(part)


def _replicated(
    engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str], kind: StateKind, optimizer: str
) -> Source:
    """Where no partitioned layout holds ``kind``: every rank holds it whole, or DeepSpeed's per-parameter
    accessor reads it (one collective per parameter: a layout collgrad does not read).

    - The module's weights below ZeRO-3: whole on every rank.
    - Stage 0: the gradients in each ``.grad`` (fp16: scaled by the loss scale); with a torch
      optimizer, the weights are what it steps and each state is per parameter in ``optimizer.state``.
    - BF16_Optimizer: the gradients in its fp32 accumulation (``_hp_grad``).
    - Otherwise (BF16_Optimizer's masters and states, ZeRO-3 sub-groups swapped to NVMe, an optimizer
      collgrad does not know): DeepSpeed's accessors and setters."""
    opt = engine.optimizer
    engine_ref = weakref.ref(engine)  # sources are cached keyed weakly by the engine: never hold it
    group = control_group(engine)
    loss_scale = lambda: _loss_scale(engine_ref())  # noqa: E731 - fp16: the scale DeepSpeed holds now
    stage0 = engine.zero_optimization_stage() == 0
    values: Callable[[], Any] = lambda: [None] * len(named)  # noqa: E731 - the accessor reads each
    problem: Callable[[], Problem] = always_ok
    scaled, set_grad, full_shape = False, None, None
    dtype: torch.dtype | None = torch.float32
    accessor = kind != WEIGHTS and not (stage0 and isinstance(opt, torch.optim.Optimizer))
    if kind == GRAD and optimizer == "BF16_Optimizer":
        # fp32_groups_has_gradients: set when backward adds into the fp32 accumulation buffer, cleared
        # by zero_grad() in step().
        variant, accessor = "deepspeed-bf16-optimizer", False
        values = lambda: [getattr(p, "_hp_grad", None) for _, p in named]  # noqa: E731
        problem = lambda: _problem(engine_ref(), any(any(f) for f in opt.fp32_groups_has_gradients))  # noqa: E731
    elif kind == GRAD and stage0:
        variant, accessor, scaled, dtype = "deepspeed-stage0", False, True, None
        values = lambda: [p.grad for _, p in named]  # noqa: E731
        problem = lambda: _problem(engine_ref(), not named or any(p.grad is not None for _, p in named))  # noqa: E731
        set_grad = _set_grad
    elif kind == GRAD:
        variant, scaled = f"deepspeed-accessor:{optimizer}", True
        problem = lambda: _problem(engine_ref(), True)  # noqa: E731
    elif accessor:
        if not all(zero_managed(p) for _, p in named):
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: DeepSpeed keeps no {kind.describe()} collgrad or DeepSpeed's accessors "
                f"can read for {optimizer} (deepspeed.utils.safe_get_full_fp32_param returns None there); with "
                "a torch optimizer at stage 0, read the module's own weights and optimizer.state"
            )
        variant = f"deepspeed-accessor:{optimizer}:{kind.label}"
        # ZeRO-3 (NVMe-swapped sub-groups): a partitioned parameter's own shape is (0,) outside a gather
        full_shape = _whole_shape
    else:  # whole on every rank: the weights below ZeRO-3, or stage 0's torch optimizer
        variant = f"deepspeed-{optimizer}:weights" if kind == WEIGHTS else f"deepspeed-stage0:{kind.label}"
        values, dtype = whole_values(named, kind, lambda: opt.state), None
    source = (_AccessorState if accessor and kind != GRAD else ReplicatedSource)(
        variant,
        named,
        values,
        group,
        problem=problem,
        loss_scale=loss_scale if scaled else (lambda: 1.0),
        model_parallel=model_parallel,
        dtype=dtype,
        set_grad=set_grad,
        full_shape=full_shape,
    )
    key = kind.key
    if accessor and kind == GRAD:
        source.accessor, source.accessor_set = safe_get_full_grad, safe_set_full_grad
    elif isinstance(source, _AccessorState):
        source.state = kind
        source.accessor_gathers = optimizer == "DeepSpeedZeroOptimizer_Stage3"  # ZeRO-3 all-gathers partitions
        if key is None:
            source.accessor, source.accessor_set = safe_get_full_fp32_param, safe_set_full_fp32_param
        else:
            source.accessor = lambda p: safe_get_full_optimizer_state(p, key)
            source.accessor_set = lambda p, value: safe_set_full_optimizer_state(p, value, key)
    return source


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Stage 0: a parameter that got no gradient in backward is given one."""
    param.grad = grad


def _whole_shape(param: nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


class _AccessorState(ReplicatedSource):
    """DeepSpeed's per-parameter accessors and setters of a state (built by ``_replicated``); new fp32
    weights also made the module's."""

    #: the state the accessors read and write
    state: StateKind

    def after_write(self, values: Mapping[str, torch.Tensor]) -> None:
        if self.state.key is not None:  # DeepSpeed's fp32 setter leaves the module's weights as they were
            return
        if not self.accessor_gathers:
            copy_to_weights(self.params, values)
            return
        with torch.no_grad():  # ZeRO-3: this rank's partition of each (its fp32 slice may be on NVMe)
            for name, value in values.items():
                p: Any = self.params[name]
                part = p.ds_tensor
                start = dist.get_rank(p.ds_process_group) * part.numel()  # DeepSpeed's partitioning
                flat = value.reshape(-1).to(torch.float32)
                n = max(0, min(part.numel(), flat.numel() - start))  # the last partitions hold padding
                part.data[:n].copy_(flat[start : start + n])
                if _whole_here(p):
                    copy_to_weights({name: p}, {name: value})


class _Zero3Weights(_EngineSource):
    """ZeRO-3: the module's own weights, every parameter (frozen ones too), each rank's partition of
    each in its ``ds_tensor`` (the model's dtype), grouped by the group that partitions it."""

    def __init__(self, engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str]) -> None:
        super().__init__(engine, named, model_parallel)
        opt = self.opt
        members: dict[tuple[int, torch.dtype], list[Any]] = {}
        pgs: dict[tuple[int, torch.dtype], ProcessGroup] = {}
        for _, param in named:
            p: Any = param  # a ZeRO-3 parameter: ds_tensor, ds_shape, ...
            pg = opt._get_param_partition_group(p)
            key = (id(pg), p.ds_tensor.dtype)
            pgs[key] = pg
            members.setdefault(key, []).append(p)
        groups = []
        for index, (key, params) in enumerate(members.items()):
            names = [self.names[id(p)] for p in params]
            groups.append(zero3_group(index, params, names, pgs[key], model_parallel, key[1], key[1]))
            self.groups[index] = pgs[key]
        self.members = list(members.values())
        self.layout = StateLayout("deepspeed-zero3:weights", tuple(groups), tuple(n for n, _ in named))

    def held_whole(self) -> dict[str, torch.Tensor]:
        """Parameters ZeRO-3 keeps gathered (persistent ones, below ``stage3_param_persistence_threshold``):
        their ``data`` is the whole parameter beside the partition."""
        return {self.names[id(p)]: p.data for group in self.members for p in group if _whole_here(p)}

    def read(self) -> LocalGrads:
        held = tuple(p.ds_tensor.data_ptr() for params in self.members for p in params)
        found = self.scratch.get("read")
        if found is not None and found[0] == held:
            return LocalGrads(Problem.OK, found[1])  # views of the same partitions: the same Pieces
        pieces = []
        for group, params in zip(self.layout.groups, self.members):
            parts = []
            for slot, p in zip(group.params, params):
                part = p.ds_tensor.data.view(-1)
                if part.numel() != slot.slice_numel:  # e.g. swapped out to NVMe (offload_param)
                    detail = f"{slot.name}: its partition holds {part.numel()} elements here, not {slot.slice_numel}"
                    return LocalGrads(Problem.LAYOUT_CHANGED, [], detail=detail)
                parts.append(part)
            pieces.append(Pieces(parts))
        self.scratch["read"] = (held, pieces)
        return LocalGrads(Problem.OK, pieces)
