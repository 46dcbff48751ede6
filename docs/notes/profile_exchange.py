"""Inside two local Gloo ranks, what the readiness check's all-gather of a few int64 costs: through
``dist.all_gather`` against the process group's own ``allgather`` (what ``_compat.all_gather_list`` calls),
the launch alone and the launch plus the wait; and whether local work run while it is in flight
(``agreement.exchange(meanwhile=...)``) hides any of it: a busy loop and a 12 MB copy, each alone, in
flight and after the exchange. Medians of 300 calls, each after a barrier.

    OMP_NUM_THREADS=1 python docs/notes/profile_exchange.py

Figures from it are in docs/benchmarks.md (the writes, fourth pass).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from collgrad.launch import run_local


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rank(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    from collgrad import _compat
    from collgrad.backends import agreement

    group = dist.group.WORLD
    assert group is not None
    row = torch.arange(12, dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(world)]
    src, dst = torch.randn(3_000_000), torch.empty(3_000_000)
    found: dict[str, str] = {}

    def timed(name: str, fn: Callable[[], Any], launched: bool = False) -> None:
        launch, total = [], []
        for _ in range(300):
            dist.barrier()
            start = time.perf_counter()
            work = fn()
            launch.append(time.perf_counter() - start)
            if launched:
                work.wait()
            total.append(time.perf_counter() - start)
        shown = f"{statistics.median(total) * 1e6:.0f} us"
        if launched:
            shown = f"launch {statistics.median(launch) * 1e6:.0f} us, with the wait {shown}"
        found[name] = shown

    def exchange(meanwhile: Callable[[], None] | None = None) -> None:
        agreement.exchange(group, list(range(12)), timeout_s=60, what="profile", meanwhile=meanwhile)

    timed("dist.all_gather", lambda: dist.all_gather(rows, row, group=group, async_op=True), launched=True)
    timed("the group's allgather", lambda: _compat.all_gather_list(rows, row, group), launched=True)
    timed("agreement.exchange", exchange)
    timed("spin 400 us", lambda: _spin(400e-6))
    timed("exchange, spin 400 us in flight", lambda: exchange(lambda: _spin(400e-6)))
    timed("exchange, then spin 400 us", lambda: (exchange(), _spin(400e-6)))
    timed("copy 12 MB", lambda: dst.copy_(src))
    timed("exchange, the copy in flight", lambda: exchange(lambda: dst.copy_(src)))
    timed("exchange, then the copy", lambda: (exchange(), dst.copy_(src)))
    return f"rank {rank}:\n" + "\n".join(f"  {name}: {value}" for name, value in found.items())


def main() -> None:
    for lines in run_local(_rank, 2):
        print(lines)


if __name__ == "__main__":
    main()
