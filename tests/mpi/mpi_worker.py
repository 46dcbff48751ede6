"""Run by tests/mpi/test_mpi.py under ``mpiexec -n N``: joins a Gloo group from the MPI launcher's
environment, runs collgrad through mpi4py and checks it against per-tensor Gloo collectives.

Writes ``rank<N>.json`` into $COLLGRAD_TEST_OUT and exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import collgrad  # noqa: E402
from collgrad import Policy  # noqa: E402
from collgrad.launch import init_from_environment  # noqa: E402
from tests.ranks import cases  # noqa: E402


def check_reduce(case, rank, group=None, policy=None, bucket_bytes=None):
    ref = cases.reduce_reference(cases.make(case, rank), group=group)
    tensors = cases.make(case, rank)
    record = collgrad.all_reduce_coalesced(tensors, group=group, policy=policy, bucket_bytes=bucket_bytes)
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(tensors, ref)),
        "buckets": [[str(b.dtype), b.primitive, str(b.wire_dtype), b.collectives] for b in record.buckets],
        "decisions": [[str(d.dtype), d.primitive, d.why] for d in record.decisions],
    }


def check_gather(case, rank, world, policy=None):
    inputs = cases.make(case, rank)
    ref = cases.gather_reference(inputs, world)
    outputs = [torch.empty(world * t.numel(), dtype=t.dtype) for t in inputs]
    record = collgrad.all_gather_coalesced(outputs, inputs, policy=policy)
    return {
        "equal": all(torch.equal(o, r) for o, r in zip(outputs, ref)),
        "buckets": [[str(b.dtype), b.primitive, str(b.wire_dtype), b.collectives] for b in record.buckets],
    }


def main() -> int:
    torch.set_num_threads(1)
    init_from_environment(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        "fp32": check_reduce("fp32", rank),
        "mixed": check_reduce("mixed", rank),
        "large": check_reduce("large", rank, bucket_bytes=cases.LARGE_BUCKET_BYTES),
        "noncontiguous": check_reduce("noncontiguous", rank),
        "gloo_forbidden": check_reduce("mixed", rank, policy=Policy(forbid="gloo")),
        "gather": check_gather("mixed", rank, world),
    }
    if world >= 3:
        sub = dist.new_group([0, 2])
        if rank in (0, 2):
            results["subgroup"] = check_reduce("mixed", rank, group=sub)
    with open(os.path.join(os.environ["COLLGRAD_TEST_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "results": results}, f)
    dist.destroy_process_group()
    return 0 if all(r["equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
