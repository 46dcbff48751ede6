"""safe_get_full_model_fp32_params / safe_get_full_model_optimizer_states (and their streams) on real
DeepSpeed engines after two Adam steps, 2 and 3 CPU ranks: bitwise equal to DeepSpeed's own
per-parameter accessors, every plan alike, one collective per bucket, and misuse raising on every rank.

One spawn per world size builds every configuration in turn; the tests read its results.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import run_ranks

# name: (stage, dtype, offload, extra zero options)
CONFIGS = {
    "zero1_fp32": (1, "fp32", False, {}),
    "zero2_fp32": (2, "fp32", False, {}),
    "zero3_fp32": (3, "fp32", False, {}),
    "zero1_bf16_acc32": (1, "bf16_acc32", False, {}),  # BF16_Optimizer: DeepSpeed's accessor
    "zero2_bf16_acc32": (2, "bf16_acc32", False, {}),
    "zero3_bf16_acc32": (3, "bf16_acc32", False, {}),
    "zero2_bf16": (2, "bf16", False, {}),
    "zero2_offload": (2, "fp32", True, {}),
    "zero3_offload": (3, "fp32", True, {}),
    "zero1_round_robin": (1, "fp32", False, {"round_robin_gradients": True}),
    "zero2_round_robin": (2, "fp32", False, {"round_robin_gradients": True}),
    "zero0_fp32": (0, "fp32", False, {}),
}
#: DeepSpeed's accessors fail with round_robin_gradients (docs/notes): compared there with the
#: partitions gathered by a plain all-gather and cut where DeepSpeed's own ``round_robin_bit16_offsets``
#: say each parameter lies.
ROUND_ROBIN = {"zero1_round_robin", "zero2_round_robin"}
KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def _read(collgrad, eng, key, **kwargs):
    if key == "fp32":
        return collgrad.safe_get_full_model_fp32_params(eng, **kwargs)
    return collgrad.safe_get_full_model_optimizer_states(eng, key, **kwargs)


def _stream(collgrad, eng, key, **kwargs):
    if key == "fp32":
        return collgrad.iter_full_model_fp32_params(eng, **kwargs)
    return collgrad.iter_full_model_optimizer_states(eng, key, **kwargs)


def _deepspeed(eng, key, trainable):
    """DeepSpeed's accessor per parameter; at stage 0 (where it returns None) the module's weights and
    the torch optimizer's own state."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if eng.zero_optimization_stage() == 0:
        return {n: p.detach().clone() if key == "fp32" else eng.optimizer.state[p][key].clone() for n, p in trainable}
    if key == "fp32":
        return {n: safe_get_full_fp32_param(p) for n, p in trainable}
    return {n: safe_get_full_optimizer_state(p, key) for n, p in trainable}


def _rebuilt(eng, key, trainable):
    """ZeRO-1/2: every rank's partition of the fp32 weights (or of state ``key``) by one plain all-gather,
    each parameter cut where DeepSpeed's flat buffer bookkeeping puts it."""
    import torch.distributed as dist

    opt, names, out = eng.optimizer, {id(p): n for n, p in trainable}, {}
    for i, master in enumerate(opt.single_partition_of_fp32_groups):
        local = master if key == "fp32" else opt.optimizer.state[master][key]
        group = opt.real_dp_process_group[i]
        whole = torch.empty(local.numel() * dist.get_world_size(group), dtype=local.dtype)
        dist.all_gather_into_tensor(whole, local.detach().clone(), group=group)
        for p, offset in zip(opt.round_robin_bit16_groups[i], opt.round_robin_bit16_offsets[i]):
            if id(p) in names:
                out[names[id(p)]] = whole[offset : offset + p.numel()].view(p.shape)
    return out


