"""AutoTP: tensor-parallel shards are reconstructed across the data-parallel group only, stay local
across tensor-parallel ranks, and are reported as such; written back shard-shaped, and their
statistics are of the shard. ``save_full_model`` writes every tensor whole, each shard by its holders
into its slice of the whole tensor's place: bitwise the shards all-gathered over the tensor-parallel
group and joined by hand. 4 ranks: tensor-parallel 2 x data-parallel 2."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import os

import torch
import torch.distributed as dist

from tests.harness import attempt, run_ranks

TP = 2
#: TPNet's splits (tests/deepspeed/models.autotp_config): up_proj column-parallel, down_proj row-parallel
SPLIT_DIMS = {"up_proj.weight": 0, "up_proj.bias": 0, "down_proj.weight": 1}


def _joined_by_hand(eng):
    """Every parameter as the unsharded model has it: the module's weight (ZeRO-3: gathered), an AutoTP
    shard all-gathered over its tensor-parallel group and joined along its split dimension."""
    import deepspeed
    from deepspeed.utils import groups

    out = {}
    for name, param in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            local = param.detach().clone()
        if name in SPLIT_DIMS:
            parts = [torch.empty_like(local) for _ in range(TP)]
            dist.all_gather(parts, local, group=groups.get_tensor_model_parallel_group())
            local = torch.cat(parts, SPLIT_DIMS[name])
        out[name] = local
    return out


def _joined(values: dict) -> dict:
    """DeepSpeed's accessors' tensor-parallel shards all-gathered over the tensor-parallel group and
    joined along their split dimension: the unsharded model's tensors."""
    from deepspeed.utils import groups

    out = {}
    for name, local in values.items():
        if name in SPLIT_DIMS:
            parts = [torch.empty_like(local) for _ in range(TP)]
            dist.all_gather(parts, local.contiguous(), group=groups.get_tensor_model_parallel_group())
            local = torch.cat(parts, SPLIT_DIMS[name])
        out[name] = local
    return out


def _whole(eng, grads_before_step: dict) -> dict:
    """model_parallel="whole": the gradients (read before the step), bitwise DeepSpeed's accessor joined
    by hand, in one all-gather over the tensor-parallel group; their statistics; writes of whole values."""
    import collgrad

    whole = collgrad.safe_get_full_model_grads(eng, model_parallel="whole")
    joined = _joined(grads_before_step)
    stats = collgrad.safe_get_full_model_grad_stats(eng, model_parallel="whole")
    norms = {n: float(g.double().norm()) for n, g in joined.items()}
    total = float(torch.cat([g.double().reshape(-1) for g in joined.values()]).norm())
    new = {n: g * 2 + 1 for n, g in whole.items()}
    collgrad.safe_set_full_model_grads(eng, new, model_parallel="whole")
    back = collgrad.safe_get_full_model_grads(eng, model_parallel="whole")
    collgrad.safe_set_full_model_grads(eng, dict(whole), model_parallel="whole")  # as they were
    # whole values that differ on one rank (a tensor-parallel peer of another data-parallel group):
    # every rank of the model refuses them together, before anything is written
    rank = dist.get_rank()
    differing = {n: g + (rank == 3) for n, g in whole.items()}
    refused = attempt(lambda: collgrad.safe_set_full_model_grads(eng, differing, model_parallel="whole"))["error"]
    after = collgrad.safe_get_full_model_grads(eng, model_parallel="whole")
    return {
        "refused": (refused, all(torch.equal(after[n], whole[n]) for n in whole)),
        "names": list(whole) == list(joined) and not whole.model_parallel,
        "unequal": [n for n in joined if not torch.equal(whole[n], joined[n])],
        "collectives": [c.collectives for c in whole.record.model_parallel_calls],
        # a split tensor's norm over both shards, a replicated one once (not once per tensor-parallel rank)
        "norms": all(abs(stats.params[n].norm - v) <= 1e-6 * v for n, v in norms.items())
        and abs(stats.global_norm - total) <= 1e-6 * total
        and stats.params["up_proj.weight"].numel == 56,
        "written": [n for n in new if not torch.equal(back[n], new[n])],
    }


