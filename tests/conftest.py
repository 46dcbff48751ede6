"""The order files start in when pytest-xdist runs the suite in several processes (tox.ini: a file per
process at a time, ``--no-loadscope-reorder``): the longest first, so that no process is left running
one of them alone while the others have finished. Under a single process the order does not matter."""

from __future__ import annotations

import pathlib
import sys

import pytest

# The examples import as modules (tests.harness.run_example): on the path before any rank server starts,
# since each process's server takes its path from this process's at its start (collgrad.launch).
EXAMPLES = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
if EXAMPLES not in sys.path:
    sys.path.append(EXAMPLES)

#: The files that take longest (each tens of seconds on two cores: they run the examples and the
#: benchmark, or wait out bounded waits), longest first; the others follow as collected.
LONGEST = (
    "tests/hf/test_example.py",
    "tests/deepspeed/test_bench.py",
    "tests/fsdp/test_bench_fsdp2.py",
    "tests/ranks/test_bounded_waits.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST)))  # stable: the rest in order
