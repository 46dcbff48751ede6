"""FSDP2 over DTensor tensor parallelism (a 2-D mesh, data-parallel 2 x tensor-parallel 2: column- and
row-parallel linears, a replicated norm) saves and resumes whole: a training state written by FSDP2 at
data-parallel 2 resumes on the 2-D mesh, every parameter and Adam state's ``full_tensor()`` bitwise the
saved one and the step kept; saved there, it resumes in FSDP2 at data-parallel 2 and under DeepSpeed
ZeRO-2 and ZeRO-3 (their accessors) bitwise; training on from each takes the uninterrupted run's step
within 1e-5 (relative, of each tensor's scale). ``save_full_model`` on the 2-D mesh writes the whole
weights, which a plain module loads into the same logits."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import os

import torch
from torch import nn

from tests.fsdp.test_fsdp2_tp import TP, Net, _batch
from tests.harness import run_ranks

KEYS = ("exp_avg", "exp_avg_sq")


def _fsdp(world: int, tp: int):
    """Net under FSDP2 (over a tensor-parallel mesh dimension where ``tp`` > 1) and its Adam."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = Net()
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _fsdp_state(model, opt) -> tuple[dict[str, torch.Tensor], set[int]]:
    """Every parameter and Adam state whole (``full_tensor()``), and the step counts."""
    out = {}
    for name, param in model.named_parameters():
        out[f"fp32/{name}"] = param.full_tensor()
        out.update((f"{key}/{name}", opt.state[param][key].full_tensor()) for key in KEYS)
    return out, {int(state["step"]) for state in opt.state.values()}


def _deepspeed_state(eng) -> tuple[dict[str, torch.Tensor], set[int]]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in eng.module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(param)
        out.update((f"{key}/{name}", safe_get_full_optimizer_state(param, key)) for key in KEYS)
    # Adam's own step counts (an FSDP2 checkpoint holds no DeepSpeed engine counters to restore)
    return out, {int(state["step"]) for state in eng.optimizer.optimizer.state.values() if "step" in state}


