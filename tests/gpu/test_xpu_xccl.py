"""XPU/XCCL leg (tox -e xpu-xccl): skipped, with the reason, where there is no XPU device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gpu import accelerator_cases
from tests.harness import run_ranks

_xccl = getattr(dist, "is_xccl_available", lambda: False)()
pytestmark = [
    pytest.mark.xpu,
    pytest.mark.skipif(not (hasattr(torch, "xpu") and torch.xpu.is_available()), reason="no XPU device on this machine"),
    pytest.mark.skipif(not _xccl, reason="this torch build has no XCCL (XPU wheels have it from 2.8)"),
]


def test_xccl_and_gloo_in_one_group_match_per_tensor_collectives():
    world = min(2, torch.xpu.device_count())
    results = run_ranks(accelerator_cases.worker, world, "xpu", backend="cpu:gloo,xpu:xccl")
    assert results == [[]] * world
