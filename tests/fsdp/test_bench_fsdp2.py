"""``python -m collgrad bench --source fsdp2`` runs end to end (a small model, few repetitions): the
per-parameter ``full_tensor()`` loop against collgrad on the same fully_shard model. Figures are
measurements (README, issue notes), never asserted here."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_fsdp2_runs_and_reports_every_method(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    args = ["--source", "fsdp2", "--tensors", "24", "--elements", "24000", "--reps", "2", "--pairs", "3"]
    args += ["--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "collgrad", "bench", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    methods = report["methods"]
    assert {"full_tensor_loop", "full_tensor_norm_loop", "collgrad_all_gather", "collgrad_stats"} <= set(methods)
    assert not any(name.startswith("deepspeed") for name in methods)
    assert methods["full_tensor_loop"]["collectives"] == 24 and methods["collgrad_all_gather"]["collectives"] == 1
    assert methods["collgrad_set"]["collectives"] == 0 and methods["collgrad_stats"]["collectives"] == 1
    assert report["source"] == "fsdp2" and report["ratios"]["loop"] == "full_tensor_loop"
    assert "FSDP2 fully_shard" in proc.stdout and "full_tensor_loop / collgrad" in proc.stdout
