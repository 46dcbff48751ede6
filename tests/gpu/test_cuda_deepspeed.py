"""DeepSpeed on CUDA (tox -e cuda-nccl): fp16 loss-scale handling, which DeepSpeed's CPU accelerator
cannot run ("Type fp16 is not supported"), and ZeRO-2/3 over NCCL against DeepSpeed's accessor."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.harness import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]

CONFIGS = [(2, "fp16"), (3, "fp16"), (2, "fp32"), (3, "bf16_acc32")]


def _worker(rank, world):
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from tests.deepspeed import models

    torch.cuda.set_device(rank % torch.cuda.device_count())
    out = {}
    for stage, dtype in CONFIGS:
        model = models.Net().cuda()
        eng = models.engine(models.config(stage, dtype=dtype), model)
        models.run_backward(eng, rank)
        ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
        raw = collgrad.safe_get_full_model_grads(eng, unscale=False)
        true = collgrad.safe_get_full_model_grads(eng)
        scale = raw.record.loss_scale
        out[(stage, dtype)] = {
            "raw_equal": all(torch.equal(raw[n], ds[n]) for n in ds),
            "unscaled": all(torch.allclose(true[n], ds[n] / scale) for n in ds),
            "scale": scale,
            "device": {str(t.device) for t in true.values()},
            "collectives": raw.record.collectives,
        }
    # The all-reduce plan copies a rank's repeated layers a run at a time; DeepSpeed's ZeRO-1/2 fragments
    # lie back to front, so those runs are gathered into place with an index (on the device).
    from tests.deepspeed.test_all_reduce_runs import Equal

    eng = models.engine(models.config(2), Equal().cuda())
    x = torch.randn(4, 20, generator=torch.Generator().manual_seed(rank)).cuda()
    eng.backward(eng(x).float().pow(2).mean())
    gathered = collgrad.safe_get_full_model_grads(eng, plan="all_gather")
    reduced = collgrad.safe_get_full_model_grads(eng, plan="all_reduce")
    out["all_reduce_runs"] = all(torch.equal(reduced[n], g) for n, g in gathered.items())
    return out


def test_deepspeed_on_cuda_matches_accessor_and_unscales_fp16():
    # Two ranks: one GPU each over NCCL, or two ranks sharing one GPU over Gloo (NCCL refuses that).
    count = torch.cuda.device_count()
    backend = "cpu:gloo,cuda:nccl" if count >= 2 else "gloo"
    for rank, res in enumerate(run_ranks(_worker, 2, backend=backend, env={"DS_ACCELERATOR": "cuda"}, timeout=600)):
        assert res.pop("all_reduce_runs")
        for (stage, dtype), entry in res.items():
            assert entry["raw_equal"] and entry["unscaled"], (stage, dtype, entry)
            assert entry["device"] == {f"cuda:{rank % count}"}
            assert (entry["scale"] > 1) == (dtype == "fp16")
            assert entry["collectives"] >= 1  # partitions really crossed ranks
