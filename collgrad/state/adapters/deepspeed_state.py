"""DeepSpeed's fp32 master weights and optimizer states as sources: the gradient adapter's layouts
(deepspeed.py, the only module that imports deepspeed) read from the tensors the optimizer steps.

- ZeRO-1/2: per param group ``i``, the fp32 master partition ``single_partition_of_fp32_groups[i]``
  (on the CPU with offload) and each of its optimizer states ``optimizer.state[that][key]`` are flat
  tensors of ``partition_size[i]`` elements in the flat buffer's order, so they lie exactly as the
  gradient layout's partitions (parameter offsets from the flat buffer: right under
  ``round_robin_gradients`` too, where DeepSpeed's ``_hp_mapping`` is not): one piece per rank.
- ZeRO-3: per parameter the slice DeepSpeed's own local accessor ``_get_fp32_opt_state_partition``
  returns (``grad_position``'s place in ``fp32_partitioned_groups_flat[i]`` or in its state), in the
  gradient layout's order. Sub-groups swapped to NVMe: DeepSpeed's per-parameter accessor.
- Stage 0 with a torch optimizer: there is no master copy; every rank holds the module's weights and
  the optimizer's state of each parameter whole: nothing to communicate.
- Otherwise (``BF16_Optimizer``, ...): DeepSpeed's per-parameter accessor, one collective each, as the
  gradient path does for an optimizer whose layout collgrad does not know.

Readable at any time outside ``step()``: no backward is needed.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from collgrad import _compat
from collgrad.core.buffers import Pieces
from collgrad.errors import InvalidArgumentError
from collgrad.state.adapters.base import (
    WEIGHTS,
    LocalGrads,
    Problem,
    ReplicatedSource,
    Source,
    State,
    always_ok,
    copy_to_weights,
    per_element_state,
    whole_values,
)
from collgrad.state.adapters.deepspeed import (
    _EngineSource,
    _Zero3,
    _Zero12,
    control_group,
    model_parallel_names,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    zero3_group,
)
from collgrad.state.adapters.layout import GradLayout

__all__ = ["open_engine_state"]


def open_engine_state(engine: Any, named: list[tuple[str, nn.Parameter]], state: State) -> Source:
    """The Source of ``state`` (``FP32`` or an optimizer state) of a DeepSpeed engine's ``named``
    parameters. Local: no communication."""
    opt = engine.optimizer
    if opt is None:
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: this DeepSpeed engine has no optimizer, so it keeps no {state.describe()}: "
            "pass an optimizer to deepspeed.initialize"
        )
    kind = type(opt).__name__
    model_parallel = model_parallel_names(named)
    if state == WEIGHTS:
        if kind == "DeepSpeedZeroOptimizer_Stage3":
            return _Zero3Weights(engine, named, model_parallel)
        weights = whole_values(named, state)  # whole on every rank below ZeRO-3
        variant = f"deepspeed-{kind}:weights"
        return ReplicatedSource(
            variant, named, weights, control_group(engine), problem=always_ok, model_parallel=model_parallel
        )
    if kind == "DeepSpeedZeroOptimizer":
        return _Zero12State(engine, named, model_parallel, state)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        source = _Zero3State(engine, named, model_parallel, state)
        if not source.swaps:
            return source
    elif engine.zero_optimization_stage() == 0 and isinstance(opt, torch.optim.Optimizer):
        return _replicated(engine, named, model_parallel, state)
    return _accessor(engine, named, model_parallel, state, kind)


class _Zero12State(_Zero12):
    """ZeRO-1/2: the fp32 master partition of each param group, or one of its optimizer states."""

    def __init__(
        self, engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str], state: State
    ) -> None:
        self.state = state
        super().__init__(engine, named, model_parallel)

    def _wire_dtype(self, i: int) -> torch.dtype:
        dtype: torch.dtype = self.opt.single_partition_of_fp32_groups[i].dtype
        return dtype

    def read(self) -> LocalGrads:
        opt, buffers = self.opt, []
        for group in self.layout.groups:
            master = opt.single_partition_of_fp32_groups[group.index]
            local = master
            if self.state.key is not None:
                held = opt.optimizer.state.get(master)
                local = per_element_state(held, self.state.key, master.numel(), f"param group {group.index}")
            buffers.append(self._pieces_of(group.index, [local]))
        return LocalGrads(Problem.OK, buffers)

    def after_write(self, values: Mapping[str, torch.Tensor]) -> None:
        """New fp32 weights: the low-precision copy every rank holds whole made from them now, as the
        step's all-gather would (DeepSpeed's own setter leaves it, so the next forward used old weights)."""
        if self.state.key is None:
            copy_to_weights(self.params, values)


class _Zero3State(_Zero3):
    """ZeRO-3: each parameter's slice of the fp32 master partitions, or of one of their optimizer states."""

    def __init__(
        self, engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str], state: State
    ) -> None:
        self.state = state
        super().__init__(engine, named, model_parallel)

    def _wire_dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.opt.fp32_partitioned_groups_flat[0].dtype
        return dtype

    def _sign(self) -> tuple[int, ...]:
        return tuple(flat.data_ptr() for flat in self.opt.fp32_partitioned_groups_flat)

    def _flats(self) -> list[torch.Tensor]:
        """Per sub-group the tensor read: the fp32 partition, or its optimizer state."""
        flats = list(self.opt.fp32_partitioned_groups_flat)
        if self.state.key is None:
            return flats
        states = self.opt.optimizer.state
        return [
            per_element_state(states.get(f), self.state.key, f.numel(), f"sub-group {i}") for i, f in enumerate(flats)
        ]

    def read(self) -> LocalGrads:
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

    def write(self, local: LocalGrads, values: Mapping[str, torch.Tensor], scale: float) -> None:
        Source.write(self, local, values, scale)  # into the slices read() views, where the step reads them

    def after_write(self, values: Mapping[str, torch.Tensor]) -> None:
        """New fp32 weights: each parameter's own partition (``ds_tensor``) made from this rank's new
        fp32 slice, and a parameter held whole (persistent, or gathered) made the new value, as the
        step leaves them."""
        if self.state.key is not None:
            return
        opt = self.opt
        with torch.no_grad():
            for name, value in values.items():
                p: Any = self.params[name]
                i, offset, numel = opt.grad_position[opt.get_param_id(p)]
                p.ds_tensor.data.copy_(opt.fp32_partitioned_groups_flat[i].narrow(0, offset, numel))
                if p.data.numel() == p.ds_numel:
                    copy_to_weights({name: p}, {name: value})


