"""The README's Trainer example runs as written and writes its chart."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'collgrad[hf]')")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'collgrad[plot]')")

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_trainer_grad_norms_example_writes_its_chart(tmp_path):
    png = tmp_path / "norms.png"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trainer_grad_norms.py"), "--steps", "3", "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("global norm" in line for line in steps)
    assert png.stat().st_size > 10_000
