"""``python -m collgrad``: its entry point as a user runs it, and the probe."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import run_cli


def test_the_module_runs_as_a_user_runs_it():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "collgrad", "--help"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "probe" in proc.stdout and "bench" in proc.stdout


def test_probe_local_prints_a_table_per_group():
    out = run_cli("probe", "--local", "3", "--group", "0,2")
    assert "group world: ranks [0, 1, 2]" in out and "group --group: ranks [0, 2]" in out
    assert out.count("cpu tensors -> backend gloo") == 2
    assert "choice all_reduce: fp32:flat" in out
    assert "mpi4py" in out and "not started by an MPI launcher" in out


def test_the_readme_names_every_bench_option_and_no_other():
    import argparse
    import pathlib
    import re

    from collgrad.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Benchmark\n", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"(--[a-z][a-z-]*)", section)) == options
