"""Whole reads under AutoTP (ZeRO-2, local CPU ranks, tensor-parallel TP x data-parallel WORLD/TP): a
Llama's fp32 masters, Adam's exp_avg and its gradients as the unsharded model has them, collgrad
(``model_parallel="whole"``: one collective per bucket over the data-parallel group, one over the
tensor-parallel group) against DeepSpeed's accessor loop (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` / ``safe_get_full_grad`` per parameter) plus a per-parameter
all-gather over the tensor-parallel group and a join; the two interleaved, REPS pairs, medians of rank
0's seconds (docs/benchmarks.md quotes them), and both results compared bitwise:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. python docs/scripts/tp_whole_reads.py WORLD TP HIDDEN LAYERS REPS
"""

import json
import statistics
import sys
import time

import torch

from collgrad.launch import run_local


def engine(tp: int, hidden: int, layers: int):
    import deepspeed
    from tp_resume import build  # the same Llama as the resume's (docs/scripts/ is this script's path)

    model = build(tp, hidden, layers)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "tensor_parallel": {"autotp_size": tp},
    }
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), config=ds)
    return eng


def _loop(eng, read):
    """DeepSpeed's accessor per parameter, each tensor-parallel shard all-gathered over the
    tensor-parallel group and joined along its split dimension (from the shard's own layout record)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    out = {}
    for name, param in eng.module.named_parameters():
        local = read(param)
        meta = getattr(param, "ds_autotp_universal_checkpoint_meta", None)
        if meta and not meta.get("replicated") and meta.get("partition_dim") is not None:
            sizes = meta["partition_sizes"]
            shape = list(local.shape)
            parts = []
            for size in sizes:
                shape[meta["partition_dim"]] = size
                parts.append(torch.empty(shape, dtype=local.dtype))
            padded = max(p.numel() for p in parts)
            send = torch.zeros(padded, dtype=local.dtype)
            send[: local.numel()] = local.reshape(-1)
            got = [torch.empty(padded, dtype=local.dtype) for _ in range(tp)]
            dist.all_gather(got, send, group=group)
            local = torch.cat([g[: p.numel()].view(p.shape) for g, p in zip(got, parts)], meta["partition_dim"])
        out[name] = local
    return out


def _timed(fn):
    torch.distributed.barrier()
    start = time.perf_counter()
    value = fn()
    torch.distributed.barrier()
    return time.perf_counter() - start, value


def measure(rank, world, tp, hidden, layers, reps):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    import collgrad

    eng = engine(tp, hidden, layers)
    ids = torch.arange(16).reshape(1, 16)
    for step in range(2):  # a step makes Adam's states; the second backward leaves gradients to read
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        if step == 0:
            eng.step()
    reads = {
        "fp32": (
            lambda: collgrad.safe_get_full_model_fp32_params(eng, model_parallel="whole"),
            lambda: _loop(eng, safe_get_full_fp32_param),
        ),
        "exp_avg": (
            lambda: collgrad.safe_get_full_model_optimizer_states(eng, "exp_avg", model_parallel="whole"),
            lambda: _loop(eng, lambda p: safe_get_full_optimizer_state(p, "exp_avg")),
        ),
        "grads": (
            lambda: collgrad.safe_get_full_model_grads(eng, model_parallel="whole"),
            lambda: _loop(eng, safe_get_full_grad),
        ),
    }
    out = {}
    for what, (ours, theirs) in reads.items():
        times = {"collgrad": [], "loop": []}
        for _ in range(reps):  # paired, interleaved
            t, mine = _timed(ours)
            times["collgrad"].append(t)
            t, joined = _timed(theirs)
            times["loop"].append(t)
        equal = list(mine) == list(joined) and all(torch.equal(mine[n], joined[n]) for n in joined)
        out[what] = {k: statistics.median(v) for k, v in times.items()} | {"bitwise": equal}
        out[what]["collectives"] = mine.record.collectives
        out["params"] = sum(t.numel() for t in mine.values())  # the unsharded model's
    return out


if __name__ == "__main__":
    world, tp, hidden, layers, reps = map(int, sys.argv[1:6])
    result = run_local(measure, world, tp, hidden, layers, reps, timeout=1800)[0]
    for what in ("fp32", "exp_avg", "grads"):
        entry = result[what]
        entry["speedup"] = entry["loop"] / entry["collgrad"]
    print(json.dumps(result))
