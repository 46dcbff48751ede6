"""What a ZeRO-1/2 ``load_training_state`` reads per rank against its share, from ``python -m collgrad
simulate``'s plans (docs/benchmarks.md, "Thousands of ranks"): the bytes read, less the headers, over
3 x 4 bytes x parameters / world (its 1/world of the fp32 masters and of Adam's two states).

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/scripts/shares.py [--worlds 2,12,16,1024,4096] [--layers 50,500]
"""

from __future__ import annotations

import argparse
import math

from collgrad.bench.simulate import Simulated, _stored, simulate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="2,12,16,1024,4096")
    parser.add_argument("--layers", default="50,500")
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    for framework in ("zero1", "zero2"):
        for world in map(int, args.worlds.split(",")):
            for layers in map(int, args.layers.split(",")):
                sim = Simulated(framework, world, 0, layers, args.hidden)
                figures = simulate(sim, ["load_training_state"], reps=1)[0]
                _, header = _stored(sim.saved_training_state)
                share = 3 * 4 * sum(math.prod(s) for _, s in sim.tensors) / world
                print(
                    f"{framework} world {world:5d} tensors {figures.tensors:6d}: read {figures.bytes_read:,} = "
                    f"{(figures.bytes_read - header) / share:.3f} x share + {header:,} header bytes",
                    flush=True,
                )


if __name__ == "__main__":
    main()
