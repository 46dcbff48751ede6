"""XPU/XCCL leg (tox -e xpu-xccl): skipped, with the reason, where there is no XPU device."""

from __future__ import annotations

import pytest

from collgrad import _compat
from tests.gpu import accelerator_cases
from tests.harness import run_ranks

_xccl = _compat.xccl_available()
pytestmark = [
    pytest.mark.xpu,
    pytest.mark.skipif(not _compat.xpu_available(), reason="no XPU device on this machine"),
    pytest.mark.skipif(not _xccl, reason="this torch build has no XCCL (XPU wheels have it from 2.8)"),
]


def test_xccl_and_gloo_in_one_group_match_per_tensor_collectives():
    found = accelerator_cases.layout("xpu", "xccl")
    if isinstance(found, str):
        pytest.skip(found)
    world, backend = found
    results = run_ranks(accelerator_cases.worker, world, "xpu", backend=backend)
    assert results == [[]] * world
