"""docs/benchmarks.md's "Inside the ranks": the synthetic transformer of ``python -m collgrad simulate``
(``--layers`` layers of 8 tensors, hidden 8: 5,000 layers are 40,000 tensors) as a real module, FSDP2
over 2 CPU ranks (Gloo), Adam stepped once; then ``save_training_state`` twice and
``load_training_state`` twice, each timed inside the ranks with the time CPython's cyclic collector
took during it (``gc.callbacks``), on a network file system's costs (as the simulation's). One line per
rank, JSON.

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/scripts/inside_ranks.py [--layers 5000] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from typing import Any


def _rank(rank: int, world: int, directory: str, layers: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import collgrad
    from tests.counting import as_on_a_network_file_system
    from tests.fsdp.test_simulate import HIDDEN, Synthetic

    as_on_a_network_file_system()
    start = time.perf_counter()
    model = Synthetic(layers, HIDDEN)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, HIDDEN)).square().mean().backward()
    opt.step()
    out: dict[str, Any] = {"rank": rank, "tensors": 8 * layers, "built_s": round(time.perf_counter() - start, 2)}
    out["heap_objects"] = len(gc.get_objects())
    collected = [0.0, 0, 0.0]  # seconds, collections, when the one running started

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collected[2] = time.perf_counter()
        else:
            collected[0] += time.perf_counter() - collected[2]
            collected[1] += 1

    gc.callbacks.append(timed)
    jobs = [
        ("save", lambda: collgrad.save_training_state(model, directory, optimizer=opt)),
        ("load", lambda: collgrad.load_training_state(model, directory, optimizer=opt)),
    ]
    for name, job in jobs:
        for k in range(2):
            torch.distributed.barrier()
            collected[:2] = [0.0, 0]
            start = time.perf_counter()
            job()
            out[f"{name}{k}_s"] = round(time.perf_counter() - start, 3)
            out[f"{name}{k}_gc_s"], out[f"{name}{k}_collections"] = round(collected[0], 3), collected[1]
    gc.callbacks.remove(timed)
    return out


def main() -> None:
    from collgrad.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=5000)
    parser.add_argument("--out", default=None, help="where the training state is written (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for line in run_local(_rank, 2, args.out or scratch, args.layers, timeout=1800):
            print(json.dumps(line))


if __name__ == "__main__":
    main()