def _replicated(
    engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str], state: State
) -> Source:
    """Stage 0 with a torch optimizer: the module's weights are what it steps; each state is per parameter."""
    opt = engine.optimizer
    return ReplicatedSource(
        f"deepspeed-stage0:{state.what}",
        named,
        whole_values(named, state, lambda: opt.state),
        control_group(engine),
        problem=always_ok,
        model_parallel=model_parallel,
    )


def _accessor(
    engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str], state: State, kind: str
) -> Source:
    """DeepSpeed's per-parameter accessor, one collective per parameter (a layout collgrad does not read)."""
    if not all(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for _, p in named):
        raise InvalidArgumentError(
            f"rank {_compat.rank()}: DeepSpeed keeps no {state.describe()} collgrad or DeepSpeed's accessors can "
            f"read for {kind} (deepspeed.utils.safe_get_full_fp32_param returns None there); with a torch "
            "optimizer at stage 0, read the module's own weights and optimizer.state"
        )
    return _AccessorState(engine, named, model_parallel, state, kind)


class _AccessorState(ReplicatedSource):
    """DeepSpeed's per-parameter accessors and setters; new fp32 weights also made the module's."""

    def __init__(
        self,
        engine: Any,
        named: list[tuple[str, nn.Parameter]],
        model_parallel: frozenset[str],
        state: State,
        kind: str,
    ) -> None:
        super().__init__(
            f"deepspeed-accessor:{kind}:{state.what}",
            named,
            lambda: [None] * len(named),
            control_group(engine),
            problem=always_ok,
            model_parallel=model_parallel,
            dtype=torch.float32,
            # ZeRO-3 (NVMe-swapped sub-groups): a partitioned parameter's own shape is (0,) outside a gather
            full_shape=lambda p: tuple(getattr(p, "ds_shape", p.shape)),
        )
        key = state.key
        self.state = state
        self.accessor_gathers = kind == "DeepSpeedZeroOptimizer_Stage3"  # ZeRO-3 all-gathers partitions
        if key is None:
            self.accessor, self.accessor_set = safe_get_full_fp32_param, safe_set_full_fp32_param
        else:
            self.accessor = lambda p: safe_get_full_optimizer_state(p, key)
            self.accessor_set = lambda p, value: safe_set_full_optimizer_state(p, value, key)

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
                if p.data.numel() == p.ds_numel:  # held whole (persistent, or gathered)
                    copy_to_weights({name: p}, {name: value})


class _Zero3Weights(_EngineSource):
    """ZeRO-3: the module's own weights, every parameter (frozen ones too), each rank's partition of
    each in its ``ds_tensor`` (the model's dtype), grouped by the group that partitions it."""

    def __init__(self, engine: Any, named: list[tuple[str, nn.Parameter]], model_parallel: frozenset[str]) -> None:
        super().__init__(engine, named, model_parallel)
        opt = self.opt
        members: dict[tuple[int, torch.dtype], list[Any]] = {}
        pgs = {}
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
        self.layout = GradLayout("deepspeed-zero3:weights", tuple(groups), tuple(n for n, _ in named))
        self.fingerprint = self.layout.fingerprint()

    def read(self) -> LocalGrads:
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
        return LocalGrads(Problem.OK, pieces)
