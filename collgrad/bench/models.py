"""The model measured, and the engine it runs in: a DeepSpeed ZeRO engine or an FSDP2 ``fully_shard``.

The frameworks are built through ``frameworks.py`` (the benchmark's one module that imports deepspeed
and FSDP2) and DeepSpeed's own accessors reached through its adapter (imported lazily here), so
DeepSpeed is imported only on ranks that build a DeepSpeed engine, after ``DS_ACCELERATOR`` is in their
environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from collgrad import _compat
from collgrad.bench import frameworks
from collgrad.bench.config import BenchConfig, deepspeed_config

__all__ = ["VectorModel", "GPT2Model", "MODELS", "build_model", "Subject", "build_subject", "accelerator_device"]


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

    def example(self, generator: torch.Generator) -> torch.Tensor:
        """An input batch for ``forward``."""
        return torch.rand(2, self.width, generator=generator)


class _Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a 4x MLP, every projection with a bias."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.c_attn(self.ln_1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.c_proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = h + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))
        return out


class GPT2Model(nn.Module):
    """A GPT-2-shaped stack of about ``tensors`` parameters and ``elements`` elements: token and position
    embeddings, ``layers`` blocks of 12 tensors (two layer norms, attention and MLP weights with their
    biases), a final layer norm, and a head tied to the token embedding. Sizes mix as in real models: a
    few large matrices (``3d x d``, ``4d x d``, the embeddings) beside many ``d``-element biases and norms.

    The shape is solved from the two targets: ``layers = (tensors - 4) // 12`` and the widest ``d`` that
    holds at most ``elements`` (vocabulary ``32 d``, positions ``4 d``), so ``--tensors`` and
    ``--elements`` move it like the equal-tensor model (the count is a multiple of 12, plus 4).
    """

    VOCAB_PER_WIDTH = 32
    POSITIONS_PER_WIDTH = 4

    def __init__(self, tensors: int, elements: int) -> None:
        super().__init__()
        layers = max(1, (tensors - 4) // 12)
        self.width = d = self.solve_width(layers, elements)
        heads = next(h for h in range(max(1, d // 64), 0, -1) if d % h == 0)
        with torch.random.fork_rng(devices=[]):  # the same weights on every rank; the caller's RNG untouched
            torch.manual_seed(0)
            self.wte = nn.Embedding(self.VOCAB_PER_WIDTH * d, d)
            self.wpe = nn.Embedding(self.POSITIONS_PER_WIDTH * d, d)
            self.h = nn.ModuleList([_Block(d, heads) for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d)

    @classmethod
    def numel(cls, layers: int, width: int) -> int:
        """Elements of the model: ``layers (12 d^2 + 13 d)`` in the blocks, ``(32 + 4) d^2`` in the
        embeddings, ``2 d`` in the final norm. Pure."""
        d = width
        return layers * (12 * d * d + 13 * d) + (cls.VOCAB_PER_WIDTH + cls.POSITIONS_PER_WIDTH) * d * d + 2 * d

    @classmethod
    def solve_width(cls, layers: int, elements: int) -> int:
        """The widest ``d`` (at least 4) whose model holds at most ``elements``: the same bytes as the
        equal-tensor model at most, so the two fill the same buckets. Pure."""
        a = 12 * layers + cls.VOCAB_PER_WIDTH + cls.POSITIONS_PER_WIDTH
        b = 13 * layers + 2
        d = max(4, int((-b + math.sqrt(b * b + 4 * a * elements)) / (2 * a)) + 1)
        while d > 4 and cls.numel(layers, d) > elements:
            d -= 1
        return d

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            h = block(h)
        logits = self.ln_f(h) @ self.wte.weight.t()  # the tied head
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())

    def example(self, generator: torch.Generator) -> torch.Tensor:
        """A batch of 2 sequences of token ids for ``forward``."""
        t = min(64, self.wpe.num_embeddings)
        return torch.randint(self.wte.num_embeddings, (2, t), generator=generator)


#: ``--model``: the benchmark's models by name; ``gpt2`` (mixed sizes, the default) or ``vector``
#: (``tensors`` equal tensors, the sweep's clean tensors axis).
MODELS: dict[str, type[GPT2Model] | type[VectorModel]] = {"gpt2": GPT2Model, "vector": VectorModel}


def build_model(cfg: BenchConfig) -> GPT2Model | VectorModel:
    """``cfg.model`` at ``cfg.tensors`` and ``cfg.model_elements``. The same weights on every rank."""
    return MODELS[cfg.model](cfg.tensors, cfg.model_elements)


@dataclass
class Subject:
    """What a rank measures: an engine after a step and one more backward (gradients, and Adam's states
    with a step's values), and the framework's per-parameter accessors (the loops collgrad is compared
    with) and consolidation (what the save rows are compared with).

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
    #: the framework's per-parameter fp32 weight and optimizer state (DeepSpeed's accessors,
    #: ``full_tensor()`` of FSDP2's parameter and state), and DeepSpeed's fp32 setter
    full_fp32: Callable[[nn.Parameter], torch.Tensor]
    full_state: Callable[[nn.Parameter, str], torch.Tensor]
    #: the framework's consolidated state dict, as users save it (rank 0's; collective)
    consolidate: Callable[[], Any]
    optimizer_obj: Any = None  # FSDP2's torch optimizer (DeepSpeed's engine has its own)
    set_grad: Callable[[nn.Parameter, torch.Tensor], Any] | None = None
    set_fp32: Callable[[nn.Parameter, torch.Tensor], Any] | None = None
    #: DeepSpeed's optimizer-state setter, ``(p, value, key)``
    set_state: Callable[[nn.Parameter, torch.Tensor, str], Any] | None = None
    #: the module's weight made a value the way DeepSpeed documents (ZeRO-3: ``GatheredParameters`` with
    #: a modifier rank; below, a copy into the weight every rank holds): what its fp32 setter leaves out
    set_weight: Callable[[nn.Parameter, torch.Tensor], Any] | None = None
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
    from collgrad.state.adapters import deepspeed as ds  # the adapter: collgrad's one door to DeepSpeed

    model = build_model(cfg)
    engine = frameworks.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-4), deepspeed_config(cfg))
    x = model.example(torch.Generator().manual_seed(dist.get_rank())).to(engine.device)
    if x.is_floating_point():
        x = x.to(next(engine.module.parameters()).dtype)
    engine.backward(engine(x))
    engine.step()  # Adam's states hold a step's values
    engine.backward(engine(x))
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def consolidate() -> Any:  # what Trainer.save_model and accelerator.get_state_dict consolidate
        if cfg.stage == 3:
            return engine._zero3_consolidated_16bit_state_dict()
        return engine.module.state_dict() if dist.get_rank() == 0 else None

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
        full_fp32=ds.safe_get_full_fp32_param,
        full_state=ds.safe_get_full_optimizer_state,
        consolidate=consolidate,
        set_grad=ds.safe_set_full_grad,
        set_fp32=ds.safe_set_full_fp32_param,
        set_state=ds.safe_set_full_optimizer_state,
        set_weight=partial(_set_weight, ds.GatheredParameters),
    )


