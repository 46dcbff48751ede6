"""safe_get_full_model_grads / iter_full_model_grads on real DeepSpeed engines, 2 and 3 CPU ranks.

One spawn per world size builds every engine configuration in turn; tests read its results. Each
configuration is compared bitwise with DeepSpeed's own per-parameter accessor and, within a
tolerance, with plain PyTorch gradients of the same data averaged as DeepSpeed averages them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import pytest
import torch

from tests.deepspeed import models
from tests.harness import run_ranks

# name: (stage, dtype, offload, gas, extra zero options)
CONFIGS = {
    "zero1_fp32": (1, "fp32", False, 1, {}),
    "zero2_fp32": (2, "fp32", False, 1, {}),
    "zero3_fp32": (3, "fp32", False, 1, {}),
    "zero1_bf16_acc32": (1, "bf16_acc32", False, 1, {}),  # BF16_Optimizer
    "zero2_bf16_acc32": (2, "bf16_acc32", False, 1, {}),
    "zero3_bf16_acc32": (3, "bf16_acc32", False, 1, {}),
    "zero2_bf16": (2, "bf16", False, 1, {}),
    "zero2_offload": (2, "fp32", True, 1, {}),
    "zero3_offload": (3, "fp32", True, 1, {}),
    "zero2_gas3": (2, "fp32", False, 3, {}),
    "zero3_gas3": (3, "fp32", False, 3, {}),
    "zero2_no_contiguous_gradients": (2, "fp32", False, 1, {"contiguous_gradients": False}),
    "zero1_round_robin": (1, "fp32", False, 1, {"round_robin_gradients": True}),
    "zero2_round_robin": (2, "fp32", False, 1, {"round_robin_gradients": True}),
    "zero2_bf16_acc32_round_robin": (2, "bf16_acc32", False, 1, {"round_robin_gradients": True}),
    "zero0_fp32": (0, "fp32", False, 1, {}),
}
ROUND_ROBIN = {k for k in CONFIGS if "round_robin" in k}  # DeepSpeed's accessor fails there
LOW_PRECISION = {k for k, v in CONFIGS.items() if v[1] != "fp32"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worker(rank, world):
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from collgrad import Policy
    from tests.counting import count_collectives, count_planning
    from tests.deepspeed import models

    out = {}
    for name, (stage, dtype, offload, gas, extra) in CONFIGS.items():
        eng = models.engine(models.config(stage, dtype=dtype, offload=offload, gas=gas, **extra))
        models.run_backward(eng, rank, gas)
        trainable = [(n, p) for n, p in eng.module.named_parameters() if p.requires_grad]
        ds = None if name in ROUND_ROBIN else {n: safe_get_full_grad(p) for n, p in trainable}
        reference = models.reference_grads(world, gas)
        bounds = models.reference_bounds(world, gas)
        calls = {
            "auto": collgrad.safe_get_full_model_grads(eng),
            "all_gather": collgrad.safe_get_full_model_grads(eng, plan="all_gather"),
            "all_reduce": collgrad.safe_get_full_model_grads(eng, plan="all_reduce"),
            "per_tensor": collgrad.safe_get_full_model_grads(eng, policy=Policy(force="per_tensor")),
            # what NCCL/XCCL choose: ZeRO-3 gathers per parameter straight into parameter-major outputs
            "coalesced": collgrad.safe_get_full_model_grads(eng, plan="all_gather", policy=Policy(force="coalesced")),
            # a flat gather and collgrad's reorder copy, where Gloo would otherwise lay ZeRO-3's out itself
            "flat": collgrad.safe_get_full_model_grads(eng, plan="all_gather", policy=Policy(force="flat")),
        }
        stream = collgrad.iter_full_model_grads(eng, bucket_bytes=256)
        calls["iter"] = dict(stream)
        # Another bucket size on the same engine: other batches, from the same cached layout
        calls["iter_512"] = dict(collgrad.iter_full_model_grads(eng, bucket_bytes=512))
        subset = [n for n, _ in trainable][1::2]
        calls["subset"] = collgrad.safe_get_full_model_grads(eng, params=subset)
        ds_after = None if ds is None else {n: safe_get_full_grad(p) for n, p in trainable}
        auto = calls["auto"]
        # copy=False: the optimizer's own tensors where a rank holds gradients whole, fresh ones elsewhere
        views = collgrad.safe_get_full_model_grads(eng, copy=False)
        streamed_views = dict(collgrad.iter_full_model_grads(eng, bucket_bytes=256, copy=False))
        held = {p.grad.untyped_storage().data_ptr() for _, p in trainable if p.grad is not None}
        held |= {t.untyped_storage().data_ptr() for t in getattr(eng.optimizer, "fp32_groups_gradients_flat", [])}
        # Each plan once more (planned and laid out already), observed from outside: the collectives torch
        # receives for the data, against the buckets the record reports.
        observed = {}
        for k, kwargs in (
            ("auto", {}),
            ("all_gather", {"plan": "all_gather"}),
            ("all_reduce", {"plan": "all_reduce"}),
            ("per_tensor", {"policy": Policy(force="per_tensor")}),
        ):
            with count_collectives() as seen:
                repeat = collgrad.safe_get_full_model_grads(eng, **kwargs)
            observed[k] = (seen.data, repeat.record.buckets)
        with count_collectives() as seen:
            streamed = collgrad.iter_full_model_grads(eng, bucket_bytes=256)
            for _ in streamed:
                pass
        observed["iter"] = (seen.data, streamed.record().buckets)
        # The same call again, observed from outside: what torch receives, and whether anything is planned.
        with count_collectives() as seen, count_planning() as planned:
            again = collgrad.safe_get_full_model_grads(eng)
        second = {
            "calls": dict(seen),
            "agreements": seen.agreements,
            "total": seen.total,
            "planned": dict(planned),
            "buckets": again.record.buckets,
            "plan_cached": again.record.plan_cached,
            "local": all(g.plan == "local" for g in again.record.groups),
            "equal": all(torch.equal(again[n], auto[n]) for n in auto),
        }
        entry = {
            "optimizer": type(eng.optimizer).__name__,
            "keys": {k: list(v) for k, v in calls.items()},
            "names": [n for n, _ in trainable],
            "subset": subset,
            "ref_rel": max(_rel(auto[n].float(), reference[n]) for n in reference),
            # distance to plain PyTorch over the bound of a reordered fp32 mean (models.reference_bounds)
            "ref_ratio": max(_rel(auto[n].float(), reference[n]) / bounds[n] for n in reference),
            "plans_agree": all(
                torch.equal(calls[k][n], auto[n])
                for k in (
                    "all_gather",
                    "all_reduce",
                    "per_tensor",
                    "iter",
                    "coalesced",
                    "flat",
                    "iter_512",
                )
                for n in auto
            ),
            "gather_primitives": {
                k: sorted({str(bk.primitive) for g in calls[k].record.groups for c in g.calls for bk in c.buckets})
                for k in ("all_gather", "flat")
            },
            "coalesced_primitives": sorted(
                {str(bk.primitive) for g in calls["coalesced"].record.groups for c in g.calls for bk in c.buckets}
            ),
            "subset_equal": all(torch.equal(calls["subset"][n], auto[n]) for n in subset),
            "views_equal": all(
                torch.equal(views[n], auto[n]) and torch.equal(streamed_views[n], auto[n]) for n in auto
            ),
            "views_alias": sorted({views[n].untyped_storage().data_ptr() in held for n in views}),
            "copies_alias": sorted({auto[n].untyped_storage().data_ptr() in held for n in auto}),
            "dtype_device": {n: (str(t.dtype), str(t.device), tuple(t.shape)) for n, t in auto.items()},
            "records": {
                k: (
                    calls[k].record.collectives,
                    calls[k].record.buckets,
                    [(g.plan, g.collectives, sum(len(c.buckets) for c in g.calls)) for g in calls[k].record.groups],
                )
                for k in ("auto", "all_gather", "all_reduce", "per_tensor")
            },
            "observed": observed,
            "cached": [calls[k].record.layout_cached for k in ("auto", "all_gather", "all_reduce", "subset")],
            "plans_cached": [calls[k].record.plan_cached for k in ("auto", "all_gather", "all_reduce", "subset")],
            "second_call": second,
        }
        if ds is not None:
            entry["ds_equal"] = {n: torch.equal(auto[n], ds[n]) for n in ds}
            entry["ds_dtype_device"] = {n: (str(t.dtype), str(t.device), tuple(t.shape)) for n, t in ds.items()}
            entry["ds_unchanged"] = all(torch.equal(ds[n], ds_after[n]) for n in ds)
        out[name] = entry
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=600)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c not in ROUND_ROBIN])
def test_bitwise_equal_to_deepspeed_accessor(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        assert all(entry["ds_equal"].values()), {n: ok for n, ok in entry["ds_equal"].items() if not ok}
        assert entry["dtype_device"] == entry["ds_dtype_device"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_close_to_plain_pytorch(results, config):
    _, per_rank = results
    for res in per_rank:
        if config in LOW_PRECISION:
            # bf16 forward/backward against an fp32 reference (models.low_precision_bound)
            bound = models.low_precision_bound(torch.bfloat16)
            assert res[config]["ref_rel"] < bound, (res[config]["ref_rel"], bound)
        else:  # fp32: the same local gradients, averaged in another order (models.reference_bounds)
            assert res[config]["ref_ratio"] <= 1, (res[config]["ref_ratio"], res[config]["ref_rel"])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_plan_and_the_stream_give_the_same_gradients(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        assert entry["plans_agree"]
        assert entry["keys"]["auto"] == entry["names"]  # named_parameters() order, tied weight once
        assert sorted(entry["keys"]["iter"]) == sorted(entry["keys"]["iter_512"]) == sorted(entry["names"])
        assert entry["subset_equal"] and entry["keys"]["subset"] == entry["subset"]
        if CONFIGS[config][0] == 3:  # gathered per parameter into parameter-major outputs, forced over Gloo
            assert entry["coalesced_primitives"] == ["coalesced"], entry["coalesced_primitives"]


def test_frozen_and_tied_parameters(results):
    _, per_rank = results
    names = per_rank[0]["zero2_fp32"]["names"]
    assert not any(n.startswith("frozen.") for n in names)
    assert "tied_in.weight" in names and "tied_out.weight" not in names


@pytest.mark.parametrize("config", [c for c, v in CONFIGS.items() if v[0] in (1, 2, 3) and c != "zero1_bf16_acc32"])
def test_one_collective_per_bucket_not_per_parameter(results, config):
    _, per_rank = results
    entry = per_rank[0][config]
    for plan in ("auto", "all_gather", "all_reduce"):
        sent, buckets = entry["observed"][plan]  # what torch received for the data, what the record says
        assert sent == buckets, (plan, entry["observed"][plan])
        assert 0 < sent < len(entry["names"]) / 2, (plan, entry["observed"][plan])


def test_per_tensor_fallback_forced_through_the_registry(results):
    _, per_rank = results
    for config in ("zero2_fp32", "zero3_fp32"):
        _, _, groups = per_rank[0][config]["records"]["per_tensor"]
        assert [g[0] for g in groups] == ["all_reduce"]  # no bucket primitive: zero-padded, per parameter
        sent, _ = per_rank[0][config]["observed"]["per_tensor"]
        assert sent == len(per_rank[0][config]["names"])  # one per parameter, observed; results: plans_agree


def test_plans_taken(results):
    world, per_rank = results
    entry = per_rank[0]
    assert [g[0] for g in entry["zero2_fp32"]["records"]["auto"][2]] == ["all_gather"]
    assert [g[0] for g in entry["zero3_fp32"]["records"]["auto"][2]] == ["all_gather"]
    assert [g[0] for g in entry["zero2_fp32"]["records"]["all_reduce"][2]] == ["all_reduce"]
    # BF16_Optimizer and stage 0: every rank already holds the full averaged gradient
    assert entry["zero1_bf16_acc32"]["optimizer"] == "BF16_Optimizer"
    assert entry["zero1_bf16_acc32"]["observed"]["auto"] == (0, 0)  # nothing sent for the data, observed
    assert entry["zero0_fp32"]["observed"]["auto"] == (0, 0)


def test_layout_and_plans_are_reused_from_the_second_call(results):
    _, per_rank = results
    for config, entry in per_rank[0].items():
        # first call builds; later calls with the same params reuse; a new params= selection builds anew
        assert entry["cached"] == [False, True, True, False], config
        # plans: each new plan= (or selection) is planned once, a repeated call plans nothing
        assert entry["plans_cached"] == [False, False, False, False], config
        assert entry["second_call"]["plan_cached"], config


def test_a_second_call_plans_nothing_and_sends_only_the_readiness_check_and_the_buckets(results):
    _, per_rank = results
    for config, entry in per_rank[0].items():
        second = entry["second_call"]
        assert second["equal"], config
        assert second["planned"] == {}, (config, second)  # neither the gradient plan nor a bucket plan
        assert second["agreements"] == 1, (config, second)  # the readiness/fingerprint exchange, nothing more
        # every other collective torch received is one bucket's (none at all for a local plan)
        assert second["total"] == 1 + second["buckets"], (config, second)
        if second["local"]:
            assert second["total"] == 1, (config, second)


def test_streaming_uses_several_buckets(results):
    _, per_rank = results
    sent, buckets = per_rank[0]["zero2_fp32"]["observed"]["iter"]
    assert sent > 3 and sent == buckets, (sent, buckets)


def test_deepspeed_accessor_unchanged_after_the_call(results):
    _, per_rank = results
    for res in per_rank:
        for config, entry in res.items():
            if "ds_unchanged" in entry:
                assert entry["ds_unchanged"], config


def test_round_robin_matches_the_layout_without_it(results):
    _, per_rank = results
    for res in per_rank:
        assert res["zero2_round_robin"]["ref_ratio"] <= 1  # see test_close_to_plain_pytorch
        assert res["zero1_round_robin"]["ref_ratio"] <= 1


def test_copy_false_hands_out_the_optimizers_own_tensors_only_where_a_rank_holds_them_whole(results):
    for entry in results[1]:
        for config, e in entry.items():
            assert e["views_equal"], config
            assert e["copies_alias"] == [False], config  # the default: never the optimizer's memory
            whole = config in ("zero0_fp32", "zero1_bf16_acc32")  # stage 0, BF16_Optimizer
            assert e["views_alias"] == [whole], config


@pytest.mark.parametrize("config", [c for c, v in CONFIGS.items() if v[0] == 3])
def test_zero3_gathers_of_a_mix_of_sizes_are_flat_and_laid_out_by_collgrad(results, config):
    # A mix of sizes is many runs of equal slices: Gloo's own layout would concatenate them first, so the
    # gather is flat and collgrad lays it out (forcing flat: the same). Same values either way.
    for entry in results[1]:
        e = entry[config]
        assert e["plans_agree"]
        assert e["gather_primitives"]["all_gather"] == ["flat"], e["gather_primitives"]
        assert e["gather_primitives"]["flat"] == ["flat"], e["gather_primitives"]


def _equal_layers(rank, world):
    from deepspeed.utils import safe_get_full_grad
    from torch import nn

    import collgrad
    from tests.deepspeed import models

    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(6)))  # one run of equal slices
        eng = models.engine(models.config(stage), model)
        x = torch.rand(4, 16, generator=torch.Generator().manual_seed(rank))
        eng.backward(eng(x).pow(2).mean())
        got = collgrad.safe_get_full_model_grads(eng)
        primitives = {str(b.primitive) for g in got.record.groups for c in g.calls for b in c.buckets}
        equal = all(torch.equal(got[n], safe_get_full_grad(p)) for n, p in eng.module.named_parameters())
        out[stage] = (sorted(primitives), equal, got.record.collectives)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_equal_layers_are_laid_out_by_gloo_itself(world):
    # ZeRO-3: one run of equal slices, one coalesced gather whose strided output Gloo lays out parameter-
    # major in the copy it makes anyway. ZeRO-1/2: every rank's partition as it lies, one collective.
    for res in run_ranks(_equal_layers, world, timeout=300):
        assert res[3] == (["coalesced"], True, 1), res
        assert res[2] == (["flat"], True, 1), res


def _large_slices(rank, world):
    from deepspeed.utils import safe_get_full_grad
    from torch import nn

    import collgrad
    from collgrad.state.steps import DIRECT_SLICE_BYTES
    from tests.deepspeed import models

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 1100), nn.LayerNorm(1100), nn.Linear(1100, 8))
    big = model[0].weight.numel()
    assert -(-big // world) * 4 >= DIRECT_SLICE_BYTES  # its slices go alone, straight into place
    eng = models.engine(models.config(3), model)
    x = torch.rand(4, 2048, generator=torch.Generator().manual_seed(rank))
    eng.backward(eng(x).pow(2).mean())
    got = collgrad.safe_get_full_model_grads(eng, bucket_bytes=64 << 20)  # one step
    primitives = {str(b.primitive) for g in got.record.groups for c in g.calls for b in c.buckets}
    equal = all(torch.equal(got[n], safe_get_full_grad(p)) for n, p in eng.module.named_parameters())
    return sorted(primitives), equal, got.record.collectives


@pytest.mark.parametrize("world", [2, 3])
def test_large_slices_are_gathered_alone_straight_into_place(world):
    # ZeRO-3: the 2048 x 1100 weight's slices in a gather of their own, into the result as they arrive;
    # the five small tensors concatenated into one more gather, laid out by a copy each.
    for res in run_ranks(_large_slices, world, timeout=300):
        assert res == (["flat"], True, 2), res
