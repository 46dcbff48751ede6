"""``Dispatcher.run(..., done=)``: each output is handed over as soon as its last bucket has finished
(while later buckets may still be in flight), complete, exactly once; 2 and 3 ranks over Gloo."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks


def _worker(rank, world):
    import torch.distributed as dist

    from collgrad.core.dispatch import Dispatcher
    from collgrad.core.ops import Op

    group = dist.group.WORLD
    sizes = [1000, 10, 3000, 700, 5000]  # buckets of 4 KiB gathered: several per tensor, some shared
    inputs = [torch.arange(n, dtype=torch.float32) + 10_000 * rank + 100_000 * i for i, n in enumerate(sizes)]
    outputs = [torch.full((world * n,), float("nan")) for n in sizes]
    expected = [
        torch.cat([torch.arange(n, dtype=torch.float32) + 10_000 * r + 100_000 * i for r in range(world)])
        for i, n in enumerate(sizes)
    ]
    dispatcher = Dispatcher()
    prepared = dispatcher.prepare(Op.ALL_GATHER, inputs, group, bucket_bytes=4096)
    seen = []

    def done(i):
        seen.append((i, torch.equal(outputs[i], expected[i])))

    record = dispatcher.run(prepared, inputs, outputs, group, atomic=False, done=done)
    return {
        "seen": seen,
        "buckets": len(record.buckets),
        "all": all(torch.equal(o, e) for o, e in zip(outputs, expected)),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_each_output_is_handed_over_once_complete(world):
    for res in run_ranks(_worker, world):
        assert sorted(i for i, _ in res["seen"]) == [0, 1, 2, 3, 4]  # each once
        assert all(complete for _, complete in res["seen"]), res["seen"]  # complete when handed over
        assert [i for i, _ in res["seen"]] == sorted(i for i, _ in res["seen"])  # in bucket order
        assert res["buckets"] > 5 and res["all"]
