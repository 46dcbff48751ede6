"""The largest ZeRO-3 read two local ranks hold here: a GPT-2-shaped model of ``--elements``, one
backward, then (each between barriers, with the peak of the bytes this rank's C allocator has handed
out above what it held before, sampled every 2 ms) ``safe_get_full_model_grads``, ``iter_full_model_grads`` consumed,
and DeepSpeed's ``safe_get_full_grad`` loop keeping every result, as a user's loop does.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python docs/notes/big_read.py --elements 350000000

Figures from it are in the README (Benchmark, scale).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from collgrad.launch import run_local


def _measured(fn: Callable[[], Any]) -> tuple[float, float]:
    """Seconds of ``fn`` on every rank (between barriers) and this rank's peak GiB in use above the
    start while it ran (the result freed after)."""
    import torch.distributed as dist

    from collgrad.bench.memory import host_bytes_in_use

    in_use = host_bytes_in_use()
    base, peak, running = in_use(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], in_use() - base)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    dist.barrier()
    sampler.start()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    running[0] = False
    sampler.join()
    del result
    return seconds, peak[0] / 2**30


def _rank(rank: int, world: int, elements: int, loop: bool) -> dict[str, Any]:
    import collgrad
    from collgrad.bench.config import BenchConfig
    from collgrad.bench.models import build_subject

    subject = build_subject(BenchConfig(stage=3, elements=elements))
    engine = subject.engine
    from collgrad.bench.memory import host_bytes_in_use

    held = host_bytes_in_use()() / 2**30
    out: dict[str, Any] = {"params": len(subject.params), "numel": subject.numel, "held_gib": held}
    out["safe_get_full_model_grads"] = [_measured(lambda: collgrad.safe_get_full_model_grads(engine)) for _ in range(3)]
    out["iter_full_model_grads"] = [
        _measured(lambda: deque(collgrad.iter_full_model_grads(engine), maxlen=0)) for _ in range(3)
    ]
    if loop:
        out["deepspeed_loop"] = [_measured(lambda: [subject.full_grad(p) for p in subject.params])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=350_000_000)
    parser.add_argument("--no-loop", action="store_true", help="leave DeepSpeed's loop out")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for rank, row in enumerate(run_local(_rank, 2, args.elements, not args.no_loop, timeout=3600)):
        print(f"rank {rank}: {row}")


if __name__ == "__main__":
    main()
