"""Calling collgrad every step changes nothing in training, and repeated calls hold no memory."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import gc

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.guarantees  # the README's Guarantees section

# Steps long enough for what can change over steps, no longer: each plan twice, with and without a
# stream call beside it (plans cycle with period 3, the stream every other step); step 0 is a call on
# the first backward (what test_misuse_and_groups' one-step test was); ZeRO-3 records its parameter
# fetch order on the first step and prefetches by it from the next; Adam's state is past its first
# (sign-like) update. A step changed by a call changes the parameters every later step starts from, so
# later steps add no case: the 30 steps this test had (480 in all) ran these same cases five times over.
STEPS = 6
CONFIGS = [
    (1, "fp32"),
    (2, "fp32"),
    (3, "fp32"),
    (1, "bf16_acc32"),
    (2, "bf16_acc32"),
    (3, "bf16_acc32"),
    (2, "fp32+offload"),
    (3, "fp32+offload"),
]


def _train(rank, world, stage, dtype, call):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from tests.deepspeed import models

    base, _, offload = dtype.partition("+")
    eng = models.engine(models.config(stage, dtype=base, offload=bool(offload)))
    pdtype = next(eng.module.parameters()).dtype
    fresh = True  # the layout cached at step 0 must still read this step's gradients
    for step in range(STEPS):
        x, y = models.batch(rank, step, pdtype)
        eng.backward(torch.nn.functional.mse_loss(eng(x).float(), y.float()))
        if call:
            plan = ("all_gather", "all_reduce", "auto")[step % 3]
            grads = collgrad.safe_get_full_model_grads(eng, plan=plan)
            if step % 2 == 0:
                for _ in collgrad.iter_full_model_grads(eng, bucket_bytes=128):
                    pass
            ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
            fresh = fresh and all(torch.equal(grads[n], ds[n]) for n in ds)
        eng.step()
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters()), enabled=stage == 3):
        return [p.detach().clone() for p in eng.module.parameters()], fresh


def _both(rank, world):
    out = {}
    for stage, dtype in CONFIGS:
        with_calls, fresh = _train(rank, world, stage, dtype, True)
        without, _ = _train(rank, world, stage, dtype, False)
        out[(stage, dtype)] = (all(torch.equal(a, b) for a, b in zip(with_calls, without)), fresh)
    return out


def test_steps_with_a_call_every_step_give_bitwise_identical_parameters():
    # ...and every step's call, served from the layout cached at step 0, equals DeepSpeed's accessor
    for per_rank in run_ranks(_both, 2, timeout=900):
        assert per_rank == dict.fromkeys(CONFIGS, (True, True))


def _leaks(rank, world):
    import weakref

    import collgrad
    from collgrad.bench import VectorModel, _host_bytes_in_use
    from tests.deepspeed import models

    in_use = _host_bytes_in_use()
    out = {}
    for stage in (2, 3):
        model = VectorModel(50, 200_000)  # 800 kB of gradient: a leaked result per call would show
        eng = models.engine(models.config(stage), model)
        eng.backward(eng(torch.rand(2, model.width)))
        for _ in range(20):  # warm-up: caches, staging buffers, allocator pools
            collgrad.safe_get_full_model_grads(eng)
        gc.collect()
        before = in_use()
        for i in range(300):
            grads = collgrad.safe_get_full_model_grads(eng, plan=("all_gather", "all_reduce")[i % 2])
            del grads
        gc.collect()
        out[stage] = in_use() - before
    # The plan cache holds models weakly: it lets go of a model when the model goes.
    dispatcher = collgrad.Dispatcher()
    plain = torch.nn.Linear(4, 3)
    plain(torch.ones(2, 4)).sum().backward()
    collgrad.safe_get_full_model_grads(plain, dispatcher=dispatcher)
    ref = weakref.ref(plain)
    from collgrad.state.model_cache import MODELS

    cached = len(MODELS.of(dispatcher))
    del plain
    gc.collect()
    out["cache"] = (cached, len(MODELS.of(dispatcher)), ref() is None)
    return out


@pytest.mark.parametrize("world", [2])
def test_three_hundred_calls_leave_memory_flat_and_the_cache_lets_go(world):
    for res in run_ranks(_leaks, world, timeout=600):
        assert abs(res[2]) < 2 * 2**20 and abs(res[3]) < 2 * 2**20, res  # < 2 MiB after 300 calls
        assert res["cache"] == (1, 0, True)
