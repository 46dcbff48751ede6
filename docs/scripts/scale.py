"""The scale table of docs/benchmarks.md ("Thousands of ranks"): ``python -m collgrad simulate`` over a grid
of simulated worlds and model sizes, one process, no ranks; a markdown table on standard output.

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/scripts/scale.py [--worlds 8,1024,4096] [--layers 50,5000]
"""

from __future__ import annotations

import argparse

from collgrad.bench.simulate import FRAMEWORKS, JOBS, Simulated, simulate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="8,1024,4096")
    parser.add_argument("--layers", default="50,5000", help="layers of 8 tensors (50: 400 tensors)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    head = "framework | tensors | world | job | plan ms | peak MB | io calls | MB read | MB written | MB sent | files"
    print(f"| {head} |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for framework in args.frameworks.split(","):
        for layers in map(int, args.layers.split(",")):
            for world in map(int, args.worlds.split(",")):
                for r in simulate(Simulated(framework, world, 0, layers, args.hidden), JOBS, args.reps):
                    print(
                        f"| {framework} | {r.tensors:,} | {world:,} | {r.job} | {r.plan_ms:,.0f} | {r.peak_mb:,.1f} | "
                        f"{r.io_calls:,} | {r.bytes_read / 1e6:,.1f} | {r.bytes_written / 1e6:,.1f} | "
                        f"{r.bytes_sent / 1e6:,.1f} | {r.files} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
