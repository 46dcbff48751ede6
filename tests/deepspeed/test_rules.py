"""Regression: the two rules that make collgrad bitwise equal to DeepSpeed's accessor, shown to
matter by what a reader that broke them would return."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import run_ranks


def _rules(rank, world):
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from tests.deepspeed import models

    out = {}
    # BF16_Optimizer: every rank holds the whole averaged fp32 buffer, and p.grad is a bf16 staging copy.
    eng = models.engine(models.config(1, dtype="bf16_acc32"))
    models.run_backward(eng, rank)
    trainable = [(n, p) for n, p in eng.module.named_parameters() if p.requires_grad]
    ds = {n: safe_get_full_grad(p) for n, p in trainable}
    ours = collgrad.safe_get_full_model_grads(eng)
    staged = {n: p.grad.float() for n, p in trainable}  # a reader taking param.grad
    summed = {}
    for n, p in trainable:  # a reader that all-reduces what each rank holds instead of what it owns
        full = p._hp_grad.clone().view(p.shape)
        dist.all_reduce(full)
        summed[n] = full
    out["bf16_optimizer"] = {
        "ours_equal": all(torch.equal(ours[n], ds[n]) for n in ds),
        "staging_equal": all(torch.equal(staged[n], ds[n]) for n in ds),
        "everything_summed_equal": all(torch.equal(summed[n], ds[n]) for n in ds),
        "everything_summed_is_world_times": all(torch.allclose(summed[n], world * ds[n]) for n in ds),
    }
    # ZeRO-2 + bf16 + fp32 accumulation: each micro-step's reduced partition is added in fp32; over
    # several micro-steps the sum is not representable in the bf16 model dtype.
    eng = models.engine(models.config(2, dtype="bf16_acc32", gas=3))
    models.run_backward(eng, rank, gas=3)
    ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
    ours = collgrad.safe_get_full_model_grads(eng)
    partition = eng.optimizer.averaged_gradients[0].flat_partition
    out["zero2_bf16_acc32"] = {
        "ours_equal": all(torch.equal(ours[n], ds[n]) for n in ds),
        "partition_dtype": str(partition.dtype),
        "bf16_rounded_equal": all(torch.equal(ours[n].bfloat16().float(), ds[n]) for n in ds),
    }
    return out


def test_owned_fragment_and_fp32_preference_rules():
    for res in run_ranks(_rules, 2, timeout=300):
        bf16 = res["bf16_optimizer"]
        assert bf16["ours_equal"]
        assert not bf16["staging_equal"]  # param.grad is local and unreduced under BF16_Optimizer
        assert not bf16["everything_summed_equal"] and bf16["everything_summed_is_world_times"]
        z2 = res["zero2_bf16_acc32"]
        assert z2["ours_equal"] and z2["partition_dtype"] == "torch.float32"
        assert not z2["bf16_rounded_equal"]  # reading in the model dtype would not be bitwise equal
