"""The pre-step hook on a DeepSpeed engine stepped by the user (2 and 3 ranks): it fires once per
accumulation boundary and never at other micro-steps, every N-th boundary with ``every=N``, not after
``remove()``; an exception in it on one rank makes every rank raise at once, and no parameter changes."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import time

import torch

from tests.deepspeed import models
from tests.harness import attempt, run_ranks

GAS = 2
VARIANTS = {  # name: (stage, dtype, offload); Accelerate's test covers ZeRO-1/2/3 in fp32 and bf16 + fp32 acc.
    "zero0_fp32": (0, "fp32", False),
    "zero2_fp16": (2, "fp16", False),
    "zero2_offload": (2, "fp32", True),
    "zero3_offload": (3, "fp32", True),
    "zero1_bf16_acc32": (1, "bf16_acc32", False),  # BF16_Optimizer
}


def _worker(rank, world):
    import collgrad
    from tests.deepspeed import models
    from tests.deepspeed.test_write import _params

    out = {}
    eng = models.engine(models.config(2, gas=GAS))
    fired, every2 = [], []
    handle = collgrad.register_pre_step_hook(eng, lambda e: fired.append((e.micro_steps, e.global_steps)))
    handle2 = collgrad.register_pre_step_hook(eng.module, lambda e: every2.append(e.global_steps), every=2)
    for _ in range(4):  # 4 boundaries, 8 micro-steps
        models.run_backward(eng, rank, GAS)
        eng.step()
    out["fired"] = fired
    out["every2"] = every2
    handle.remove()
    handle.remove()  # idempotent
    models.run_backward(eng, rank, GAS)
    eng.step()
    out["after_remove"] = (len(fired), len(every2), handle.active, handle2.active)
    handle2.remove()
    out["unhooked"] = "_take_model_step" not in vars(eng)

    # An exception on the last rank only: after a collgrad call (the others wait in the hook's check),
    # and before one (the others are inside a collgrad call when they learn of it).
    for where in ("after", "before"):

        def failing(e, where=where):
            if where == "after":
                collgrad.safe_get_full_model_grad_stats(e)
            if rank == world - 1:
                raise ValueError("boom")
            collgrad.safe_get_full_model_grad_stats(e)

        h = collgrad.register_pre_step_hook(eng, failing)
        if where == "after":
            models.run_backward(eng, rank, GAS)
        # (after a failed step the engine is still at the boundary, with the same gradients: step again)
        before = _params(eng)
        start = time.monotonic()
        out[where] = attempt(eng.step)
        out[where]["seconds"] = time.monotonic() - start
        out[where]["unchanged"] = all(torch.equal(before[n], p) for n, p in _params(eng).items())
        h.remove()
    # Every variant: the hook fires once per boundary and reads what plain PyTorch computes.
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True  # fp16 code paths are CPU-agnostic
    reference = models.reference_grads(world, GAS)
    bounds = models.reference_bounds(world, GAS)  # a reordered fp32 mean's distance, per parameter
    for name, (stage, dtype, offload) in VARIANTS.items():
        eng = models.engine(models.config(stage, dtype=dtype, offload=offload, gas=GAS))
        seen = []

        def read(e, seen=seen):
            grads = collgrad.safe_get_full_model_grads(e)
            distance = {n: float((grads[n].float() - g).norm() / g.norm()) for n, g in reference.items()}
            seen.append((max(distance.values()), max(distance[n] / bounds[n] for n in distance)))

        h = collgrad.register_pre_step_hook(eng, read)
        models.run_backward(eng, rank, GAS)
        eng.step()
        h.remove()
        out[name] = seen
    out["bad_every"] = attempt(lambda: collgrad.register_pre_step_hook(eng, print, every=0))
    out["plain_module"] = attempt(lambda: collgrad.register_pre_step_hook(models.Net(), print))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=600)


def test_fires_once_per_boundary_never_between_and_every_nth(results):
    _, per_rank = results
    for res in per_rank:
        # (micro_steps, global_steps) as the hook sees them: step() counts both at its end, so the
        # boundaries (the 2nd, 4th, 6th, 8th micro-step) show as 1, 3, 5, 7, before each update
        assert res["fired"] == [(1, 0), (3, 1), (5, 2), (7, 3)], res["fired"]
        assert res["every2"] == [1, 3]  # the 2nd and 4th boundary


def test_remove_stops_it_and_unhooks_the_engine(results):
    _, per_rank = results
    for res in per_rank:
        assert res["after_remove"] == (4, 2, False, True)  # the 5th boundary: removed one silent, every=2 too
        assert res["unhooked"]


@pytest.mark.parametrize("where", ["after", "before"])
def test_an_exception_on_one_rank_makes_every_rank_raise_and_no_step_is_taken(results, where):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        entry = res[where]
        expected = "ValueError" if rank == world - 1 else "PreStepHookError"
        assert entry["error"] == expected, entry
        if expected == "PreStepHookError":
            assert f"rank(s) [{world - 1}]" in entry["message"] or "another rank" in entry["message"], entry
        assert entry["seconds"] < 10
        assert entry["unchanged"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_sees_plain_pytorch_gradients_in_the_hook(results, variant):
    _, per_rank = results
    dtype = VARIANTS[variant][1]
    for res in per_rank:
        assert len(res[variant]) == 1, res[variant]
        distance, ratio = res[variant][0]
        if dtype == "fp32":  # within the bound of a reordered fp32 mean (models.reference_bounds)
            assert ratio <= 1, res[variant]
        else:  # bf16/fp16 forward and backward against fp32 (models.low_precision_bound)
            low = models.low_precision_bound(torch.float16 if dtype == "fp16" else torch.bfloat16)
            assert distance < low, (res[variant], low)


def test_arguments_are_checked(results):
    _, per_rank = results
    for res in per_rank:
        assert res["bad_every"]["error"] == "InvalidArgumentError"
        assert res["plain_module"]["error"] == "InvalidArgumentError"
        assert "no fused step" in res["plain_module"]["message"]
