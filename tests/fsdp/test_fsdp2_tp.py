"""FSDP2 over tensor parallelism (4 ranks: data-parallel 2 x tensor-parallel 2): the gather runs over
FSDP's dimension only, so a tensor-parallel parameter comes back as this rank's TP shard (full across
the data-parallel ranks), named in ``model_parallel``; replicated parameters come back whole."""

from __future__ import annotations

import torch
from torch import nn

from tests.harness import run_ranks

TP = 2
# How each parameter is split over the tensor-parallel ranks: dim, or None (replicated)
TP_DIM = {"up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None, "norm.weight": None, "norm.bias": None}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(7, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _batch(dp_rank: int):
    g = torch.Generator().manual_seed(dp_rank)
    return torch.randn(4, 7, generator=g), torch.randn(4, 6, generator=g)


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import collgrad
    from tests.tolerance import norm_of_sum_of_squares

    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = rank // TP, rank % TP
    model = Net()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    x, y = _batch(dp_rank)  # tensor-parallel peers see the same batch
    nn.functional.mse_loss(model(x), y).backward()
    grads = collgrad.safe_get_full_model_grads(model)
    stats = collgrad.safe_get_full_model_grad_stats(model)
    # model_parallel="whole": every gradient as full_tensor() gives it, the norm of the whole model
    whole = collgrad.safe_get_full_model_grads(model, model_parallel="whole")
    whole_stats = collgrad.safe_get_full_model_grad_stats(model, model_parallel="whole")
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    total = float(torch.cat([g.double().reshape(-1) for g in full.values()]).norm())

    plain = Net()
    for d in range(world // TP):
        xs, ys = _batch(d)
        (nn.functional.mse_loss(plain(xs), ys) / (world // TP)).backward()
    out = {"model_parallel": sorted(grads.model_parallel), "groups": [g.ranks for g in grads.record.groups]}
    out["whole"] = (
        [n for n in full if not torch.equal(whole[n], full[n])],
        list(whole) == list(full),
        abs(whole_stats.global_norm - total) <= 1e-6 * total,
        [c.collectives for c in whole.record.model_parallel_calls],
    )
    for n, p in model.named_parameters():
        full = p.grad.full_tensor()
        reference = plain.get_parameter(n).grad
        dim = TP_DIM[n]
        if dim is not None:  # this rank's tensor-parallel shard
            full, reference = full.chunk(TP, dim=dim)[tp_rank], reference.chunk(TP, dim=dim)[tp_rank]
        out[n] = {
            "shape": tuple(grads[n].shape),
            "bitwise": torch.equal(grads[n], full),
            "plain": float((grads[n] - reference).norm() / reference.norm()),
            # fp32 fragment norms against the fp64 norm of the same values (tests/tolerance.py)
            "stat": abs(stats.params[n].norm - float(full.double().norm()))
            <= norm_of_sum_of_squares(full.numel(), torch.float32) * float(full.double().norm()),
        }
    new = {n: torch.full_like(g, 0.25) for n, g in grads.items()}
    collgrad.safe_set_full_model_grads(model, new)
    back = collgrad.safe_get_full_model_grads(model)
    out["written"] = all(torch.equal(back[n], new[n]) for n in new)
    return out


def test_tensor_parallel_shards_stay_local_and_the_rest_is_whole():
    results = run_ranks(_worker, 4, timeout=300)
    for rank, res in enumerate(results):
        assert res["model_parallel"] == ["down.weight", "up.bias", "up.weight"], res["model_parallel"]
        assert res["whole"] == ([], True, True, [1]), res["whole"]  # one all-gather over the TP dimension
        assert res["groups"] == [(rank % TP, rank % TP + TP)]  # FSDP's (data-parallel) dimension only
        assert res["up.weight"]["shape"] == (5, 7) and res["down.weight"]["shape"] == (6, 5)
        assert res["down.bias"]["shape"] == (6,)
        for n in TP_DIM:
            assert res[n]["bitwise"] and res[n]["plain"] < 1e-5 and res[n]["stat"], (rank, n, res[n])
        assert res["written"]
