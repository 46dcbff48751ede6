"""CUDA leg (tox -e cuda-nccl): two ranks, one GPU each over NCCL (beside Gloo for CPU tensors), or
two ranks sharing one GPU over Gloo; skipped, saying why, otherwise."""

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


def test_cuda_tensors_on_two_ranks_match_per_tensor_collectives():
    found = accelerator_cases.layout("cuda", "nccl")
    if isinstance(found, str):
        pytest.skip(found)
    world, backend = found
    results = run_ranks(accelerator_cases.worker, world, "cuda", backend=backend)
    assert results == [[]] * world


def _nccl_alone(rank, world):
    import collgrad
    from tests.counting import count_collectives

    torch.cuda.set_device(0)
    tensors = [torch.full((1000 + i,), 1.0 + rank, device="cuda") for i in range(8)]
    with count_collectives() as seen:  # what torch received, not what the record says
        record = collgrad.all_reduce_coalesced(tensors)
    return [b.backend for b in record.buckets], seen.data, all(bool((t == 1.0).all()) for t in tensors)


def test_nccl_at_world_size_one_runs_one_collective_per_bucket():
    ((backends, sent, equal),) = run_ranks(_nccl_alone, 1, backend="nccl")
    assert backends == ["nccl"] and sent == 1 and equal
