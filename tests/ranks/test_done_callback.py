"""``Dispatcher.run(..., done=)``: each output is handed over as soon as its last bucket has finished
(while later buckets may still be in flight), complete, exactly once; ``meanwhile=``: runs once, after
the first bucket is issued and before anything is waited for; if it raises, every bucket still
completes (on every rank) before its error is raised. 2 and 3 ranks over Gloo."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks


def _worker(rank, world):
    import torch.distributed as dist

    from collgrad.backends.ops import Op
    from collgrad.core.dispatch import Dispatcher

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


def _meanwhile_worker(rank, world):
    import torch.distributed as dist

    from collgrad.backends.ops import Op
    from collgrad.core.dispatch import Dispatcher

    group = dist.group.WORLD
    sizes = [1000, 3000, 5000]
    inputs = [torch.arange(n, dtype=torch.float32) + 10_000 * rank for n in sizes]
    dispatcher = Dispatcher()
    prepared = dispatcher.prepare(Op.ALL_GATHER, inputs, group, bucket_bytes=4096)
    events = []

    def run(meanwhile):
        outputs = [torch.full((world * n,), float("nan")) for n in sizes]
        record = dispatcher.run(
            prepared,
            inputs,
            outputs,
            group,
            atomic=False,
            done=lambda i: events.append(("done", i)),
            meanwhile=meanwhile,
        )
        return outputs, record

    def note():
        events.append(("meanwhile", None))

    outputs, record = run(note)
    order = list(events)
    events.clear()

    def fail():  # only rank 1 fails: the others must not be left waiting in a bucket
        if rank == 1:
            raise RuntimeError("meanwhile failed")

    try:
        failed, _ = run(fail)
        raised = None
    except RuntimeError as exc:
        failed, raised = None, str(exc)
    # the group is still usable afterwards: every rank finished every bucket of that run
    after, _ = run(None)
    expected = [torch.cat([torch.arange(n, dtype=torch.float32) + 10_000 * r for r in range(world)]) for n in sizes]
    return {
        "order": order,
        "buckets": len(record.buckets),
        "ok": all(torch.equal(o, e) for o, e in zip(outputs, expected)),
        "raised": raised,
        "others_ok": failed is not None and all(torch.equal(o, e) for o, e in zip(failed, expected)),
        "after_ok": all(torch.equal(o, e) for o, e in zip(after, expected)),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_meanwhile_runs_once_before_any_wait_and_fails_without_leaving_a_collective(world):
    for rank, res in enumerate(run_ranks(_meanwhile_worker, world)):
        assert res["buckets"] > 2 and res["ok"]
        assert res["order"][0] == ("meanwhile", None)  # before the first bucket was waited for
        assert res["order"].count(("meanwhile", None)) == 1
        assert sorted(i for kind, i in res["order"] if kind == "done") == [0, 1, 2]
        if rank == 1:
            assert res["raised"] == "meanwhile failed"
        else:
            assert res["raised"] is None and res["others_ok"]
        assert res["after_ok"]
