"""Inside two local ranks, ``load_full_model`` of the bench model against its floor (the same byte ranges
read raw, one ``os.preadv`` each into one reused buffer): medians of 25 alternating pairs, then rank 0's
cProfile of 20 loads (the C calls' own times: the reads, the agreements' waits, the copy into the fp32
masters).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python docs/notes/profile_load.py --stage 3
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python docs/notes/profile_load.py --source fsdp2

Figures from it are in docs/benchmarks.md ("Loading a checkpoint into the engine").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

from collgrad.launch import run_local


def _rank(rank: int, world: int, stage: int, source: str) -> tuple[float, float, str | None]:
    import torch
    import torch.distributed as dist

    import collgrad
    from collgrad.bench.config import BenchConfig
    from collgrad.bench.frameworks import read_plan
    from collgrad.bench.models import build_subject
    from collgrad.checkpoint.storage import Reader as RangeReader

    engine = build_subject(BenchConfig(stage=stage, source=source)).engine
    where = [os.path.join(tempfile.gettempdir(), f"collgrad-profile-load-{os.getpid()}")]
    dist.broadcast_object_list(where, src=0)
    path = where[0]
    collgrad.save_full_model(engine, path)
    runs = read_plan(engine, path)
    buffer = torch.empty(max(r.nbytes for r in runs), dtype=torch.uint8)

    def raw() -> None:
        with RangeReader() as reader:
            for r in runs:
                reader.read_at(r.file, r.offset, memoryview(buffer.numpy())[: r.nbytes])

    ours, floor = [], []
    for _ in range(25):
        for fn, into in ((lambda: collgrad.load_full_model(engine, path), ours), (raw, floor)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            into.append(time.perf_counter() - start)
    profile = cProfile.Profile() if rank == 0 else None
    if profile is not None:
        profile.enable()
    for _ in range(20):
        collgrad.load_full_model(engine, path)
    text = None
    if profile is not None:
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
        text = out.getvalue()
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    return statistics.median(ours) * 1e3, statistics.median(floor) * 1e3, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--source", choices=("deepspeed", "fsdp2"), default="deepspeed")
    args = parser.parse_args()
    found: list[Any] = run_local(_rank, 2, args.stage, args.source, env={"DS_ACCELERATOR": "cpu"})
    for rank, (ours, floor, _) in enumerate(found):
        print(f"rank {rank}: load_full_model {ours:.1f} ms, raw reads of the same ranges {floor:.1f} ms")
    print(found[0][2])


if __name__ == "__main__":
    main()
