"""safe_get_full_model_grad_stats on real DeepSpeed engines (2 and 3 ranks): equal to the same statistics of plain
PyTorch gradients and of collgrad's full gradients, identical on every rank, one small collective per
gradient group and no full gradient built; non-finite values counted exactly; the global norm is
the one DeepSpeed clips with; misuse raises on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import math

import torch

from tests.deepspeed import models
from tests.harness import attempt, run_ranks
from tests.tolerance import norm_of_sum_of_squares, reordered_sum

CONFIGS = {
    "zero1_fp32": (1, "fp32", False),
    "zero2_fp32": (2, "fp32", False),
    "zero3_fp32": (3, "fp32", False),
    "zero2_offload": (2, "fp32", True),
    "zero3_offload": (3, "fp32", True),
    "zero1_bf16_acc32": (1, "bf16_acc32", False),  # BF16_Optimizer: nothing to send
    "zero2_bf16_acc32": (2, "bf16_acc32", False),
    "zero2_fp16": (2, "fp16", False),
    "zero0_fp32": (0, "fp32", False),
}


def _stat(g: torch.Tensor) -> tuple[float, float, int, int]:
    g = g.double().reshape(-1)
    return float(g.norm()), float(g.abs().max()), int((~torch.isfinite(g)).sum()), g.numel()


def _close(a: float, b: float, rel: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * max(abs(b), 1e-30)


def _same(a: float, b: float) -> bool:
    """Equal, NaN included: a maximum of |g| is one of the values, exact in any order."""
    return a == b or (math.isnan(a) and math.isnan(b))


# collgrad's norms: each fragment's L2 norm in fp32 (then squared and combined in fp64), against the
# fp64 norm of the same values: at most norm_of_sum_of_squares(numel) apart (tests/tolerance.py).
def _norm_bound(numel: int) -> float:
    return norm_of_sum_of_squares(numel, torch.float32)


def _worker(rank, world):
    from deepspeed.accelerator import get_accelerator

    import collgrad
    from tests.counting import count_collectives
    from tests.deepspeed import models

    # DeepSpeed's CPU accelerator refuses fp16 only because this CPU lacks oneDNN fp16; its fp16 code
    # (loss scaling, overflow checks) is the same everywhere.
    type(get_accelerator()).is_fp16_supported = lambda self: True
    out = {}
    for name, (stage, dtype, offload) in CONFIGS.items():
        cfg = models.config(stage, dtype=dtype, offload=offload)
        cfg["gradient_clipping"] = 1e9  # DeepSpeed then computes the global norm it would clip with
        eng = models.engine(cfg)
        entry = {"before_backward": attempt(lambda eng=eng: collgrad.safe_get_full_model_grad_stats(eng))}
        models.run_backward(eng, rank)
        full = collgrad.safe_get_full_model_grads(eng)
        with count_collectives() as seen:
            stats = collgrad.safe_get_full_model_grad_stats(eng)
        modules = collgrad.safe_get_full_model_grad_stats(eng, by="module")
        reference = models.reference_grads(world)
        # How far DeepSpeed's mean may be from the reference's (a reordered fp32 mean): relative in
        # norm per parameter, and absolute elementwise (bounding the difference of the maxima).
        ref_bounds = models.reference_bounds(world)
        magnitude = models.reference_magnitudes(world)
        partitioned = sum(1 for g in stats.record.groups if g.kind != "replicated" and len(g.ranks) > 1)
        params_total = sum(g.params for g in stats.record.groups if g.kind != "replicated" and len(g.ranks) > 1)
        entry.update(
            stats={n: (s.norm, s.max_abs, s.nonfinite, s.numel) for n, s in stats.params.items()},
            global_norm=stats.global_norm,
            full={n: _stat(g) for n, g in full.items()},
            reference={n: _stat(g) for n, g in reference.items()},
            ref_norm_bound=ref_bounds,
            ref_peak_bound={n: reordered_sum(world + 1, torch.float32) * float(m.max()) for n, m in magnitude.items()},
            modules={m: (s.norm, s.numel) for m, s in modules.groups.items()},
            partitioned=partitioned,
            data_calls=seen.data,
            agreements=seen.agreements,
            record_collectives=stats.record.collectives,
            record_bytes=stats.record.bytes,
            params_total=params_total,
            loss_scale=stats.record.loss_scale,
        )
        eng.step()
        norm = eng.get_global_grad_norm()  # None without ZeRO: the torch optimizer clips nothing
        entry["deepspeed_norm"] = None if norm is None else float(norm)
        entry["after_step"] = attempt(lambda eng=eng: collgrad.safe_get_full_model_grad_stats(eng))
        out[name] = entry
    # Non-finite values: put NaN and Inf into this rank's own partition, then compare with a full read.
    # Blocks: repeated layers, whose fragments statistics reduce as strided runs (one NaN lands in one);
    # reduced in blocks of 32 elements too (rows of a run in several blocks, tensors cut into spans).
    from collgrad.state import stat_blocks as stats_module

    default_block = stats_module.CPU_BLOCK_BYTES
    for name, model, block in (
        ("injected", None, default_block),
        ("injected_blocks", models.Blocks(), default_block),
        ("injected_small_blocks", models.Blocks(), 128),
    ):
        stats_module.CPU_BLOCK_BYTES = block
        eng = models.engine(models.config(2), model)
        models.run_backward(eng, rank)
        clean = collgrad.safe_get_full_model_grad_stats(eng)
        clean_full = collgrad.safe_get_full_model_grads(eng)
        buffer = eng.optimizer.averaged_gradients[0]
        buffer[0].view(-1)[0] = float("nan")
        buffer[len(buffer) // 2].view(-1)[-1] = float("nan") if rank == 1 else -1e18
        buffer[-1].view(-1)[-1] = float("inf") if rank == 0 else float("-inf")
        full = collgrad.safe_get_full_model_grads(eng)
        stats = collgrad.safe_get_full_model_grad_stats(eng)
        out[name] = {
            "clean": {n: (s.norm, s.max_abs, s.nonfinite, s.numel) for n, s in clean.params.items()},
            "clean_full": {n: _stat(g) for n, g in clean_full.items()},
            "stats": {n: (s.norm, s.max_abs, s.nonfinite, s.numel) for n, s in stats.params.items()},
            "full": {n: _stat(g) for n, g in full.items()},
            "nonfinite_total": sum(s.nonfinite for s in stats.params.values()),
        }
    stats_module.CPU_BLOCK_BYTES = default_block
    # One rank's reductions raise (after the readiness check: they overlap it): every rank raises.
    eng = models.engine(models.config(2))
    models.run_backward(eng, rank)
    from collgrad.state import stat_reduce

    reduce = stat_reduce.partials
    if rank == world - 1:

        def broken(*args):
            raise RuntimeError("injected reduction failure")

        stat_reduce.partials = broken
    out["reduction_fails"] = attempt(lambda: collgrad.safe_get_full_model_grad_stats(eng))
    stat_reduce.partials = reduce
    out["after_failure"] = attempt(lambda: collgrad.safe_get_full_model_grad_stats(eng).global_norm > 0, keep=True)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=900)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_stats_equal_those_of_plain_pytorch_and_of_the_full_gradients(results, config):
    _, per_rank = results
    dtype = CONFIGS[config][1]
    low = None if dtype == "fp32" else models.low_precision_bound(torch.float16 if dtype == "fp16" else torch.bfloat16)
    for res in per_rank:
        entry = res[config]
        for n, (norm, peak, bad, numel) in entry["stats"].items():
            f_norm, f_peak, f_bad, f_numel = entry["full"][n]
            assert _close(norm, f_norm, _norm_bound(numel)) and _same(peak, f_peak), n
            assert bad == f_bad and numel == f_numel, n
            r_norm, r_peak, r_bad, _ = entry["reference"][n]
            assert bad == r_bad == 0, n
            if low is not None:  # bf16/fp16 forward and backward against fp32 (models.low_precision_bound)
                assert _close(norm, r_norm, low) and _close(peak, r_peak, low), (n, norm, r_norm, peak, r_peak)
            else:  # | ||a|| - ||b|| | <= ||a - b||, and |max|a| - max|b|| <= max |a - b|
                assert _close(norm, r_norm, entry["ref_norm_bound"][n] + _norm_bound(numel)), (n, norm, r_norm)
                assert abs(peak - r_peak) <= entry["ref_peak_bound"][n], (n, peak, r_peak)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_identical_on_every_rank_one_collective_per_group_no_full_gradient(results, config):
    _, per_rank = results
    first = per_rank[0][config]
    for res in per_rank:
        entry = res[config]
        assert entry["stats"] == first["stats"] and entry["global_norm"] == first["global_norm"]
        assert entry["data_calls"] == entry["record_collectives"] == entry["partitioned"], entry  # as torch saw
        assert entry["agreements"] == 1  # the readiness check
        # 3 float64 per parameter per rank: nothing of the size of a gradient travels
        assert entry["record_bytes"] == 24 * entry["params_total"] + 8 * entry["partitioned"]  # and a flag
    if CONFIGS[config][0] == 0 or config == "zero1_bf16_acc32":
        assert first["partitioned"] == 0  # every rank holds full gradients: nothing sent
    if CONFIGS[config][1] == "fp16":
        assert first["loss_scale"] > 1  # statistics are of the unscaled gradient, tested above


@pytest.mark.parametrize("config", list(CONFIGS))
def test_global_norm_is_the_one_deepspeed_clips_with(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        expected = entry["deepspeed_norm"]
        if expected is None:  # stage 0: DeepSpeed computes none; the norm of the full gradients instead
            assert CONFIGS[config][0] == 0
            expected = math.sqrt(sum(norm * norm for norm, *_ in entry["full"].values()))
        # both sum the squares of the same values in fp32, in different orders (tests/tolerance.py)
        total = sum(numel for *_, numel in entry["stats"].values())
        assert _close(entry["global_norm"], expected, _norm_bound(total)), (entry["global_norm"], expected)


def test_by_module_groups_parameters_by_module_path(results):
    _, per_rank = results
    entry = per_rank[0]["zero2_fp32"]
    expected: dict[str, list[tuple[float, int]]] = {}
    for n, (norm, _, _, numel) in entry["stats"].items():
        expected.setdefault(n.rpartition(".")[0], []).append((norm, numel))
    assert set(entry["modules"]) == set(expected)
    for m, parts in expected.items():
        norm, numel = entry["modules"][m]
        # the module's norm from its parameters' in fp64: len(parts) squares summed in another order
        bound = norm_of_sum_of_squares(len(parts), torch.float64)
        assert _close(norm, math.sqrt(sum(x * x for x, _ in parts)), bound) and numel == sum(n for _, n in parts)


@pytest.mark.parametrize("model", ["injected", "injected_blocks", "injected_small_blocks"])
def test_nonfinite_values_are_counted_exactly(results, model):
    world, per_rank = results
    for res in per_rank:
        injected = res[model]
        for n, (norm, peak, bad, numel) in injected["clean"].items():  # repeated blocks, before injecting
            f_norm, f_peak, f_bad, f_numel = injected["clean_full"][n]
            assert _close(norm, f_norm, _norm_bound(numel)) and peak == f_peak and bad == f_bad == 0, n
            assert numel == f_numel, n
        # a NaN and a +-Inf per rank and a NaN on rank 1, less any that fell into the last rank's padding
        assert 2 * world <= injected["nonfinite_total"] <= 2 * world + 1
        assert injected["nonfinite_total"] == sum(bad for *_, bad, _ in injected["full"].values())
        for n, (norm, peak, bad, _numel) in injected["stats"].items():
            f_norm, f_peak, f_bad, _ = injected["full"][n]
            assert bad == f_bad and _close(norm, f_norm, _norm_bound(f_numel)) and _same(peak, f_peak), (n, bad, f_bad)


def test_misuse_raises_on_every_rank(results):
    _, per_rank = results
    for res in per_rank:
        for config in CONFIGS:
            for phase in ("before_backward", "after_step"):
                assert res[config][phase]["error"] == "NotReadyError", (config, phase, res[config][phase])


def test_a_rank_whose_reduction_fails_makes_every_rank_raise(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        failure = res["reduction_fails"]
        expected = "RuntimeError" if rank == world - 1 else "RankFailedError"
        assert failure["error"] == expected and failure["seconds"] < 10, failure
        if rank != world - 1:
            assert f"rank(s) [{world - 1}]" in failure["message"], failure["message"]
        assert res["after_failure"]["value"] is True  # the group goes on: the next call works
