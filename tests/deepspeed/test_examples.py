"""The README's runnable example runs as written."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

from tests.harness import run_example


def test_edit_and_watch_example_runs():
    lines = [line for line in run_example("edit_and_watch").splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("global norm" in line for line in lines)


def test_dropin_and_collectives_example_runs():
    out = run_example("dropin_and_collectives")
    assert "DeepSpeed's loop through the drop-in equal to safe_get_full_model_grads: True" in out
    assert "fp32 master weights halved: True" in out
    assert "all-reduced [1.0, 1.0, 1.0]; all-gathered [0, 0, 0, 1, 1, 1]" in out