def _saved_whole(eng, directory):
    """Whether ``save_full_model``'s file holds every tensor whole, bitwise as joined by hand."""
    from safetensors.torch import load_file

    import collgrad

    saved = collgrad.save_full_model(eng, directory)
    stored = load_file(os.path.join(directory, "model.safetensors"))
    joined = _joined_by_hand(eng)
    return {
        "names": list(stored) == list(joined) and saved.files == ("model.safetensors",),
        "shapes": {n: tuple(t.shape) for n, t in stored.items()},
        "unequal": [n for n in joined if not torch.equal(stored[n], joined[n])],
    }


def _worker(rank, world, path):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    import collgrad
    from tests.deepspeed import models

    out = {}
    for stage in (2, 3):
        eng = models.engine(models.autotp_config(stage, TP), models.TPNet())
        x, y = models.batch(rank // TP, 0)  # tensor-parallel peers see the same batch
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        grads = collgrad.safe_get_full_model_grads(eng)
        ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
        out[stage] = {
            "equal": list(grads) == list(ds) and all(torch.equal(grads[n], ds[n]) for n in ds),
            "shapes": {n: tuple(t.shape) for n, t in grads.items()},
            "model_parallel": sorted(grads.model_parallel),
            "groups": [(g.plan, g.ranks) for g in grads.record.groups],
        }
        stats = collgrad.safe_get_full_model_grad_stats(eng)
        from tests.tolerance import norm_of_sum_of_squares

        out[stage]["stats"] = {
            n: (
                # fp32 fragment norms against the fp64 norm of the same values (tests/tolerance.py)
                abs(s.norm - float(grads[n].double().norm()))
                <= norm_of_sum_of_squares(grads[n].numel(), torch.float32) * float(grads[n].double().norm()),
                s.max_abs == float(grads[n].abs().max()),
                s.numel == grads[n].numel(),
            )
            for n, s in stats.params.items()
        }
        out[stage]["stats_model_parallel"] = sorted(stats.model_parallel)
        new = {n: g * 2 + 1 for n, g in grads.items()}
        collgrad.safe_set_full_model_grads(eng, new)
        back = collgrad.safe_get_full_model_grads(eng)
        ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
        out[stage]["written"] = all(torch.equal(back[n], new[n]) and torch.equal(ds[n], new[n]) for n in new)
        out[stage]["whole"] = _whole(eng, ds)
        # whole writes train like plain PyTorch: the plain model's gradients of the global batch, written
        # whole (each rank its slice), stepped; the plain model takes the same Adam step
        plain = models.TPNet()
        reference = models.reference_grads(world // TP, make=models.TPNet)
        collgrad.safe_set_full_model_grads(eng, reference, model_parallel="whole")
        eng.step()
        adam = torch.optim.Adam(plain.parameters(), lr=1e-3)
        for n, p in plain.named_parameters():
            p.grad = reference[n].clone()
        adam.step()
        trained = collgrad.safe_get_full_model_fp32_params(eng, model_parallel="whole")
        # the same elementwise update, over one flat partition there and per tensor here: an ulp apart at most
        out[stage]["trains"] = [
            n for n, p in plain.named_parameters() if not torch.allclose(trained[n], p.detach(), rtol=2**-23, atol=0)
        ]
        # the fp32 weights and Adam's moments: the tensor-parallel shards stay local, as their gradients
        trainable = [(n, p) for n, p in eng.module.named_parameters() if p.requires_grad]
        fp32 = collgrad.safe_get_full_model_fp32_params(eng)
        exp_avg = collgrad.safe_get_full_model_optimizer_states(eng, "exp_avg")
        theirs = [(safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg")) for _, p in trainable]
        out[stage]["state_equal"] = (
            all(torch.equal(fp32[n], w) and torch.equal(exp_avg[n], m) for (n, _), (w, m) in zip(trainable, theirs))
            and sorted(fp32.model_parallel) == out[stage]["model_parallel"]
        )
        # and whole: the masters and moments as the unsharded model has them, streamed too
        whole = {
            "fp32": collgrad.safe_get_full_model_fp32_params(eng, model_parallel="whole"),
            "exp_avg": dict(collgrad.iter_full_model_optimizer_states(eng, "exp_avg", model_parallel="whole")),
        }
        joined = {
            "fp32": _joined({n: w for (n, _), (w, _) in zip(trainable, theirs)}),
            "exp_avg": _joined({n: m for (n, _), (_, m) in zip(trainable, theirs)}),
        }
        out[stage]["state_whole"] = [
            f"{k}/{n}" for k in whole for n in joined[k] if not torch.equal(whole[k][n], joined[k][n])
        ] + [k for k in whole if list(whole[k]) != list(joined[k])]
        # whole writes: each rank its slice; read back whole as written
        halved = {n: w * 0.5 for n, w in whole["fp32"].items()}
        collgrad.safe_set_full_model_fp32_params(eng, halved, model_parallel="whole")
        back = collgrad.safe_get_full_model_fp32_params(eng, model_parallel="whole")
        out[stage]["state_written"] = [n for n in halved if not torch.equal(back[n], halved[n])]
        out[stage]["saved"] = _saved_whole(eng, os.path.join(path, f"zero{stage}"))
        # the training state, and DeepSpeed's own checkpoint of it (per (tp, dp) rank), for convert
        collgrad.save_training_state(eng, os.path.join(path, f"state{stage}"))
        eng.save_checkpoint(os.path.join(path, f"ds{stage}"), tag="step1")
    return out


def test_autotp_shards_stay_local_read_written_and_counted_per_shard_and_are_saved_whole(tmp_path):
    from tests.deepspeed.test_tensor_parallel_resume import _converted

    results = run_ranks(_worker, 4, str(tmp_path), timeout=600)
    # DeepSpeed's AutoTP checkpoints of both stages converted: collgrad's own training states, bitwise
    assert _converted(str(tmp_path), "ds2", "state2") == [] and _converted(str(tmp_path), "ds3", "state3") == []
    for rank, res in enumerate(results):
        for stage, entry in res.items():
            assert entry["equal"], (rank, stage)
            assert entry["model_parallel"] == ["down_proj.weight", "up_proj.bias", "up_proj.weight"]
            assert entry["shapes"]["up_proj.weight"] == (4, 7)  # the tensor-parallel shard of (8, 7)
            assert entry["shapes"]["head.weight"] == (5, 5)
            data_parallel = (rank % TP, rank % TP + TP)
            assert entry["groups"] == [("all_gather", data_parallel)]
            assert all(all(ok) for ok in entry["stats"].values()), entry["stats"]
            assert entry["stats_model_parallel"] == entry["model_parallel"]
            assert entry["written"], (rank, stage)
            assert entry["state_equal"], (rank, stage)
            # whole: one all-gather over the tensor-parallel group for the bucket of shards
            assert entry["whole"] == {
                "refused": ("ArgumentMismatchError", True),
                "names": True,
                "unequal": [],
                "collectives": [1],
                "norms": True,
                "written": [],
            }
            assert entry["state_whole"] == [] and entry["state_written"] == [], (rank, stage, entry)
            assert entry["trains"] == [], (rank, stage, entry["trains"])
            saved = entry["saved"]
            assert saved["names"] and saved["unequal"] == [], (rank, stage, saved)
            assert saved["shapes"]["up_proj.weight"] == (8, 7) and saved["shapes"]["down_proj.weight"] == (5, 8)
