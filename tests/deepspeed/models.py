"""Small models and DeepSpeed engines for the full-gradient tests (CPU, Gloo, DS_ACCELERATOR=cpu).

Inputs are derived from the rank, so every rank can compute every rank's local gradient and hence
the reference: the mean over ranks (and micro-steps) of plain PyTorch gradients, as DeepSpeed
averages them.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

IN, HID, OUT = 7, 9, 5


class Net(nn.Module):
    """Parameter sizes chosen so partition edges fall inside parameters (none divisible by 2 or 3),
    with a tied weight, a frozen parameter and a (1,)-shaped one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.mid = nn.Linear(HID, HID)
        self.frozen = nn.Linear(HID, HID)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(HID, OUT)
        self.back = nn.Linear(OUT, HID, bias=False)
        self.back.weight = nn.Parameter(self.out.weight.t().contiguous())  # replaced below by a tie
        self.scale = nn.Parameter(torch.ones(1) * 0.5)
        self.tied_in = nn.Linear(HID, OUT, bias=False)
        self.tied_out = nn.Linear(HID, OUT, bias=False)
        self.tied_out.weight = self.tied_in.weight  # tied: appears once in named_parameters()
        del self.back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.norm(h)
        h = torch.tanh(self.mid(h)) + self.frozen(h)
        return self.out(h) * self.scale + self.tied_in(h) - 0.5 * self.tied_out(h)


def batch(rank: int, micro: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(4, IN, generator=g).to(dtype), torch.randn(4, OUT, generator=g).to(dtype)


def reference_grads(world: int, gas: int = 1, make=None, batch=batch) -> dict[str, torch.Tensor]:
    """Mean over ranks and micro-steps of the local fp32 gradients of a plain copy of the model
    (``make()``, default Net) on ``batch(rank, micro)``."""
    return _reference(world, gas, make, batch)[0]


def reference_bounds(world: int, gas: int = 1, make=None, batch=batch) -> dict[str, float]:
    """How far (relative 2-norm, per parameter) an fp32 mean of the same local gradients, summed in
    another order, may be from ``reference_grads``: ``reordered_sum(terms) * ||sum |g_k| / terms|| /
    ||mean||`` (tests/tolerance.py) with ``terms = world * gas`` local gradients, plus one rounding per
    term for what DeepSpeed does besides summing (the loss scaled by 1/gas before backward, the
    gradients divided by the world before the reduction). The magnitude factor is this data's."""
    from tests.tolerance import reordered_sum

    mean, magnitude = _reference(world, gas, make, batch)
    slack = reordered_sum(world * gas + 1, torch.float32)
    return {n: slack * float(magnitude[n].norm()) / max(float(mean[n].norm()), 1e-30) for n in mean}


def reference_magnitudes(world: int, gas: int = 1, make=None, batch=batch) -> dict[str, torch.Tensor]:
    """Mean over ranks and micro-steps of the local gradients' magnitudes |g_k|: what the rounding of a
    reordered mean of them scales with, elementwise (tests/tolerance.py)."""
    return _reference(world, gas, make, batch)[1]


def low_precision_bound(dtype: torch.dtype) -> float:
    """Relative distance of gradients computed in ``dtype`` (bf16, fp16) from fp32 ones, first order:
    each of Net's 5 layers rounds its weights and output (forward) and its input and weight gradients
    (backward) to ``dtype``, 4 roundings of relative u per layer (CPU low-precision matmuls accumulate
    in fp32): 4 * 5 * u."""
    from tests.tolerance import unit_roundoff

    return 4 * 5 * unit_roundoff(dtype)


def _reference(world: int, gas: int, make, batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = make() if make is not None else Net()
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    magnitude = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    for rank in range(world):
        for micro in range(gas):
            model.zero_grad()
            x, y = batch(rank, micro)
            nn.functional.mse_loss(model(x), y).backward()
            for n, p in model.named_parameters():
                if p.requires_grad:
                    total[n] += p.grad
                    magnitude[n] += p.grad.abs()
    return {n: g / (world * gas) for n, g in total.items()}, {n: m / (world * gas) for n, m in magnitude.items()}


def config(stage: int, *, dtype: str = "fp32", offload: bool = False, gas: int = 1, **zero) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, **zero},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16_acc32":
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def engine(cfg: dict, model: nn.Module | None = None):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    model = model if model is not None else Net()
    params = [p for p in model.parameters() if p.requires_grad]
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(params, lr=1e-3), config=cfg)
    return eng


def run_backward(eng, rank: int, gas: int = 1, micro_steps: int | None = None, batch=batch) -> None:
    """``micro_steps`` forward/backward passes on ``batch(rank, micro, dtype)`` (default: up to the
    accumulation boundary), calling ``step()`` after each but the last, as DeepSpeed requires for
    accumulation."""
    dtype = next(eng.module.parameters()).dtype
    n = gas if micro_steps is None else micro_steps
    for micro in range(n):
        x, y = batch(rank, micro, dtype)
        loss = nn.functional.mse_loss(eng(x).float(), y.float())
        eng.backward(loss)
        if micro < n - 1:
            eng.step()


class Blocks(nn.Module):
    """Identical blocks, as in a transformer: each layer's fragments repeat at a constant distance in
    a rank's partition (what collgrad's statistics reduce as strided runs)."""

    def __init__(self, blocks: int = 6) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(IN, HID)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HID, HID), nn.LayerNorm(HID)) for _ in range(blocks))
        self.out = nn.Linear(HID, OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def clone_model() -> nn.Module:
    return copy.deepcopy(Net())


class MoENet(nn.Module):
    """A DeepSpeed MoE layer between two dense layers: expert parameters live in expert-data-parallel
    groups of their own."""

    def __init__(self, ep_size: int, num_experts: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        self.inp = nn.Linear(IN, HID)
        self.moe = MoE(
            hidden_size=HID,
            expert=nn.Linear(HID, HID),
            num_experts=num_experts,
            ep_size=ep_size,
            k=1,
            min_capacity=0,
            capacity_factor=4.0,
            drop_tokens=False,
        )
        self.out = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h)


def moe_engine(cfg: dict, ep_size: int, num_experts: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = MoENet(ep_size, num_experts)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(groups, lr=1e-3), config=cfg)
    return eng


class TPNet(nn.Module):
    """An MLP whose up/down projections AutoTP shards (column/row) across tensor-parallel ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up_proj = nn.Linear(IN, 8)
        self.down_proj = nn.Linear(8, OUT)
        self.head = nn.Linear(OUT, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down_proj(torch.relu(self.up_proj(x))))


def autotp_config(stage: int, tp: int) -> dict:
    cfg = config(stage)
    cfg["tensor_parallel"] = {
        "autotp_size": tp,
        "partition_config": {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*up_proj\.weight$", r".*up_proj\.bias$"], "partition_type": "column"},
                {"patterns": [r".*down_proj\.weight$"], "partition_type": "row"},
            ],
        },
    }
    return cfg
