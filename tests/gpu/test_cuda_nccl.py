"""CUDA/NCCL leg (tox -e cuda-nccl): skipped, with the reason, where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gpu import accelerator_cases
from tests.harness import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL"),
]


def test_nccl_and_gloo_in_one_group_match_per_tensor_collectives():
    world = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    results = run_ranks(accelerator_cases.worker, world, "cuda", backend="cpu:gloo,cuda:nccl")
    assert results == [[]] * world
