"""Inside two local ranks, where ``safe_set_full_model_grads`` (``--state exp_avg``:
``safe_set_full_model_optimizer_states`` of Adam's first moment) of the bench model spends its time,
checked and unchecked: per rank, the median call and the mean time per call in its stages (the names
checked, the sampled checksums, the copies made ready while the ranks agree (inside the agreement), the
agreement, the copy, the store), each wrapped with ``perf_counter``.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python docs/notes/profile_write.py --stage 2 [--state exp_avg]

Figures from it are in the closing notes of the issue on writes (the bench's write rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

from collgrad.launch import run_local

#: each stage timed, as profile_call.py's ``--stages`` names them
STAGES = (
    "collgrad.state.write:_checked",
    "collgrad.state.write:sampled_checksums",
    "collgrad.state.write:_prepared",
    "collgrad.state.call:_agree",
    "collgrad.state.adapters.base:copy_all",
    "collgrad.state.write:_store",
)


def _rank(rank: int, world: int, stage: int, calls: int, state: str) -> list[str]:
    import torch.distributed as dist
    from profile_call import _wrap  # beside this script: a stage wrapped with perf_counter

    import collgrad
    from collgrad.bench.config import BenchConfig
    from collgrad.bench.methods import make_setting
    from collgrad.bench.models import build_subject

    cfg = BenchConfig(stage=stage)
    setting = make_setting(build_subject(cfg), cfg)
    engine = setting.subject.engine
    spent: dict[str, float] = {}
    for target in STAGES:
        _wrap(target, spent)
    lines = []
    for check in (True, False, True, False):
        spent.clear()
        took = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            if state == "exp_avg":
                collgrad.safe_set_full_model_optimizer_states(
                    engine, "exp_avg", setting.exp_avg, optimizer=setting.subject.optimizer_obj, check=check
                )
            else:
                collgrad.safe_set_full_model_grads(engine, setting.full, check=check)
            took.append(time.perf_counter() - start)
        stages = ", ".join(f"{k.rsplit(':', 1)[1]} {v / calls * 1e3:.2f}" for k, v in spent.items())
        lines.append(f"rank {rank} check={check}: {statistics.median(took) * 1e3:.2f} ms ({stages})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--state", choices=("grads", "exp_avg"), default="grads")
    args = parser.parse_args()
    for lines in run_local(_rank, 2, args.stage, args.calls, args.state, env={"DS_ACCELERATOR": "cpu"}):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
