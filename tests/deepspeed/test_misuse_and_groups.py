"""Calls at invalid times or with diverging arguments raise the same error on every rank, quickly;
MoE expert groups are reduced within their own group. (That a call leaves the engine's step as it was
is test_no_side_effects': its first step is this one, with every plan and the stream called.)"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")


import pytest
import torch

from tests.harness import attempt, run_ranks

pytestmark = pytest.mark.guarantees  # the README's Guarantees section


def _misuse(rank, world, stage, dtype):
    import collgrad
    from tests.deepspeed import models

    eng = models.engine(models.config(stage, dtype=dtype, gas=2))
    names = [n for n, p in eng.module.named_parameters() if p.requires_grad]
    out = {"before_backward": attempt(lambda: collgrad.safe_get_full_model_grads(eng))}
    models.run_backward(eng, rank, gas=2, micro_steps=1)  # first micro-step of two: not a boundary
    out["mid_accumulation"] = attempt(lambda: collgrad.safe_get_full_model_grads(eng))
    eng.step()
    x, y = models.batch(rank, 1, next(eng.module.parameters()).dtype)
    eng.backward(torch.nn.functional.mse_loss(eng(x).float(), y.float()))  # the boundary
    mine = names[:3] if rank == world - 1 else names[:2]  # the last rank asks for something else
    out["different_subsets"] = attempt(lambda: collgrad.safe_get_full_model_grads(eng, params=mine))
    out["valid"] = attempt(lambda: collgrad.safe_get_full_model_grads(eng))
    eng.step()
    out["after_step"] = attempt(lambda: collgrad.safe_get_full_model_grads(eng))
    out["iter_after_step"] = attempt(lambda: list(collgrad.iter_full_model_grads(eng)))
    return out


MISUSE = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16_acc32"), (2, "bf16_acc32"), (0, "fp32")]


def _all_misuse(rank, world):
    return {(stage, dtype): _misuse(rank, world, stage, dtype) for stage, dtype in MISUSE}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def misuse_results(request):
    return run_ranks(_all_misuse, request.param, timeout=600)


@pytest.mark.parametrize("stage,dtype", MISUSE, ids=[f"zero{s}_{d}" for s, d in MISUSE])
def test_misuse_raises_the_same_clear_error_on_every_rank(misuse_results, stage, dtype):
    results = [per_rank[(stage, dtype)] for per_rank in misuse_results]
    expectations = {
        "before_backward": ("NotReadyError", "before backward() or after step()"),
        "mid_accumulation": ("NotReadyError", "not a gradient accumulation boundary"),
        "different_subsets": ("ArgumentMismatchError", "parameter names, shapes, dtypes or subsets (params=) differ"),
        "after_step": ("NotReadyError", "before backward() or after step()"),
        "iter_after_step": ("NotReadyError", "before backward() or after step()"),
    }
    for phase, (kind, text) in expectations.items():
        messages = set()
        for rank, res in enumerate(results):
            assert res[phase]["error"] == kind, (phase, rank, res[phase])
            assert text in res[phase]["message"], (phase, res[phase]["message"])
            assert res[phase]["seconds"] < 10
            messages.add(res[phase]["message"].split(" [seen by")[0])
        assert len(messages) == 1, messages  # the same error on every rank
    assert all(res["valid"]["error"] is None for res in results)


def _moe(rank, world, ep_size, num_experts, stage, dtype):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    import collgrad
    from tests.deepspeed import models
    from tests.deepspeed.test_state_read import _rebuilt
    from tests.tolerance import norm_of_sum_of_squares, unit_roundoff

    eng = models.moe_engine(models.config(stage, dtype=dtype), ep_size, num_experts)
    models.run_backward(eng, rank)
    grads = collgrad.safe_get_full_model_grads(eng)
    ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
    stats = collgrad.safe_get_full_model_grad_stats(eng)
    # fp32 fragment norms against the fp64 norm of the same values (tests/tolerance.py)
    stats_equal = all(
        abs(stats.params[n].norm - float(g.double().norm()))
        <= norm_of_sum_of_squares(g.numel(), torch.float32) * float(g.double().norm()) + 1e-30
        for n, g in grads.items()
    )
    # Writing: each rank's own values (expert shards differ between expert-parallel ranks) read back.
    new = {n: g * 2 + 1 for n, g in grads.items()}
    collgrad.safe_set_full_model_grads(eng, new)
    back = collgrad.safe_get_full_model_grads(eng)
    eng.step()  # the fp32 weights and Adam's moments, per expert group, against DeepSpeed's accessors
    # (its accessor raises for Adam's moments of an MoE engine, "exp_avg not found in optimizer state
    # fragment": there, every rank's partitions gathered plainly and cut where DeepSpeed's offsets say)
    trainable = [(n, p) for n, p in eng.module.named_parameters() if p.requires_grad]
    states = {
        "fp32": collgrad.safe_get_full_model_fp32_params(eng),
        "exp_avg": collgrad.safe_get_full_model_optimizer_states(eng, "exp_avg"),
    }
    theirs = {
        "fp32": {n: safe_get_full_fp32_param(p) for n, p in trainable},
        "exp_avg": _rebuilt(eng, "exp_avg", trainable),
    }
    return {
        "state_equal": {
            key: list(ours) == [n for n, _ in trainable]
            and [n for n in ours if not torch.equal(ours[n], theirs[key][n])]
            for key, ours in states.items()
        },
        "stats_equal": stats_equal,
        "written": all(
            # bf16 + fp32 accumulation: at most one rounding to bf16 on the way (tests/tolerance.py)
            torch.allclose(
                back[n].float(), new[n].float(), rtol=unit_roundoff(torch.bfloat16) if dtype != "fp32" else 0, atol=0
            )
            for n in new
        ),
        "equal": all(torch.equal(grads[n], ds[n]) for n in ds) and list(grads) == list(ds),
        "groups": [(g.plan, g.ranks, g.collectives, g.params) for g in grads.record.groups],
        "model_parallel": sorted(grads.model_parallel),
    }


def _moe_both(rank, world, ep_size, path):
    import collgrad

    out = {dtype: _moe(rank, world, ep_size, world, 2, dtype) for dtype in ("fp32", "bf16_acc32")}
    from tests.deepspeed import models

    eng = models.moe_engine(models.config(2), ep_size, world)
    # every expert whole under its global name, whatever ep_size (test_expert_parallel_resume.py loads them)
    saved = attempt(lambda: collgrad.save_full_model(eng, path).tensors, keep=True)
    out["save"] = (saved["error"], saved.get("value"))
    return out


@pytest.mark.parametrize("world,ep_size", [(2, 2), (2, 1), (3, 3)])
def test_moe_expert_parameters_reduced_within_their_expert_data_parallel_group(world, ep_size, tmp_path):
    results = run_ranks(_moe_both, world, ep_size, str(tmp_path), timeout=300)
    saves = [both.pop("save") for both in results]
    # the dense layers (4 tensors), the gate (1) and every expert's weight and bias
    assert saves == [(None, 5 + 2 * world)] * world, saves
    for rank, both in enumerate(results):
        for res in both.values():
            assert res["equal"] and res["state_equal"] == {"fp32": [], "exp_avg": []}, res  # + weights, moments
            assert res["stats_equal"] and res["written"], res  # statistics and writing, per expert group
            # at ep_size 1 every expert is whole on every rank: no shard
            assert bool(res["model_parallel"]) == (ep_size > 1) and all("experts" in n for n in res["model_parallel"])
            expert_groups = [g for g in res["groups"] if g[1] != tuple(range(world))]
            if ep_size == world:  # one expert per rank: its group is the rank alone, nothing to send
                assert expert_groups == [("local", (rank,), 0, 2)]
            else:
                assert len(res["groups"]) == 2 and all(g[2] >= 1 for g in res["groups"])


def _whole_model_jobs(eng, root: str) -> dict[str, tuple]:
    """Each whole-model checkpoint job on ``eng``: the error's type and message."""
    import collgrad

    out = {}
    jobs = (collgrad.save_full_model, collgrad.save_training_state, collgrad.load_full_model)
    for job in (*jobs, collgrad.load_training_state):
        found = attempt(lambda job=job: job(eng, root))
        out[job.__name__] = (found["error"], found.get("message", "").split(" [seen by")[0])
    return out


