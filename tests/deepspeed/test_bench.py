"""``python -m collgrad bench`` on DeepSpeed: it runs end to end and prints every row (a small model, few
repetitions), and what each row says a method sent is what torch received. The benchmark's figures are
measurements, reported in the README and issue notes, never asserted here."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import json
import math

import torch

from collgrad.bench.config import BenchConfig
from collgrad.bench.report import NOT_COUNTED
from collgrad.bench.timing import Clock
from collgrad.launch import run_local
from tests.bench_observed import DEEPSPEED_ROWS, deepspeed_rows, observe
from tests.harness import run_cli

ROWS = DEEPSPEED_ROWS
COLUMNS = {"median_ms", "min_ms", "max_ms", "call_ms", "page_faults", "peak_host_mb", "peak_device_mb"}


def test_bench_runs_and_reports_every_method(tmp_path):
    out = tmp_path / "bench.json"
    # the default model (GPT-2-shaped): two blocks of 12 tensors, embeddings and a final norm
    args = ["--tensors", "28", "--elements", "30000", "--reps", "1", "--pairs", "1", "--warmup", "0", "--stage", "3"]
    stdout = run_cli("bench", *args, "--json", str(out))
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ROWS
    assert report["config"]["model"] == "gpt2" and report["params"] == 28
    assert report["world"] == 2 and report["element_size"] == 4
    for name, row in report["methods"].items():
        counted = set() if name in NOT_COUNTED else {"collectives", "bytes"}  # a framework's own: not counted
        assert COLUMNS | counted <= set(row), name
        assert all(math.isfinite(row[c]) for c in COLUMNS) and row["call_ms"] > 0, name
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method "))
    assert "in call" in lines[header] and "faults" in lines[header]
    assert [line.split()[0] for line in lines[header + 1 : header + 1 + len(ROWS)]] == ROWS
    floors = report["ratios"]["floors"]
    assert set(floors) == {
        "collgrad_all_gather",
        "collgrad_all_reduce",
        "collgrad_iter",
        "collgrad_load",
        "collgrad_set_unchecked",
    }
    assert floors["collgrad_set_unchecked"]["floor"] == "raw_write" and floors["collgrad_set_unchecked"]["goal"] == 1.25
    assert floors["collgrad_load"]["floor"] == "raw_reads" and floors["collgrad_load"]["goal"] == 1.5
    assert floors["collgrad_all_gather"]["floor"] == "raw_all_gather" and floors["collgrad_all_gather"]["goal"] == 1.2
    assert "to the floor" in stdout and "streaming:" in stdout
    assert "collgrad_all_gather   / raw_all_gather  time" in stdout
    assert "deepspeed_norm_loop / collgrad_stats" in stdout and "update: peak extra" in stdout
    assert "deepspeed_fp32_loop / collgrad_fp32" in stdout and "deepspeed_consolidated_save / collgrad_save" in stdout
    assert "save: rank 0's peak" in stdout
    # the load against Transformers' ZeRO-3 loader and the GatheredParameters loop, bytes read per rank
    assert "transformers_zero3_load / collgrad_load" in stdout and "deepspeed_gathered_load / collgrad_load" in stdout
    assert "load: MB read per rank [" in stdout
    # the writes against DeepSpeed's setter loops, and against the loop that also changes the weights
    assert "deepspeed_fp32_weights_set_loop / collgrad_fp32_set" in stdout
    assert "deepspeed_exp_avg_set_loop / collgrad_exp_avg_set" in stdout
    assert "deepspeed_set_loop / raw_write" in stdout  # the most a write that agrees first can gain


def test_each_row_reports_what_torch_received():
    # A rank's share (ZeRO-3's loop and plans) is half the whole. Parameters of an even size: DeepSpeed's
    # ZeRO-3 setter fails on sizes that do not divide (0.19.8, stage3.py set_fp32_grad_for_param; padding
    # is observed in the FSDP2 test). ZeRO-1 bf16 with fp32 accumulation is BF16_Optimizer: every rank
    # holds every gradient, nothing to send.
    configs = [
        BenchConfig(stage=stage, dtype=dtype, model="vector", tensors=24, elements=24 * 330)
        for stage, dtype in ((2, "fp32"), (3, "fp32"), (1, "bf16"))
    ]
    configs.append(BenchConfig(stage=1, tensors=28, elements=30000))  # the default model: mixed sizes
    by_config = run_local(observe, 2, configs, env={"DS_ACCELERATOR": "cpu"}, timeout=600)[0]
    assert "deepspeed stage 1 fp32 gpt2" in by_config
    for config, rows in by_config.items():
        assert list(rows) == deepspeed_rows(int(config.split()[2])), config
        for name, row in rows.items():
            if row["reported"] == (None, None):  # the frameworks' consolidation: not counted, said so
                assert name in NOT_COUNTED, (config, name)
                continue
            assert row["reported"] == row["seen"], (config, name)
            if row["plan_cached"] is not None:
                assert row["plan_cached"] == (row["planned"] == 0), (config, name)
    for config in ("deepspeed stage 2 fp32 vector", "deepspeed stage 3 fp32 vector"):
        seen = {name: row["seen"] for name, row in by_config[config].items()}
        assert seen["collgrad_all_gather"][0] == 1 and seen["collgrad_per_tensor"][0] == 24
        assert seen["deepspeed_loop"][0] == 24 and seen["collgrad_set"] == (0, 0)
        assert seen["collgrad_stats"] == (1, 24 * 24 + 8)  # 3 float64 per parameter, a flag
    bf16 = by_config["deepspeed stage 1 bf16 vector"]
    # its fp32 master weights and states are partitioned, in a layout collgrad reads through DeepSpeed's
    # accessor: one all-reduce per parameter; everything else is held whole
    through_accessor = {"collgrad_fp32", "collgrad_exp_avg", "collgrad_exp_avg_sq"}
    assert all(bf16[name]["seen"][0] == 24 for name in through_accessor)
    # a training state's save streams those three kinds to rank 0 the same way (its load writes each rank's
    # part through DeepSpeed's local setters: nothing sent)
    assert bf16["collgrad_training_save"]["seen"][0] == 3 * 24
    assert all(
        row["seen"] == (0, 0)
        for name, row in bf16.items()
        if "collgrad" in name and name not in {*through_accessor, "collgrad_training_save"}
    )


def test_progress_is_one_line_per_method_rewritten_in_place(capsys):
    clock = Clock(torch.device("cpu"), progress=True)
    for rep in range(2):
        clock._show("deepspeed_loop", rep, 2)
    assert capsys.readouterr().err == "\r[bench] deepspeed_loop: 1/2\r[bench] deepspeed_loop: 2/2\n"
