"""The model measured, and the engine it runs in: a DeepSpeed ZeRO engine or an FSDP2 ``fully_shard``.

This is the benchmark's one door to the framework adapters (``collgrad.grads.sources.deepspeed`` and
``...fsdp2``, imported lazily here and nowhere else in the bench), so DeepSpeed is imported only on
ranks that build a DeepSpeed engine, after ``DS_ACCELERATOR`` is in their environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from collgrad import _compat
from collgrad.bench.config import BenchConfig, deepspeed_config

__all__ = ["VectorModel", "Subject", "build_subject", "accelerator_device"]


class VectorModel(nn.Module):
    """``tensors`` parameters of ``elements / tensors`` elements each; every one gets a gradient."""

    def __init__(self, tensors: int, elements: int) -> None:
        super().__init__()
        self.width = max(1, elements // tensors)
        gen = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.rand(self.width, generator=gen) * 0.1 + 0.95) for _ in range(tensors)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in self.weights:
            h = h * w
        return h.float().pow(2).mean()


@dataclass
class Subject:
    """What a rank measures: an engine after one backward, and the framework's per-parameter accessors
    (the loops collgrad is compared with).

    ``full_grad(p)`` is the framework's full gradient of one parameter (DeepSpeed's
    ``safe_get_full_grad``, FSDP2's ``p.grad.full_tensor()``), ``set_grad`` DeepSpeed's
    ``safe_set_full_grad`` (None for FSDP2, which has none). ``loop_element_size`` is the element size
    of what ``full_grad`` returned, observed once when the subject was built. ``loop_gathers``: the
    framework's accessor all-gathers each parameter's shares (ZeRO-3, FSDP2) rather than all-reducing
    the whole gradient (ZeRO-1/2).
    """

    source: str
    engine: Any  # a DeepSpeedEngine, or the fully_shard model itself
    world: int  # ranks of the default group
    params: list[nn.Parameter]
    sizes: list[int]  # elements per parameter (ZeRO-3: the whole parameter's, not this rank's partition)
    loop_gathers: bool
    device: torch.device
    optimizer: str
    deepspeed: str | None
    full_grad: Callable[[nn.Parameter], torch.Tensor]
    set_grad: Callable[[nn.Parameter, torch.Tensor], Any] | None = None
    loop_element_size: int = field(default=0)

    @property
    def numel(self) -> int:
        """Elements of the model's gradient."""
        return sum(self.sizes)


def accelerator_device() -> torch.device:
    """The device a model is placed on here: this rank's current CUDA device, else its XPU device where
    the default group has a backend for XPU tensors, else the CPU. Call after ``init_process_group``."""
    if torch.cuda.is_available():
        return _compat.agreement_device("cuda")
    if _compat.xpu_available() and _compat.backend_name(_compat.default_group(), "xpu") is not None:
        return _compat.agreement_device("xpu")
    return torch.device("cpu")


def _deepspeed(cfg: BenchConfig) -> Subject:
    """A DeepSpeed engine of the synthetic model after one backward. DeepSpeed picks its accelerator
    itself (``DS_ACCELERATOR``, else its own detection): the engine's device is the device measured."""
    from collgrad.grads.sources import deepspeed as ds  # the adapter: collgrad's one door to DeepSpeed

    model = VectorModel(cfg.tensors, cfg.elements)
    engine = ds.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-4), deepspeed_config(cfg))
    dtype = next(engine.module.parameters()).dtype
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.rand(2, model.width, generator=gen).to(device=engine.device, dtype=dtype)
    engine.backward(engine(x))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return Subject(
        source="deepspeed",
        engine=engine,
        world=dist.get_world_size(),
        params=params,
        sizes=[p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params],
        loop_gathers=cfg.stage == 3,  # safe_get_full_grad: ZeRO-3 gathers partitions, ZeRO-1/2 all-reduce
        device=torch.device(engine.device),
        optimizer=type(engine.optimizer).__name__,
        deepspeed=ds.VERSION,
        full_grad=ds.safe_get_full_grad,
        set_grad=ds.safe_set_full_grad,
    )


def _fsdp2(cfg: BenchConfig) -> Subject:
    """The same synthetic model sharded with ``fully_shard`` over every rank, after one backward."""
    from collgrad.grads.sources import fsdp2  # collgrad's one door to FSDP2

    device = accelerator_device()
    plain = VectorModel(cfg.tensors, cfg.elements).to(device)
    model = fsdp2.shard_whole(plain, device.type, dist.get_world_size())
    x = torch.rand(2, plain.width, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    model(x).backward()
    params = [p for p in model.parameters() if p.requires_grad]

    def full_tensor(p: nn.Parameter) -> torch.Tensor:
        grad: Any = p.grad  # a DTensor
        full: torch.Tensor = grad.full_tensor()
        return full

    return Subject(
        source="fsdp2",
        engine=model,
        world=dist.get_world_size(),
        params=params,
        sizes=[p.numel() for p in params],
        loop_gathers=True,  # full_tensor(): an all-gather of every rank's shard
        device=device,
        optimizer="torch.optim.SGD (fully_shard)",
        deepspeed=None,
        full_grad=full_tensor,
    )


def build_subject(cfg: BenchConfig) -> Subject:
    """The engine for ``cfg.source`` after one backward. Call on every rank of the default group (already
    initialized), in the same order: building issues collectives (and so does observing the loop's
    element size, one ``full_grad`` of the first parameter)."""
    subject = _fsdp2(cfg) if cfg.source == "fsdp2" else _deepspeed(cfg)
    subject.loop_element_size = subject.full_grad(subject.params[0]).element_size()
    return subject
