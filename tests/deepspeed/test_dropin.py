"""collgrad.integrations.deepspeed.install(): DeepSpeed's six full accessors served by collgrad, on real
engines, 2 and 3 CPU ranks. The documented loop returns what DeepSpeed's originals return (bitwise,
dtype, shape, device, None for frozen parameters) with one collective per window per kind; a write is
read back; backward() and step() make reads see new values; misuse raises on every rank; uninstall()
puts DeepSpeed's functions back, also in a module that had imported them by name."""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import attempt, run_ranks

CONFIGS = {  # name: (stage, dtype, offload)
    "zero1_fp32": (1, "fp32", False),
    "zero2_fp32": (2, "fp32", False),
    "zero3_fp32": (3, "fp32", False),
    "zero2_offload": (2, "fp32", True),
    "zero3_offload": (3, "fp32", True),
    "zero1_bf16_acc32": (1, "bf16_acc32", False),  # BF16_Optimizer: its fp32 and states fall back
    "zero0_fp32": (0, "fp32", False),  # p.grad; DeepSpeed's fp32 and state getters return None there
}
KINDS = ("grad", "fp32", "exp_avg")


def _loop(utils, named):
    """The documented loop: the three getters over every parameter, frozen ones too."""
    return {
        n: (
            utils.safe_get_full_grad(p),
            utils.safe_get_full_fp32_param(p),
            utils.safe_get_full_optimizer_state(p, "exp_avg"),
        )
        for n, p in named
    }


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


