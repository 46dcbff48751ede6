"""``python -m collgrad bench`` runs end to end (a small model, few repetitions). The benchmark's
figures are measurements, reported in the README and issue notes, never asserted here."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import json
import os
import pathlib
import subprocess
import sys


def test_bench_runs_and_reports_every_method(tmp_path):
    out = tmp_path / "bench.json"
    root = pathlib.Path(__file__).resolve().parents[2]  # this source tree, as pytest's own imports
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(root))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "collgrad",
            "bench",
            "--tensors",
            "24",
            "--elements",
            "24000",
            "--reps",
            "2",
            "--pairs",
            "3",
            "--stage",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        timeout=300,
        env=env,
    )
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()  # bytes: "\r" kept as it is
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {
        "deepspeed_loop",
        "collgrad_all_gather",
        "collgrad_all_reduce",
        "collgrad_per_tensor",
        "collgrad_no_copy",
        "collgrad_iter",
        "raw_all_reduce",
        "raw_all_gather",
        "deepspeed_set_loop",
        "collgrad_set",
        "collgrad_set_unchecked",
        "collgrad_update",
        "deepspeed_norm_loop",
        "collgrad_stats",
    }
    assert report["params"] == 24 and report["world"] == 2
    assert all(row["page_faults"] >= 0 for row in report["methods"].values()) and "faults" in stdout
    assert all(row["call_ms"] > 0 for row in report["methods"].values()) and "in call" in stdout
    assert report["methods"]["collgrad_all_gather"]["collectives"] == 1
    assert report["methods"]["collgrad_per_tensor"]["collectives"] == 24
    assert report["methods"]["collgrad_all_gather"]["plan_cached"] is True
    assert report["methods"]["collgrad_set"]["collectives"] == 0  # each rank writes what it owns
    assert report["methods"]["collgrad_stats"]["collectives"] == 1  # one small all-gather (one ZeRO-3 group)
    assert report["methods"]["collgrad_stats"]["bytes"] == 24 * 24 + 8  # 3 float64 per parameter, a flag
    assert "to the floor" in stdout and "streaming:" in stdout
    floors = report["ratios"]["floors"]
    assert set(floors) == {"collgrad_all_gather", "collgrad_all_reduce", "collgrad_iter"}
    assert floors["collgrad_all_gather"]["floor"] == "raw_all_gather" and floors["collgrad_all_gather"]["goal"] == 1.2
    assert "collgrad_all_gather   / raw_all_gather  time" in stdout
    assert "deepspeed_norm_loop / collgrad_stats" in stdout and "update: peak extra" in stdout
    assert "\r[bench] deepspeed_loop: 1/2\r[bench] deepspeed_loop: 2/2\n" in stderr  # one line per method