def _set_weight(gathered: Any, p: nn.Parameter, value: torch.Tensor) -> None:
    """DeepSpeed's documented way to change a weight: a ZeRO-3 parameter gathered, changed on one rank and
    partitioned again on leaving (a broadcast); below ZeRO-3 every rank holds it whole and copies."""
    if not hasattr(p, "ds_id"):
        with torch.no_grad():
            p.copy_(value)
        return
    with gathered(p, modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            p.copy_(value)


def _fsdp2(cfg: BenchConfig) -> Subject:
    """The same synthetic model sharded with ``fully_shard`` over every rank, after one backward."""

    device = accelerator_device()
    plain = build_model(cfg).to(device)
    model = frameworks.shard_whole(plain, device.type, dist.get_world_size())
    x = plain.example(torch.Generator().manual_seed(dist.get_rank())).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-4)
    model(x).backward()
    optimizer.step()  # Adam's states hold a step's values
    optimizer.zero_grad()
    model(x).backward()

    def full_tensor(p: nn.Parameter) -> torch.Tensor:
        grad: Any = p.grad  # a DTensor
        full: torch.Tensor = grad.full_tensor()
        return full

    def full_weight(p: nn.Parameter) -> torch.Tensor:
        full: torch.Tensor = p.full_tensor()  # type: ignore[attr-defined]  # a DTensor
        return full

    def full_state(p: nn.Parameter, key: str) -> torch.Tensor:
        full: torch.Tensor = optimizer.state[p][key].full_tensor()
        return full

    return Subject(
        source="fsdp2",
        engine=model,
        world=dist.get_world_size(),
        params=params,
        sizes=[p.numel() for p in params],
        loop_gathers=True,  # full_tensor(): an all-gather of every rank's shard
        device=device,
        optimizer="torch.optim.Adam (fully_shard)",
        deepspeed=None,
        full_grad=full_tensor,
        full_fp32=full_weight,
        full_state=full_state,
        consolidate=lambda: frameworks.full_state_dict(model),
        optimizer_obj=optimizer,
    )


def build_subject(cfg: BenchConfig) -> Subject:
    """The engine for ``cfg.source`` after one backward. Call on every rank of the default group (already
    initialized), in the same order: building issues collectives (and so does observing the loop's
    element size, one ``full_grad`` of the first parameter)."""
    subject = _fsdp2(cfg) if cfg.source == "fsdp2" else _deepspeed(cfg)
    subject.loop_element_size = subject.full_grad(subject.params[0]).element_size()
    return subject
