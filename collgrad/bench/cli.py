"""``python -m collgrad bench``'s options and entry point: spawn local ranks or join a launcher's, run the
main configuration (and the sweep's points), print rank 0's report, write ``--json`` and ``--png``.

The environment is read, never written: local ranks get ``DS_ACCELERATOR`` (when the caller has not set
it) through ``run_local(..., env=...)``; ranks started by a launcher keep what the launcher gave them,
and DeepSpeed picks its accelerator from that (``DS_ACCELERATOR``, else its own detection).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping

import torch
import torch.distributed as dist

from collgrad.backends import mpi as mpi_launcher  # launcher facts only: mpi4py is imported lazily there
from collgrad.bench.config import DTYPES, MODEL_NAMES, SOURCES, BenchConfig
from collgrad.bench.methods import METHODS
from collgrad.bench.report import describe, format_report
from collgrad.bench.run import run_bench
from collgrad.bench.sweep import plot_sweep, summarize_sweep, sweep_configs
from collgrad.launch import init_from_environment, run_local

__all__ = ["add_arguments", "main", "config_from", "launched", "rank_environment"]

Results = list[tuple[str, Any]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options, added to ``parser`` (``python -m collgrad bench``'s subparser)."""
    d = BenchConfig()
    parser.add_argument(
        "--local",
        type=int,
        default=None,
        metavar="N",
        help="spawn N ranks over Gloo here (default 2 without a launcher)",
    )
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=d.stage)
    parser.add_argument(
        "--source",
        choices=SOURCES,
        default=d.source,
        help="fsdp2: the model sharded with fully_shard, against per-parameter full_tensor()",
    )
    parser.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="bf16: with fp32 gradient accumulation")
    parser.add_argument("--offload", action="store_true", help="CPU optimizer offload")
    parser.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default=d.model,
        help="gpt2: GPT-2-shaped, mixed tensor sizes (default); vector: equal tensors",
    )
    parser.add_argument("--tensors", type=int, default=d.tensors)
    parser.add_argument("--elements", type=int, default=d.elements)
    parser.add_argument(
        "--scale", type=float, default=d.scale, metavar="K", help="the model K times --elements (the same tensors)"
    )
    parser.add_argument("--shard-mb", type=float, default=d.shard_mb, help="save_full_model's shard size")
    parser.add_argument("--bucket-mb", type=float, default=d.bucket_mb)
    parser.add_argument("--reps", type=int, default=d.reps)
    parser.add_argument("--pairs", type=int, default=d.pairs, help="pairs timed against each plan's floor")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed calls of each method before its reps")
    parser.add_argument(
        "--methods",
        default="",
        metavar="A,B",
        help=f"only these methods, comma-separated (default all): {', '.join(m.name for m in METHODS)}",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--sweep", action="store_true", help="also sweep tensors and bytes (slow)")
    parser.add_argument("--png", metavar="PATH", help="with --sweep: write a chart (pip install 'collgrad[plot]')")


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The main run's configuration from the parsed options. Pure."""
    given = {name: getattr(args, name) for name in _GIVEN}
    return BenchConfig(**given, methods=tuple(m for m in args.methods.split(",") if m))


#: The options that are the configuration's fields as they are (``--methods`` is split).
_GIVEN: tuple[str, ...] = tuple(
    "stage source dtype offload model tensors elements scale shard_mb bucket_mb reps pairs warmup".split()
)


def launched(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a launcher's (torchrun, the deepspeed launcher, an MPI launcher). Reads only."""
    return "RANK" in env or mpi_launcher.rank_and_size(env) is not None


def rank_environment(env: Mapping[str, str], cuda: bool) -> dict[str, str]:
    """What local ranks need on top of ``env``: DeepSpeed's accelerator, where ``env`` does not name one
    (CUDA where there is a CUDA device, else the CPU). Pure."""
    return {} if "DS_ACCELERATOR" in env else {"DS_ACCELERATOR": "cuda" if cuda else "cpu"}


def _bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any] | None:
    """One configuration on a rank (``run_local``'s target, or called in a launched rank)."""
    report = run_bench(cfg, progress=not cfg.methods)
    return report if rank == 0 else None


def _run_local(configs: list[tuple[str, BenchConfig]], ranks: int) -> Results:
    """Fresh local ranks per point: no engine left over from the last."""
    env = rank_environment(os.environ, torch.cuda.is_available())
    results: Results = []
    for i, (axis, c) in enumerate(configs):
        if i:
            print(f"[bench] sweep point {i}/{len(configs) - 1}: {axis}", file=sys.stderr, flush=True)
        results.append((axis, run_local(_bench_rank, c.world or ranks, c, timeout=3600, env=env)[0]))
    return results


def _run_launched(configs: list[tuple[str, BenchConfig]]) -> Results:
    """Every point on the launcher's ranks (the world axis left out: the launcher fixed it)."""
    configs = [(axis, c) for axis, c in configs if axis != "world"]
    created = init_from_environment()
    try:
        return [(axis, _bench_rank(dist.get_rank(), dist.get_world_size(), c)) for axis, c in configs]
    finally:
        if created:
            dist.destroy_process_group()


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png and "sweep" in report:
        cfg = report["config"]
        title = (
            f"{describe(report)}, {report['optimizer']}, {report['backend']}, "
            f"torch {report['torch']}, deepspeed {report['deepspeed']}, {os.cpu_count()} CPUs, "
            f"medians of {max(3, cfg['reps'] // 2)}"
        )
        plot_sweep(report["sweep"], args.png, title)
        print(f"chart written to {args.png}")


def main(args: argparse.Namespace) -> int:
    """``python -m collgrad bench``: call in the launching process (local runs) or on every launched rank
    (rank 0 prints). Returns the exit status."""
    cfg = config_from(args)
    configs = [("main", cfg)] + (sweep_configs(cfg) if args.sweep else [])
    if args.local or not launched(os.environ):
        results = _run_local(configs, args.local or 2)
    else:
        results = _run_launched(configs)
        if results[0][1] is None:  # not rank 0
            return 0
    report = results[0][1]
    if args.sweep:
        report["sweep"] = summarize_sweep(results[1:])
        report["per_tensor_us"] = report["sweep"]["per_tensor_us"]
    _write(report, args)
    return 0