def _worker(rank, world):
    import collgrad
    from collgrad import Policy
    from tests.counting import count_collectives
    from tests.deepspeed import models

    out = {}
    for name, (stage, dtype, offload, extra) in CONFIGS.items():
        cfg = models.config(stage, dtype=dtype, offload=offload, **extra)
        cfg["gradient_clipping"] = 0.0
        eng = models.engine(cfg)
        for _ in range(2):
            models.run_backward(eng, rank)
            eng.step()
        trainable = [(n, p) for n, p in eng.module.named_parameters() if p.requires_grad]
        entry = {"optimizer": type(eng.optimizer).__name__, "names": [n for n, _ in trainable]}
        for key in KEYS:
            ds = _rebuilt(eng, key, trainable) if name in ROUND_ROBIN else _deepspeed(eng, key, trainable)
            calls = {
                "auto": _read(collgrad, eng, key),
                "all_gather": _read(collgrad, eng, key, plan="all_gather"),
                "all_reduce": _read(collgrad, eng, key, plan="all_reduce"),
                "per_tensor": _read(collgrad, eng, key, policy=Policy(force="per_tensor")),
                "iter": dict(_stream(collgrad, eng, key, bucket_bytes=256)),
            }
            auto = calls["auto"]
            with count_collectives() as seen:
                again = _read(collgrad, eng, key)
            entry[key] = {
                "plans_agree": all(torch.equal(calls[k][n], auto[n]) for k in calls for n in auto),
                "keys": {k: list(v) for k, v in calls.items()},
                "plan": sorted({g.plan for g in auto.record.groups}),
                "observed": (seen.data, again.record.buckets),
                "dtype_device": {n: (str(t.dtype), str(t.device), tuple(t.shape)) for n, t in auto.items()},
            }
            entry[key]["ds_equal"] = {n: torch.equal(auto[n], ds[n]) for n in ds}
            entry[key]["ds_dtype_device"] = {n: (str(t.dtype), str(t.device), tuple(t.shape)) for n, t in ds.items()}
        out[name] = entry
        if name == "zero2_fp32":
            out["misuse"] = _misuse(collgrad, eng, rank)
    return out


def _misuse(collgrad, eng, rank):
    """Each misuse on every rank: the error's type and message, or "returned"."""
    from tests.harness import attempt

    return {
        "not_per_element": attempt(lambda: collgrad.safe_get_full_model_optimizer_states(eng, "step")),
        "unknown_key": attempt(lambda: collgrad.safe_get_full_model_optimizer_states(eng, "momentum_buffer")),
        "bad_key": attempt(lambda: collgrad.safe_get_full_model_optimizer_states(eng, 3)),
        # rank 0 asks for another state than the others: nothing moves, every rank raises
        "different_keys": attempt(
            lambda: collgrad.safe_get_full_model_optimizer_states(eng, "exp_avg" if rank else "exp_avg_sq")
        ),
        "after": attempt(lambda: len(collgrad.safe_get_full_model_fp32_params(eng)), keep=True),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=600)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bitwise_equal_to_deepspeed_accessor(results, config, key):
    """Round robin: equal to DeepSpeed's own partitions rebuilt by its own offsets (``_rebuilt``)."""
    _, per_rank = results
    for res in per_rank:
        entry = res[config][key]
        assert len(entry["ds_equal"]) == len(res[config]["names"])
        assert all(entry["ds_equal"].values()), {n: ok for n, ok in entry["ds_equal"].items() if not ok}
        assert entry["dtype_device"] == entry["ds_dtype_device"]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_plan_and_the_stream_agree_in_parameter_order(results, config, key):
    _, per_rank = results
    for res in per_rank:
        entry = res[config][key]
        assert entry["plans_agree"]
        names = res[config]["names"]
        assert all(keys == names or sorted(keys) == sorted(names) for keys in entry["keys"].values())
        assert entry["keys"]["auto"] == names  # dict order: named_parameters()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_collective_per_bucket(results, config):
    _, per_rank = results
    for res in per_rank:
        for key in KEYS:
            entry = res[config][key]
            data, buckets = entry["observed"]
            if entry["plan"] == ["accessor"]:  # BF16_Optimizer: DeepSpeed's own, one per parameter
                assert res[config]["optimizer"] == "BF16_Optimizer"
                assert data == len(res[config]["names"])
            elif entry["plan"] == ["local"]:  # stage 0: every rank holds it whole
                assert data == 0
            else:
                assert data == buckets < len(res[config]["names"]), (config, key, data, buckets)


def test_misuse_raises_on_every_rank(results):
    _, per_rank = results
    for res in per_rank:
        misuse = res["misuse"]
        for case in ("not_per_element", "unknown_key", "bad_key"):
            assert misuse[case]["error"] == "InvalidArgumentError", (case, misuse[case])
        assert "exp_avg" in misuse["not_per_element"]["message"] and "'step'" in misuse["not_per_element"]["message"]
        assert "no such key" in misuse["unknown_key"]["message"]
        assert misuse["different_keys"]["error"] == "ArgumentMismatchError", misuse["different_keys"]
        assert all(misuse[case]["seconds"] < 10 for case in misuse)
        assert misuse["after"]["value"] == len(res["zero2_fp32"]["names"])