def _unsupported(rank, world, root):
    """Ulysses sequence parallelism over both ranks, then a pipeline of two stages (whose topology
    DeepSpeed keeps for every later engine of the process)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from torch import nn

    from tests.deepspeed import models

    out = {}
    cfg = {**models.config(2), "sequence_parallel_size": 2, "data_parallel_size": 1}
    out["sequence"] = _whole_model_jobs(models.engine(cfg), root)
    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks DeepSpeed's communication for the rank
    torch.manual_seed(0)
    layers = [nn.Linear(models.IN, models.HID), nn.ReLU(), nn.Linear(models.HID, models.OUT)]
    pipe = PipelineModule(layers, num_stages=2, loss_fn=nn.MSELoss())
    cfg = models.config(1)
    eng, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-3), config=cfg)
    out["pipeline"] = _whole_model_jobs(eng, root)
    return out


def test_layouts_a_whole_model_checkpoint_does_not_support_are_refused_on_every_rank(tmp_path):
    results = run_ranks(_unsupported, 2, str(tmp_path), timeout=300)
    for layout, text in {
        "pipeline": "DeepSpeed pipeline parallelism (stage {rank} of 2",
        "sequence": "DeepSpeed Ulysses sequence parallelism (sequence_parallel_size 2)",
    }.items():
        for rank, res in enumerate(results):
            for job, (error, message) in res[layout].items():
                assert error == "InvalidArgumentError", (layout, rank, job, error, message)
                assert f"rank {rank}: " in message and text.format(rank=rank) in message, (layout, job, message)
                assert "is held under" in message and "its framework's own checkpointing" in message, message
    assert not [f for f in tmp_path.iterdir() if not f.name.startswith(".")]  # nothing written
