"""A Llama trained one step under AutoTP tensor-parallel 2 (ZeRO-1, 2 local CPU ranks), resumed without
tensor parallelism (ZeRO-1, data-parallel 2): collgrad (save_training_state -> load_training_state)
against DeepSpeed's universal checkpoint path (save_checkpoint -> ds_to_universal -> load_checkpoint with
load_universal), end to end, per repetition and the medians (docs/benchmarks.md quotes them):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. python docs/scripts/tp_resume.py HIDDEN LAYERS REPS

Files go to /tmp/collgrad-tp-resume-<rep>."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from collgrad.launch import run_local


def build(tp, hidden, layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def engine(tp, hidden, layers, universal=False):
    import deepspeed

    model = build(tp, hidden, layers)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 1},
        "checkpoint": {"load_universal": universal},
    }
    if tp > 1:
        ds["tensor_parallel"] = {"autotp_size": tp}
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), config=ds)
    ids = torch.arange(16).reshape(1, 16)
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()
    return eng


def save(rank, world, root, hidden, layers):
    import collgrad

    eng = engine(2, hidden, layers)
    torch.distributed.barrier()
    t = time.perf_counter()
    collgrad.save_training_state(eng, os.path.join(root, "collgrad"))
    t_c = time.perf_counter() - t
    torch.distributed.barrier()
    t = time.perf_counter()
    eng.save_checkpoint(os.path.join(root, "ds"), tag="step1")
    torch.distributed.barrier()
    t_d = time.perf_counter() - t
    return t_c, t_d, sum(p.numel() for p in eng.module.parameters())


def load(rank, world, root, hidden, layers, which):
    import resource

    import collgrad

    eng = engine(1, hidden, layers, universal=(which == "ds"))
    torch.distributed.barrier()
    t = time.perf_counter()
    if which == "collgrad":
        r = collgrad.load_training_state(eng, os.path.join(root, "collgrad"))
        read = r.bytes_read
    else:
        eng.load_checkpoint(
            os.path.join(root, "univ"), tag="step1", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        read = None
    torch.distributed.barrier()
    return time.perf_counter() - t, read, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if __name__ == "__main__":
    hidden, layers, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {"collgrad": [], "ds": [], "convert": []}
    for rep in range(reps):
        root = f"/tmp/collgrad-tp-resume-{rep}"
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        (tc, td, numel) = run_local(save, 2, root, hidden, layers, timeout=900)[0]
        t = time.perf_counter()
        conv = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                os.path.join(root, "ds", "step1"),
                "--output_folder",
                os.path.join(root, "univ", "step1"),
            ],
            capture_output=True,
            text=True,
        )
        tconv = time.perf_counter() - t
        if conv.returncode:
            print("ds_to_universal failed:", conv.stderr[-2500:])
            out["ds_error"] = conv.stderr[-800:]
        lc = run_local(load, 2, root, hidden, layers, "collgrad", timeout=900)
        ld = run_local(load, 2, root, hidden, layers, "ds", timeout=900) if not conv.returncode else None
        out["collgrad"].append(tc + lc[0][0])
        out["convert"].append(tconv)
        if ld:
            out["ds"].append(td + tconv + ld[0][0])
        print(
            rep,
            "numel",
            numel,
            "collgrad save",
            round(tc, 3),
            "load",
            round(lc[0][0], 3),
            "read/rank",
            [x[1] for x in lc],
            "| ds save",
            round(td, 3),
            "convert",
            round(tconv, 2),
            "load",
            None if not ld else round(ld[0][0], 3),
            flush=True,
        )
    print(json.dumps({k: statistics.median(v) if v and not isinstance(v, str) else v for k, v in out.items()}))