def _train(model, opt, dp_rank: int) -> None:
    x, y = _batch(dp_rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _unequal(got: dict, want: dict) -> list[str]:
    return sorted(set(got) ^ set(want)) or [k for k in want if not torch.equal(got[k], want[k])]


def _apart(got: dict, want: dict) -> list[str]:
    """Beyond 1e-5 relative of each tensor's scale (the sharded forward adds the row-parallel layer's
    partial sums in another order), never wider than 1e-7 absolute."""
    scale = {k: float(t.abs().max()) for k, t in want.items()}
    return [k for k in want if not torch.allclose(got[k], want[k], rtol=1e-5, atol=min(1e-7, 1e-5 * scale[k]))]


def _data_parallel(rank, world, root):
    """FSDP2 at data-parallel 2: one step, saved, one more (the uninterrupted run)."""
    from safetensors.torch import save_file

    import collgrad

    model, opt = _fsdp(world, 1)
    _train(model, opt, rank)
    collgrad.save_training_state(model, os.path.join(root, "dp"), optimizer=opt)
    state, _ = _fsdp_state(model, opt)
    _train(model, opt, rank)
    after, _ = _fsdp_state(model, opt)
    if rank == 0:
        save_file(state, os.path.join(root, "dp-state.safetensors"))
        save_file(after, os.path.join(root, "dp-after.safetensors"))


def _on_the_mesh(rank, world, root):
    """Data-parallel 2 x tensor-parallel 2: resumes the data-parallel state, trains on, saves its own
    (training state and whole weights) and takes one more step."""
    from safetensors.torch import load_file, save_file

    import collgrad

    dp_rank = rank // TP  # tensor-parallel peers see the same batch
    model, opt = _fsdp(world, TP)
    collgrad.load_training_state(model, os.path.join(root, "dp"), optimizer=opt)
    got, steps = _fsdp_state(model, opt)
    out = {"resumed": (_unequal(got, load_file(os.path.join(root, "dp-state.safetensors"))), steps)}
    _train(model, opt, dp_rank)
    out["trained on"] = _apart(_fsdp_state(model, opt)[0], load_file(os.path.join(root, "dp-after.safetensors")))
    saved = collgrad.save_training_state(model, os.path.join(root, "tp"), optimizer=opt)
    collgrad.save_full_model(model, os.path.join(root, "full"))
    state, _ = _fsdp_state(model, opt)
    # whole reads over the 2-D mesh: every parameter and Adam state as full_tensor() gives it
    whole = {f"fp32/{n}": t for n, t in collgrad.safe_get_full_model_fp32_params(model, model_parallel="whole").items()}
    for key in KEYS:
        states = collgrad.iter_full_model_optimizer_states(model, key, optimizer=opt, model_parallel="whole")
        whole.update((f"{key}/{n}", t.clone()) for n, t in states)
    out["whole"] = _unequal(whole, state)
    with torch.no_grad():
        logits = model(torch.randn(3, 7, generator=torch.Generator().manual_seed(9)))  # replicated
    _train(model, opt, dp_rank)
    after, _ = _fsdp_state(model, opt)
    if rank == 0:
        save_file(state, os.path.join(root, "tp-state.safetensors"))
        save_file(after, os.path.join(root, "tp-after.safetensors"))
        save_file({"logits": logits}, os.path.join(root, "tp-logits.safetensors"))
    out["files"] = "training_state/manifest.json" in saved.files
    return out


def _elsewhere(rank, world, root):
    """The 2-D mesh's state resumed at data-parallel 2: FSDP2, DeepSpeed ZeRO-2 and ZeRO-3; its whole
    weights in a plain module."""
    from safetensors.torch import load_file

    import collgrad
    from tests.deepspeed import models

    path = os.path.join(root, "tp")
    state = load_file(os.path.join(root, "tp-state.safetensors"))
    after = load_file(os.path.join(root, "tp-after.safetensors"))
    out = {}
    model, opt = _fsdp(world, 1)
    collgrad.load_training_state(model, path, optimizer=opt)
    got, steps = _fsdp_state(model, opt)
    _train(model, opt, rank)
    out["fsdp2"] = (_unequal(got, state), steps, _apart(_fsdp_state(model, opt)[0], after))
    for stage in (2, 3):
        cfg = models.config(stage)
        cfg["gradient_clipping"] = 0.0
        eng = models.engine(cfg, Net())
        collgrad.load_training_state(eng, path)
        got, steps = _deepspeed_state(eng)
        x, y = _batch(rank)
        eng.backward(nn.functional.mse_loss(eng(x), y))
        eng.step()
        out[f"zero{stage}"] = (_unequal(got, state), steps, _apart(_deepspeed_state(eng)[0], after))
    plain = Net()
    plain.load_state_dict(load_file(os.path.join(root, "full", "model.safetensors")))
    with torch.no_grad():
        logits = plain(torch.randn(3, 7, generator=torch.Generator().manual_seed(9)))
    out["logits"] = _apart({"logits": logits}, load_file(os.path.join(root, "tp-logits.safetensors")))
    return out


def test_fsdp2_over_tensor_parallelism_resumes_at_another_layout_and_framework(tmp_path):
    root = str(tmp_path)
    run_ranks(_data_parallel, 2, root, timeout=300)
    for rank, res in enumerate(run_ranks(_on_the_mesh, 4, root, timeout=300)):
        assert res == {"resumed": ([], {1}), "trained on": [], "whole": [], "files": True}, (rank, res)
    for rank, res in enumerate(run_ranks(_elsewhere, 2, root, timeout=300)):
        assert res == {"fsdp2": ([], {2}, []), "zero2": ([], {2}, []), "zero3": ([], {2}, []), "logits": []}, (
            rank,
            res,
        )
