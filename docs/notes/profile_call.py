"""Inside two local ranks, a collgrad call against its floor on the bench's own engine: per call, the
wall time and main-thread CPU time of each (medians over ABBA pairs), and optionally the wall time of
named stages (``module:function`` or ``module:Class.method``, wrapped with ``perf_counter``).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python docs/notes/profile_call.py --stage 2 --plan all_gather \\
        --stages collgrad.state.read:OpenCall,collgrad.core.dispatch:Dispatcher.run

Figures from it are in docs/notes/perf-profile.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from typing import Any

from collgrad.launch import run_local


def _wrap(target: str, spent: dict[str, float]) -> None:
    module_name, name = target.rsplit(":", 1)
    owner: Any = importlib.import_module(module_name)
    if "." in name:
        cls, name = name.split(".")
        owner = getattr(owner, cls)
    real = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[target] = spent.get(target, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    import torch.distributed as dist

    from collgrad.bench.config import BenchConfig
    from collgrad.bench.methods import METHODS, make_setting
    from collgrad.bench.models import build_subject

    cfg = BenchConfig(stage=args.stage, source=args.source, model=args.model)
    setting = make_setting(build_subject(cfg), cfg)
    by_name = {m.name: m for m in METHODS}
    ours = by_name[f"collgrad_{args.plan}"].bind(setting)
    floor = by_name["raw_all_gather" if args.plan == "all_gather" else "raw_all_reduce"].bind(setting)
    spent: dict[str, float] = {}
    for target in filter(None, args.stages.split(",")):
        _wrap(target, spent)
    for _ in range(3):
        ours(), floor()
    rows: dict[str, list[float]] = {}
    for i in range(args.pairs):
        order = [("ours", ours), ("floor", floor)]
        for name, fn in order[:: -1 if i % 2 else 1]:
            spent.clear()
            dist.barrier()
            cpu, wall = time.thread_time(), time.perf_counter()
            result = fn()
            rows.setdefault(f"{name} ms", []).append((time.perf_counter() - wall) * 1e3)
            rows.setdefault(f"{name} cpu ms", []).append((time.thread_time() - cpu) * 1e3)
            if name == "ours":
                for target, s in spent.items():
                    rows.setdefault(target, []).append(s * 1e3)
            dist.barrier()
            del result
    out = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    out["ratio"] = round(statistics.median(a / b for a, b in zip(rows["ours ms"], rows["floor ms"])), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--source", default="deepspeed")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--plan", default="all_gather", choices=("all_gather", "all_reduce"))
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--stages", default="", help="module:function[,...] to time inside the call")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for rank, row in enumerate(run_local(_rank, 2, args, timeout=1800)):
        print(f"rank {rank}: {row}")


if __name__ == "__main__":
    main()
