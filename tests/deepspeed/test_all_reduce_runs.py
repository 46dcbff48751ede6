"""The all-reduce plan copies a rank's repeated layers into its bucket a run at a time (DeepSpeed's
ZeRO-1/2 fragments lie back to front, so a run lands reversed): on models made of equal tensors and
of repeated blocks, ZeRO-1/2 fp32, bf16 (stored bf16, returned fp32) and CPU offload, 2 and 3 ranks,
the all-reduce plan and the stream return exactly what the all-gather plan and DeepSpeed's own
accessor return."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch
from torch import nn

from tests.harness import run_ranks

CONFIGS = {
    "zero1_fp32": (1, "fp32", False),
    "zero2_fp32": (2, "fp32", False),
    "zero2_bf16": (2, "bf16", False),
    "zero2_offload": (2, "fp32", True),
}


class Equal(nn.Module):
    """Equal tensors back to back: a rank's share is one run, landing reversed in the bucket."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.w = nn.ParameterList(nn.Parameter(torch.rand(20) + 0.5) for _ in range(12))

    def forward(self, x):
        h = x
        for w in self.w:
            h = h * w
        return h[:, :5]


def _worker(rank, world):
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from tests.deepspeed import models

    out = {}
    for name, (stage, dtype, offload) in CONFIGS.items():
        for model_name, make in (("equal", Equal), ("blocks", models.Blocks)):
            model = make()
            eng = models.engine(models.config(stage, dtype=dtype, offload=offload), model)
            width = 20 if model_name == "equal" else models.IN
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
            eng.backward(eng(x.to(next(model.parameters()).dtype)).float().pow(2).mean())
            gathered = collgrad.safe_get_full_model_grads(eng, plan="all_gather")
            reduced = collgrad.safe_get_full_model_grads(eng, plan="all_reduce")
            again = collgrad.safe_get_full_model_grads(eng, plan="all_reduce")  # copy plan from the cache
            streamed = dict(collgrad.iter_full_model_grads(eng, bucket_bytes=200))
            ds = {n: safe_get_full_grad(p).float() for n, p in eng.module.named_parameters()}
            out[(name, model_name)] = {
                "names": list(gathered),
                "reduced": all(torch.equal(reduced[n], g) for n, g in gathered.items()),
                "again": all(torch.equal(again[n], g) for n, g in gathered.items()),
                "streamed": set(streamed) == set(gathered)
                and all(torch.equal(streamed[n], g) for n, g in gathered.items()),
                "deepspeed": all(torch.equal(ds[n], g) for n, g in gathered.items()),
                "nonzero": all(bool(g.abs().sum() > 0) for g in gathered.values()),
            }
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_ranks(_worker, request.param, timeout=600)


@pytest.mark.parametrize("model", ["equal", "blocks"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_all_reduce_plan_and_stream_equal_the_gather_and_deepspeed(results, config, model):
    for res in results:
        entry = res[(config, model)]
        assert len(entry["names"]) >= 12 and entry["nonzero"]
        assert entry["reduced"] and entry["again"] and entry["streamed"] and entry["deepspeed"], entry
