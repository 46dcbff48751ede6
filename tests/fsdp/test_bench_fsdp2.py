"""``python -m collgrad bench --source fsdp2``: it runs end to end (a small model, few repetitions), the
per-parameter ``full_tensor()`` loop against collgrad on the same fully_shard model, and what each row
says a method sent is what torch received. Figures are measurements (README, issue notes), never
asserted here."""

from __future__ import annotations

import json

from collgrad.bench.config import BenchConfig
from collgrad.bench.report import NOT_COUNTED
from collgrad.launch import run_local
from tests.bench_observed import FSDP2_ROWS, observe
from tests.harness import run_cli

ROWS = FSDP2_ROWS


def test_bench_fsdp2_runs_and_reports_every_method(tmp_path):
    out = tmp_path / "bench.json"
    # the default model (GPT-2-shaped): two blocks of 12 tensors, embeddings and a final norm
    args = ["--source", "fsdp2", "--tensors", "28", "--elements", "30000"]
    args += ["--reps", "1", "--pairs", "1", "--warmup", "0"]  # every row, not its figures
    stdout = run_cli("bench", *args, "--json", str(out))
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ROWS
    assert report["source"] == "fsdp2" and report["ratios"]["loop"] == "full_tensor_loop"
    assert "FSDP2 fully_shard" in stdout and "full_tensor_loop / collgrad" in stdout
    assert "full_tensor_norm_loop / collgrad_stats" in stdout


def test_each_row_reports_what_torch_received():
    # Parameters of 331 elements: fully_shard pads each shard to 166, so a rank's share of the
    # per-parameter all-gather is not half the model. full_tensor() issues functional collectives,
    # which only the dispatcher sees (tests.bench_observed).
    cfg = BenchConfig(source="fsdp2", model="vector", tensors=24, elements=24 * 331)
    rows = run_local(observe, 2, [cfg], timeout=600)[0]["fsdp2 stage 2 fp32 vector"]
    assert list(rows) == ROWS
    for name, row in rows.items():
        if row["reported"] == (None, None):  # the frameworks' consolidation: not counted, said so
            assert name in NOT_COUNTED, name
            continue
        assert row["reported"] == row["seen"], name
        if row["plan_cached"] is not None:
            assert row["plan_cached"] == (row["planned"] == 0), name
    assert rows["full_tensor_loop"]["seen"] == (24, 24 * 166 * 4)
    assert rows["collgrad_all_gather"]["seen"][0] == 1 and rows["collgrad_set"]["seen"] == (0, 0)
    assert rows["collgrad_stats"]["seen"] == (1, 24 * 24 + 8)  # 3 float64 per parameter, a flag
