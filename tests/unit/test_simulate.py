"""``python -m collgrad simulate --json``: one JSON object a line, a line per job, the fields of
``Figures`` in their order; no ranks. That its I/O figures are what real FSDP2 ranks do:
tests/fsdp/test_simulate.py."""

from __future__ import annotations

import contextlib
import io
import json

from collgrad.bench.simulate import JOBS
from collgrad.cli import main

FIELDS = [
    "job",
    "framework",
    "world",
    "tensors",
    "rank",
    "plan_ms",
    "peak_mb",
    "io_calls",
    "bytes_read",
    "bytes_written",
    "bytes_sent",
    "files",
]


def test_simulate_json_prints_a_line_per_job_with_every_figure():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(
            ["simulate", "--framework", "zero3", "--world", "4096", "--layers", "3", "--hidden", "64", "--json"]
        )
    assert status == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [row["job"] for row in rows] == list(JOBS) and len(JOBS) == 6
    for row in rows:
        assert list(row) == FIELDS, row
        assert (row["framework"], row["world"], row["tensors"], row["rank"]) == ("zero3", 4096, 24, 0), row
        assert all(isinstance(row[name], int) and row[name] >= 0 for name in FIELDS[7:]), row
        assert all(isinstance(row[name], float) and row[name] >= 0 for name in ("plan_ms", "peak_mb")), row
