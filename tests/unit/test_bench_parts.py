"""The benchmark's pure parts, without ranks: bytes from the dtype, the method table, goals and ratios,
the printed report, the sweep's points and fit, the command line's environment, and the meters."""

from __future__ import annotations

import argparse

import pytest
import torch

from collgrad.bench import cli, memory
from collgrad.bench.config import MODEL_NAMES, BenchConfig, deepspeed_config
from collgrad.bench.methods import METHODS, Reading, Setting, floors, methods_for, versus
from collgrad.bench.models import MODELS, GPT2Model, Subject, build_model
from collgrad.bench.report import describe, format_report, ratios
from collgrad.bench.sweep import SWEEP_AXES, summarize_sweep, sweep_configs
from tests.bench_observed import DEEPSPEED_ROWS, FSDP2_ROWS


def _setting(
    source: str, dtype: torch.dtype, loop_dtype: torch.dtype, numel: int = 1000, world: int = 2, gathers: bool = False
) -> Setting:
    size = torch.empty(0, dtype=dtype).element_size()
    sizes = [numel // 10] * 9 + [numel - 9 * (numel // 10)]
    subject = Subject(
        source=source,
        engine=None,
        world=world,
        params=[torch.nn.Parameter(torch.zeros(n)) for n in sizes],
        sizes=sizes,
        loop_gathers=gathers,
        device=torch.device("cpu"),
        optimizer="x",
        deepspeed=None,
        full_grad=lambda p: p,
        full_fp32=lambda p: p,
        full_state=lambda p, key: p,
        consolidate=lambda: None,
        loop_element_size=torch.empty(0, dtype=loop_dtype).element_size(),
    )
    share = torch.ones(-(-numel // world), dtype=dtype)
    return Setting(subject, 1 << 20, max(1, size * numel // 8), {}, size, share, {}, {}, "", 1 << 20)


def _reading(name: str, setting: Setting):
    method = next(m for m in METHODS if m.name == name)
    return method.read(setting, lambda: None)


# Bytes from the dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_floors_count_bytes_in_the_dtype_they_move(dtype):
    s = _setting("deepspeed", dtype, torch.float32, numel=1001)
    size = torch.empty(0, dtype=dtype).element_size()
    assert _reading("raw_all_reduce", s).bytes == 1001 * size
    assert _reading("raw_all_gather", s).bytes == 501 * size  # this rank's share, rounded up
    assert s.grad_bytes == 1001 * size and s.small_bucket == 1001 * size // 8


@pytest.mark.parametrize("loop_dtype", [torch.float32, torch.bfloat16])
def test_the_loops_count_bytes_in_the_dtype_the_framework_returned(loop_dtype):
    size = torch.empty(0, dtype=loop_dtype).element_size()
    ds = _setting("deepspeed", torch.float32, loop_dtype, numel=1000)
    assert (_reading("deepspeed_loop", ds).bytes, _reading("deepspeed_loop", ds).collectives) == (1000 * size, 10)
    assert _reading("deepspeed_norm_loop", ds).bytes == 1000 * size
    assert _reading("deepspeed_set_loop", ds) == Reading(0, 0)
    # ZeRO-3 and FSDP2 gather each parameter's shares: a rank sends its own, ceil(elements / world)
    fsdp = _setting("fsdp2", torch.float32, loop_dtype, numel=1000, world=3, gathers=True)
    assert _reading("full_tensor_loop", fsdp).bytes == 10 * 34 * size
    assert _reading("full_tensor_norm_loop", fsdp).collectives == 10


def test_a_reading_row_has_plans_only_where_a_record_told_them():
    s = _setting("deepspeed", torch.float32, torch.float32)
    assert _reading("raw_all_reduce", s).row() == {"collectives": 1, "bytes": 4000}


# The method table


def test_each_source_runs_the_rows_it_ran_before_in_the_same_order():
    assert [m.name for m in methods_for("deepspeed")] == DEEPSPEED_ROWS
    assert [m.name for m in methods_for("fsdp2")] == FSDP2_ROWS
    assert [m.name for m in methods_for("fsdp2", ("collgrad_iter", "deepspeed_loop"))] == ["collgrad_iter"]


def test_the_table_names_each_method_once_and_every_floor_and_partner_is_in_it():
    names = [m.name for m in METHODS]
    assert len(names) == len(set(names))
    by_name = {m.name: m for m in METHODS}
    for m in METHODS:
        if m.floor is not None:
            assert set(m.sources) <= set(by_name[m.floor.method].sources), m.name
            assert by_name[m.floor.method].floor is None  # a floor is a raw collective, not compared itself
    for slow, ours in versus():
        assert set(by_name[slow].sources) <= set(by_name[ours].sources), slow


def test_floors_and_goals():
    f = floors()
    assert {k: v.method for k, v in f.items()} == {
        "collgrad_all_gather": "raw_all_gather",
        "collgrad_all_reduce": "raw_all_reduce",
        "collgrad_iter": "raw_all_reduce",
        "collgrad_load": "raw_reads",  # the same byte ranges read raw
        "collgrad_set_unchecked": "raw_write",  # the same copies after one small all-gather
    }
    assert [f["collgrad_all_gather"].goal_at(s) for s in (1, 2, 3)] == [1.10, 1.10, 1.20]  # ZeRO-3 also reorders
    assert [f["collgrad_all_reduce"].goal_at(s) for s in (1, 2, 3)] == [1.10] * 3
    assert [f["collgrad_iter"].goal_at(s) for s in (1, 2, 3)] == [1.25] * 3
    assert [f["collgrad_set_unchecked"].goal_at(s) for s in (1, 2, 3)] == [1.25] * 3
    assert versus() == [
        ("deepspeed_set_loop", "collgrad_set"),
        ("deepspeed_set_loop", "collgrad_set_unchecked"),
        ("deepspeed_set_loop", "raw_write"),
        ("deepspeed_norm_loop", "collgrad_stats"),
        ("full_tensor_norm_loop", "collgrad_stats"),
        ("deepspeed_fp32_loop", "collgrad_fp32"),
        ("full_tensor_fp32_loop", "collgrad_fp32"),
        ("deepspeed_exp_avg_loop", "collgrad_exp_avg"),
        ("full_tensor_exp_avg_loop", "collgrad_exp_avg"),
        ("deepspeed_exp_avg_sq_loop", "collgrad_exp_avg_sq"),
        ("full_tensor_exp_avg_sq_loop", "collgrad_exp_avg_sq"),
        ("deepspeed_fp32_set_loop", "collgrad_fp32_set"),
        ("deepspeed_fp32_weights_set_loop", "collgrad_fp32_set"),
        ("deepspeed_fp32_weights_set_loop", "collgrad_fp32_set_unchecked"),
        ("deepspeed_exp_avg_set_loop", "collgrad_exp_avg_set"),
        ("deepspeed_exp_avg_set_loop", "collgrad_exp_avg_set_unchecked"),
        ("deepspeed_consolidated_save", "collgrad_save"),
        ("fsdp2_state_dict_save", "collgrad_save"),
        ("transformers_zero3_load", "collgrad_load"),
        ("deepspeed_gathered_load", "collgrad_load"),
        ("fsdp2_broadcast_load", "collgrad_load"),
        ("deepspeed_getters_loop", "dropin_getters_loop"),
        ("deepspeed_checkpoint_save", "collgrad_training_save"),
        ("deepspeed_synced_save", "collgrad_training_save"),
        ("dcp_save", "collgrad_training_save"),
        ("deepspeed_checkpoint_load", "collgrad_training_load"),
        ("dcp_load", "collgrad_training_load"),
        ("deepspeed_zero_to_fp32", "collgrad_convert"),
    ]


# Ratios and the printed report


def _row(ms: float, peak: float = 1.0, **extra) -> dict:
    base = dict(median_ms=ms, min_ms=ms, max_ms=ms, call_ms=ms, page_faults=0, peak_host_mb=peak, peak_device_mb=0.0)
    return {**base, **extra}


def _report(stage: int = 2, element_size: int = 4, source: str = "deepspeed") -> dict:
    cfg = BenchConfig(stage=stage, source=source, reps=3, pairs=5)
    numel = 2**20
    methods = {
        "deepspeed_loop": _row(200.0, collectives=10, bytes=numel * 4),
        "collgrad_all_gather": _row(12.0, 8.0, collectives=1, bytes=numel * 2, plans=["all_gather"], plan_cached=True),
        "collgrad_all_reduce": _row(10.0, collectives=1, bytes=numel * 4, plans=["all_reduce"], plan_cached=False),
        "collgrad_iter": _row(11.0, collectives=1, bytes=numel * 4, plans=["all_reduce"]),
        "collgrad_update": _row(20.0, peak=element_size * numel / 8 / 2**20 * 1.5),
        "deepspeed_norm_loop": _row(100.0),
        "collgrad_stats": _row(4.0),
        "raw_all_reduce": _row(8.0),
        "raw_all_gather": _row(10.0),
    }
    report = {
        "config": {**cfg.__dict__, "methods": []},
        "world": 2,
        "backend": "gloo",
        "torch": "2.x",
        "optimizer": "Opt",
        "deepspeed": "0.x",
        "source": source,
        "params": 10,
        "numel": numel,
        "element_size": element_size,
        "result_mb": numel * element_size / 2**20,
        "methods": methods,
        "paired": {"collgrad_all_gather": {"ratio": 1.05, "min": 0.9, "max": 1.3}},
        "paired_versus": {"deepspeed_norm_loop_over_collgrad_stats": {"ratio": 30.0, "min": 20.0, "max": 40.0}},
    }
    report["ratios"] = ratios(report, cfg)
    return report


def test_ratios_prefer_the_pairs_and_fall_back_to_the_medians():
    r = _report(stage=3)["ratios"]
    gather, reduce_ = r["floors"]["collgrad_all_gather"], r["floors"]["collgrad_all_reduce"]
    assert (gather["time_ratio"], gather["spread"], gather["goal"]) == (1.05, (0.9, 1.3), 1.20)
    assert (reduce_["time_ratio"], reduce_["spread"], reduce_["goal"]) == (10.0 / 8.0, None, 1.10)
    assert gather["memory_mb"] == 8.0
    assert (r["loop"], r["collgrad_best"], r["loop_over_collgrad"]) == ("deepspeed_loop", "collgrad_all_reduce", 20.0)
    assert r["deepspeed_norm_loop_over_collgrad_stats"] == 30.0
    assert "deepspeed_set_loop_over_collgrad_set" not in r  # neither side ran


@pytest.mark.parametrize("element_size", [4, 2])
def test_update_peak_is_counted_in_buckets_of_the_gradient_bytes(element_size):
    assert _report(element_size=element_size)["ratios"]["update_peak_buckets"] == pytest.approx(1.5)


def test_the_printed_report_has_the_columns_rows_and_ratio_lines():
    text = format_report(_report(stage=3))
    lines = text.splitlines()
    assert lines[0].startswith("collgrad bench: ZeRO-3 fp32, 10 tensors / 1,048,576 elements, 2 ranks over gloo")
    assert lines[1].split() == "method median ms min max in call MB sent colls peak MB faults plan".split()
    gather = next(line for line in lines if line.startswith("collgrad_all_gather "))
    assert gather.split()[1:] == [
        "12.0",
        "12.0",
        "12.0",
        "12.0",
        "2.0",
        "1",
        "8.0",
        "0",
        "all_gather",
        "(plan",
        "from",
        "cache)",
    ]
    assert next(line for line in lines if line.startswith("collgrad_all_reduce ")).endswith("all_reduce (plan built)")
    assert next(line for line in lines if line.startswith("collgrad_iter ")).endswith("all_reduce")
    assert "  collgrad_all_gather   / raw_all_gather  time 1.05x [0.90-1.30] (goal 1.20x, ok)" in text
    assert "  collgrad_all_reduce   / raw_all_reduce  time 1.25x (goal 1.10x, over the goal)" in text
    assert "deepspeed_loop / collgrad_all_reduce = 20.0x" in lines
    assert "deepspeed_norm_loop / collgrad_stats = 30.0x [20.0-40.0], paired" in lines
    assert "update: peak extra 1.50 buckets (bucket = 1/8 of the model)" in lines


def test_describe():
    assert describe({"config": {"source": "fsdp2"}}) == "FSDP2 fully_shard fp32"
    assert describe({"config": {"source": "deepspeed", "stage": 1, "dtype": "bf16", "offload": True}}) == (
        "ZeRO-1 bf16 offload"
    )


# The sweep


def test_sweep_points_cover_every_axis_and_leave_the_loops_out_where_they_are_slow():
    points = sweep_configs(BenchConfig(reps=7, pairs=21))
    assert [axis for axis, _ in points] == ["tensors"] * 6 + ["bytes"] * 4 + ["world"] * 3 + ["bucket"] * 4
    assert all(c.reps == 3 and c.pairs == 7 for _, c in points)
    assert all("deepspeed_loop" not in c.methods for axis, c in points if axis in ("world", "bucket"))
    assert all("deepspeed_loop" in c.methods for axis, c in points if axis in ("tensors", "bytes"))


def test_sweep_fits_the_cost_per_tensor_and_counts_bytes_in_the_dtype():
    results = []
    for n in (50, 100, 200):  # collgrad costs 2 us per tensor more than its floor
        rep = _report(element_size=2)
        rep["params"] = n
        rep["methods"]["collgrad_all_gather"]["median_ms"] = 10.0 + n * 0.002
        rep["methods"]["collgrad_all_reduce"]["median_ms"] = 50.0
        results.append(("tensors", rep))
    results.append(("bytes", _report(element_size=2)))
    sweep = summarize_sweep(results)
    assert set(SWEEP_AXES) <= set(sweep)
    assert sweep["per_tensor_us"] == pytest.approx(2.0)
    assert sweep["bytes"][0]["bytes"] == 2**20 * 2
    assert sweep["tensors"][0]["ratios"]["collgrad_all_gather"] == 1.05


# The command line


def test_options_and_their_defaults():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from(parser.parse_args([])) == BenchConfig()
    args = parser.parse_args(["--stage", "3", "--source", "fsdp2", "--dtype", "bf16", "--reps", "2", "--pairs", "3"])
    assert cli.config_from(args) == BenchConfig(stage=3, source="fsdp2", dtype="bf16", reps=2, pairs=3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])
    args = parser.parse_args(["--model", "vector", "--methods", "raw_all_gather,collgrad_all_gather"])
    assert cli.config_from(args) == BenchConfig(model="vector", methods=("raw_all_gather", "collgrad_all_gather"))


def test_the_environment_is_read_and_what_local_ranks_need_is_returned():
    assert not cli.launched({}) and cli.launched({"RANK": "0", "WORLD_SIZE": "2"})
    assert cli.rank_environment({}, cuda=False) == {"DS_ACCELERATOR": "cpu"}
    assert cli.rank_environment({}, cuda=True) == {"DS_ACCELERATOR": "cuda"}
    assert cli.rank_environment({"DS_ACCELERATOR": "xpu"}, cuda=True) == {}  # the caller's choice stands


def test_deepspeed_config_follows_the_precision_and_offload():
    assert "bf16" not in deepspeed_config(BenchConfig()) and "fp16" not in deepspeed_config(BenchConfig())
    bf16 = deepspeed_config(BenchConfig(dtype="bf16", offload=True, stage=3))
    assert bf16["bf16"] == {"enabled": True} and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert bf16["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}


# The meters


def test_host_peak_sees_an_allocation_held_in_the_block():
    with memory.PeakHost() as peak:
        held = torch.ones(16 * 2**20 // 4)  # 16 MiB
    # The meter reads the whole process's allocator: another thread of it (the test runner's channel,
    # torch's) may free a few KiB during the block (36 KiB in one CI run). A meter that missed the block
    # would read about nothing; one MiB of slack for the others, no more.
    assert peak.extra >= 15 * 2**20 and held.numel()


def test_minor_faults_count_first_touches_of_fresh_memory():
    before = memory.minor_faults()
    fresh = torch.empty(64 * 2**20 // 4)  # 64 MiB: mmapped by the allocator, untouched until filled
    fresh.fill_(1.0)
    assert memory.minor_faults() > before


class _FakeDeviceModule:
    """What torch.cuda and torch.xpu offer for memory, with allocations set by the test."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.calls = 100, 100, []

    def synchronize(self, device):
        self.calls.append(("synchronize", device))

    def reset_peak_memory_stats(self, device):
        self.calls.append(("reset", device))
        self.peak = self.allocated

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_device_memory_is_the_peak_above_the_level_at_start_on_cuda_and_xpu(device_type):
    fake, device = _FakeDeviceModule(), torch.device(device_type, 1)
    meter = memory.DeviceMemory(device, module=fake)
    meter.start()
    fake.peak = 100 + 4096  # a call allocated 4 KiB at its peak
    assert meter.measured and meter.extra() == 4096
    assert ("reset", device) in fake.calls and ("synchronize", device) in fake.calls


def test_device_memory_on_the_cpu_is_not_measured():
    meter = memory.DeviceMemory(torch.device("cpu"))
    meter.start()
    assert not meter.measured and meter.extra() == 0


def test_device_memory_uses_the_device_module_of_the_device_type():
    for device_type in ("cuda", "xpu"):
        module = getattr(torch, device_type, None)
        meter = memory.DeviceMemory(torch.device(device_type, 0))
        assert meter._module is module
        assert meter.measured == (module is not None and all(hasattr(module, n) for n in memory._CALLS))


# The models measured


def test_the_default_model_is_gpt2_shaped_with_mixed_sizes_and_every_parameter_gets_a_gradient():
    cfg = BenchConfig()
    assert cfg.model == "gpt2"
    model = build_model(cfg)
    sizes = [p.numel() for p in model.parameters()]
    assert len(sizes) == cfg.tensors and 0.98 * cfg.elements < sum(sizes) <= cfg.elements
    # a few large matrices beside many biases and norms: most tensors are under 1% of the largest
    assert len(set(sizes)) >= 6 and max(sizes) >= 1000 * min(sizes)
    assert sum(n < max(sizes) // 100 for n in sizes) > len(sizes) // 2
    assert model.wte.weight.numel() == max(sizes)  # the token embedding, also the (tied) head
    model(model.example(torch.Generator().manual_seed(0))).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_models_follow_the_tensor_and_element_counts():
    for tensors, elements in ((400, 6_553_600), (4000, 6_553_600), (400, 65_536_000), (40, 100_000)):
        layers = (tensors - 4) // 12
        d = GPT2Model.solve_width(layers, elements)
        numel = layers * (12 * d * d + 13 * d) + 36 * d * d + 2 * d
        assert numel == GPT2Model.numel(layers, d) <= elements < GPT2Model.numel(layers, d + 1), (tensors, elements)
    vector = build_model(BenchConfig(model="vector", tensors=10, elements=1000))
    assert [p.numel() for p in vector.parameters()] == [100] * 10
    assert MODELS.keys() == set(MODEL_NAMES)