def _worker(rank, world):
    import deepspeed.utils as utils

    import collgrad
    from collgrad.integrations import deepspeed as dropin
    from tests.counting import count_collectives
    from tests.deepspeed import models

    fragment = sys.modules["deepspeed.utils.tensor_fragment"]
    originals = {name: getattr(fragment, name) for name in dropin.ACCESSORS}
    holder = types.ModuleType("user_code_that_imported_the_names")
    holder.safe_get_full_grad = originals["safe_get_full_grad"]  # `from deepspeed.utils import ...` before install
    sys.modules[holder.__name__] = holder
    out = {}
    for name, (stage, dtype, offload) in CONFIGS.items():
        eng = models.engine(models.config(stage, dtype=dtype, offload=offload))
        models.run_backward(eng, rank)
        eng.step()
        models.run_backward(eng, rank)
        named = list(eng.module.named_parameters())
        theirs = _loop(utils, named)  # DeepSpeed's own, one collective per call
        entry: dict = {}
        with dropin.installed(eng):
            entry["replaced"] = (
                all(
                    getattr(m, n) is not originals[n] and getattr(m, n).__module__ == dropin.__name__
                    for m in (utils, fragment)
                    for n in dropin.ACCESSORS
                )
                and holder.safe_get_full_grad is utils.safe_get_full_grad
            )
            ours = _loop(utils, named)
            with count_collectives() as seen:  # again, as every step does: layouts and plans known
                _loop(utils, named)
            entry["calls"] = (seen.data, seen.agreements)
            entry["equal"] = {n: [_same(a, b) for a, b in zip(ours[n], theirs[n])] for n in theirs}
            entry["frozen_none"] = all(v is None for n, p in named if not p.requires_grad for v in ours[n])
            # a write is read back; a step makes reads see the step's values
            trainable = [(n, p) for n, p in named if p.requires_grad]
            for n, p in trainable:
                utils.safe_set_full_grad(p, torch.full_like(theirs[n][0], 0.25))
                if stage > 0:  # (DeepSpeed has none to give at stage 0)
                    utils.safe_set_full_fp32_param(p, theirs[n][1] * 0.5)
                    utils.safe_set_full_optimizer_state(p, theirs[n][2] + 1, "exp_avg")
            back = _loop(utils, trainable)
            # (BF16_Optimizer: DeepSpeed's gradient setter writes the bf16 staging gradient, its getter reads
            # the fp32 accumulation: a written gradient is not read back there, by DeepSpeed or by collgrad)
            entry["written"] = all(
                (dtype != "fp32" or torch.equal(back[n][0], torch.full_like(theirs[n][0], 0.25)))
                and (stage == 0 or torch.equal(back[n][1], theirs[n][1] * 0.5))
                and (stage == 0 or torch.equal(back[n][2], theirs[n][2] + 1))
                for n, _ in trainable
            )
            entry["none_at_stage0"] = stage > 0 or all(back[n][1] is None and back[n][2] is None for n, _ in trainable)
            if dtype == "fp32" and stage > 0:
                # a window open (the small model is one), then collgrad's model-wide setter writes: the
                # next read sees what it wrote; the old values are put back after
                last, p_last = trainable[-1]
                utils.safe_get_full_fp32_param(trainable[0][1])
                collgrad.safe_set_full_model_fp32_params(eng, {n: back[n][1] * 2 for n, _ in trainable})
                entry["model_wide_write_seen"] = torch.equal(utils.safe_get_full_fp32_param(p_last), back[last][1] * 2)
                collgrad.safe_set_full_model_fp32_params(eng, {n: back[n][1] for n, _ in trainable})
            eng.step()
            stepped = {n: utils.safe_get_full_fp32_param(p) for n, p in trainable}
            entry["after_step"] = [stage == 0 or not torch.equal(stepped[n], back[n][1]) for n, _ in trainable]
            # misuse: a read after step (no gradient of this step), ranks asking for different parameters
            p0, mine = trainable[0][1], trainable[rank % 2][1]
            entry["after_step_grad"] = attempt(lambda p0=p0: utils.safe_get_full_grad(p0))
            if dtype == "fp32" and stage > 0:  # not where DeepSpeed's own accessor serves (it aborts the job)
                entry["different"] = attempt(lambda mine=mine: utils.safe_get_full_fp32_param(mine))
        entry["restored"] = all(getattr(m, n) is originals[n] for m in (utils, fragment) for n in dropin.ACCESSORS)
        entry["restored_holder"] = holder.safe_get_full_grad is originals["safe_get_full_grad"]
        entry["unwatched"] = "step" not in vars(eng) and "backward" not in vars(eng)
        out[name] = entry
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=600)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_loop_returns_what_deepspeed_returns(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        assert entry["replaced"]
        assert all(all(same) for same in entry["equal"].values()), entry["equal"]
        assert entry["frozen_none"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_collective_per_window_per_kind(results, config):
    _, per_rank = results
    for res in per_rank:
        data, agreements = res[config]["calls"]
        if config == "zero1_bf16_acc32":  # gradients held whole; fp32, exp_avg: DeepSpeed's own, per parameter
            assert (data, agreements) == (2 * 10, 1), res[config]["calls"]
        elif config == "zero0_fp32":  # p.grad, and None: nothing to send
            assert (data, agreements) == (0, 0), res[config]["calls"]
        else:  # the small model is one window: one agreement and one gather per kind
            assert (data, agreements) == (3, 3), res[config]["calls"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_writes_are_read_back_and_a_step_makes_reads_new(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        assert entry["written"] and entry["none_at_stage0"]
        stage, dtype, _ = CONFIGS[config]
        if dtype == "fp32" and stage > 0:  # a window dropped by collgrad's model-wide setter
            assert entry["model_wide_write_seen"]
        assert all(entry["after_step"]), entry["after_step"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_misuse_raises_on_every_rank_and_uninstall_restores(results, config):
    world, per_rank = results
    for res in per_rank:
        entry = res[config]
        if config != "zero0_fp32":  # stage 0: p.grad, as DeepSpeed returns it
            assert entry["after_step_grad"]["error"] == "NotReadyError", entry["after_step_grad"]
        if config not in ("zero1_bf16_acc32", "zero0_fp32"):  # DeepSpeed's own serves there, or None
            assert entry["different"]["error"] == "ArgumentMismatchError", entry["different"]
            assert entry["different"]["seconds"] < 10
        assert entry["restored"] and entry["restored_holder"] and entry["unwatched"]


def _alone(rank, world):
    """Rank 0 calls an installed getter, the others do not: DeepSpeed's accessor would wait forever."""
    import time

    import deepspeed.utils as utils

    from collgrad.integrations import deepspeed as dropin
    from tests.deepspeed import models

    eng = models.engine(models.config(2))
    models.run_backward(eng, rank)
    p = next(p for p in eng.module.parameters() if p.requires_grad)
    with dropin.installed(eng):
        if rank == 0:
            return attempt(lambda: utils.safe_get_full_fp32_param(p))
        time.sleep(8)  # alive, in no collective: the caller's bounded wait runs out
        return None


def test_a_call_on_one_rank_only_raises_there_within_its_bounded_wait():
    alone = run_ranks(_alone, 2, env={"COLLGRAD_TIMEOUT": "3"}, timeout=120)[0]
    assert alone["error"] == "CollgradTimeoutError", alone
    assert alone["seconds"] < 8, alone
