"""``engine.offload_states()`` releases what collgrad caches of the engine's gradient buffers at once
(not at collgrad's next call), and reading works again after ``reload_states()``."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import run_ranks


def _worker(rank, world):
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from tests.deepspeed import models

    eng = models.engine(models.config(3))
    models.run_backward(eng, rank)
    dispatcher = collgrad.Dispatcher()
    first = collgrad.safe_get_full_model_grads(eng, dispatcher=dispatcher)
    from collgrad.state.model_cache import MODELS

    (source,) = MODELS.of(dispatcher)[eng].values()
    # views of DeepSpeed's buffer (no staging: over Gloo on CPU the gather is laid out by Gloo itself)
    held = source._pieces is not None
    eng.step()  # states are offloaded between steps, as in RLHF loops that free the device for generation
    old = eng.optimizer.grad_partitions_flat_buffer.data_ptr()
    # The gradient buffers only: DeepSpeed offloads optimizer states only for its CUDA FusedAdam.
    eng.offload_states(include=[OffloadStateTypeEnum.lp_grads])
    moved = eng.optimizer.grad_partitions_flat_buffer.data_ptr() != old
    released = source._pieces is None and not source.scratch
    eng.reload_states()
    models.run_backward(eng, rank)
    again = collgrad.safe_get_full_model_grads(eng, dispatcher=dispatcher)
    ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
    return {
        "held": held,
        "moved": moved,
        "released": released,
        "first_ok": len(first) == len(ds),
        "equal_after_reload": all(torch.equal(again[n], ds[n]) for n in ds),
    }


def test_offload_states_releases_cached_views_and_reading_works_after_reload():
    for res in run_ranks(_worker, 2, timeout=300):
        assert res == {"held": True, "moved": True, "released": True, "first_ok": True, "equal_after_reload": True}
