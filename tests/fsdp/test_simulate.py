"""``python -m collgrad simulate``'s I/O figures for FSDP2 are what real ranks do: the synthetic
transformer (``synthetic(2, 8)``) built as a module, ``fully_shard``-ed on 2 and 3 CPU ranks over Gloo,
Adam stepped once; each checkpoint job run on it while tests/counting.py's ``count_io`` counts, inside
the rank, the pwrites, preadvs and header reads of the safetensors files and the files they touch.
Every rank's count equals ``simulate`` for that rank (worked out in the parent), exactly: calls, bytes
read, bytes written, files.
Both ways of sharding (each layer a unit then the root, or the root alone) give FSDP2 the one layout
group the simulation models (collgrad's adapter makes one per process group and dtype), and are both
checked. The CLI's JSON lines: tests/unit/test_simulate.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from collgrad.bench.simulate import Simulated, simulate, synthetic
from tests.harness import run_ranks

LAYERS, HIDDEN = 2, 8
JOBS = ("save_training_state", "load_training_state", "save_full_model", "load_full_model")
FIGURES = ("io_calls", "bytes_read", "bytes_written", "files")


class _Attention(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_proj(x) * self.k_proj(x)) + self.v_proj(x))


class _Mlp(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)))


class _Layer(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(h)
        self.self_attn = _Attention(h)
        self.mlp = _Mlp(h)
        self.post_attention_layernorm = nn.RMSNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Synthetic(nn.Module):
    """``synthetic(layers, hidden)`` as a module: its parameters, fp32, by those names in that order."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _trained(world: int, rank: int, nested: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The synthetic model sharded (``nested``: each layer a unit, then the root; else the root alone) and
    Adam stepped once, so that its states exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Synthetic(LAYERS, HIDDEN)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert shapes == synthetic(LAYERS, HIDDEN), shapes
    mesh = init_device_mesh("cpu", (world,))
    if nested:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _job(job: str, model: nn.Module, opt: torch.optim.Optimizer, directory: str) -> None:
    """The public call of ``job`` on ``model`` and ``directory``."""
    import collgrad

    if job == "save_training_state":
        collgrad.save_training_state(model, directory, optimizer=opt)
    elif job == "load_training_state":
        collgrad.load_training_state(model, directory, optimizer=opt)
    elif job == "save_full_model":
        collgrad.save_full_model(model, directory)
    else:
        collgrad.load_full_model(model, directory)


def _counted(rank: int, world: int, root: str) -> dict:
    """Per sharding and job: the figures counted on this rank, and the calls behind them (as on a network
    file system: the simulation's costs)."""
    from tests.counting import as_on_a_network_file_system, count_io

    as_on_a_network_file_system()
    out = {}
    for nested in (True, False):
        model, opt = _trained(world, rank, nested)
        for job in JOBS:
            directory = f"{root}/{nested}/{'state' if 'training' in job else 'model'}"
            with count_io(directory) as io:
                _job(job, model, opt, directory)
            out[(nested, job)] = (io.figures(), io.log)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_simulated_io_is_what_fsdp2_ranks_do(world, tmp_path):
    found = run_ranks(_counted, world, str(tmp_path))
    differ = []
    for rank, jobs in enumerate(found):
        # here, not in the rank: simulate() measures its peak with tracemalloc, whose start and stop race
        # with the native threads of a rank's process group on CPython < 3.12.9 (gh-128679: a segfault
        # in about one launch in four)
        figures = simulate(Simulated("fsdp2", world, rank, LAYERS, HIDDEN), JOBS, reps=1)
        simulated = {row.job: {name: getattr(row, name) for name in FIGURES} for row in figures}
        for (nested, job), (counted, log) in jobs.items():
            sharding = "each layer, then the root" if nested else "the root alone"
            print(f"world {world} rank {rank} {job:<20} ({sharding}): {counted}")
            if counted != simulated[job]:
                print("  simulated", simulated[job], "; the calls counted:", *log, sep="\n    ")
                differ.append(f"rank {rank}, {job} ({sharding}): counted {counted}, simulated {simulated[job]}")
    assert not differ, "\n".join(differ)
