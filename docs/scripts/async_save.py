"""Async saves and verified loads on 2 local CPU ranks (docs/benchmarks.md quotes the medians), the GPT-2-shaped
benchmark model (ZeRO-2 fp32, or FSDP2) at ELEMENTS elements:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. python docs/scripts/async_save.py zero2|fsdp2 ELEMENTS REPS

Per repetition, rank 0's seconds, the rows interleaved:
  call        async_save_training_state until it returns (the stall)
  copy        a plain copy of the bytes the rank writes (what the call copies aside), into a buffer kept
  sync        save_training_state (until durable)
  durable     the async save from its call until wait() returns
  unhashed    save_training_state with the writer's hasher off (what hashing adds to a save)
  steps       STEPS training steps alone, and beside an async save's background write (started just
              before them); with the cores the background used meanwhile (its CPU seconds / wall)
  load        load_training_state verified (the default) and with verify=False
Files go to /tmp/collgrad-async-<framework>-*.
"""

import json
import shutil
import statistics
import sys
import time

import torch

from collgrad.launch import run_local

STEPS = 3


def _subject(framework, elements):
    from collgrad.bench.config import BenchConfig
    from collgrad.bench.models import build_model

    cfg = BenchConfig(elements=elements)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    if framework == "zero2":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2},
            "gradient_clipping": 0.0,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)

        def step():
            engine.backward(engine(model.example(gen)))
            engine.step()

        return engine, None, step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    opt = torch.optim.Adam(model.parameters())

    def step():
        model(model.example(gen)).backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _rank(rank, world, framework, elements, reps):
    import collgrad
    from collgrad.checkpoint import storage, training

    model, opt, step = _subject(framework, elements)
    step()
    root = f"/tmp/collgrad-async-{framework}"
    rows = {
        k: []
        for k in ("call", "copy", "sync", "durable", "unhashed", "alone", "beside", "cores", "verified", "unverified")
    }
    floor = torch.empty(0, dtype=torch.uint8)
    src = None
    hashed_writer = training.Save.writer
    for rep in range(reps + 1):  # the first: warm-up, not kept
        out = {}
        t = time.perf_counter()
        pending = collgrad.async_save_training_state(model, f"{root}-a", optimizer=opt)
        out["call"] = time.perf_counter() - t
        saved = pending.wait()
        out["durable"] = saved.seconds
        n = saved.bytes_written
        if src is None or src.numel() != n:
            src, floor = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        t = time.perf_counter()
        floor.copy_(src)
        out["copy"] = time.perf_counter() - t
        torch.distributed.barrier()
        out["sync"] = collgrad.save_training_state(model, f"{root}-s", optimizer=opt).seconds
        training.Save.writer = lambda self: storage.Writer(None)
        try:
            out["unhashed"] = collgrad.save_training_state(model, f"{root}-u", optimizer=opt).seconds
        finally:
            training.Save.writer = hashed_writer
        torch.distributed.barrier()
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        out["alone"] = time.perf_counter() - t
        torch.distributed.barrier()
        pending = collgrad.async_save_training_state(model, f"{root}-a", optimizer=opt)
        t, cpu, mine = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(STEPS):
            step()
        out["beside"] = time.perf_counter() - t
        background = (time.process_time() - cpu) - (time.thread_time() - mine)
        out["cores"] = background / out["beside"]
        pending.wait()
        torch.distributed.barrier()
        for verify in (True, False):
            t = time.perf_counter()
            collgrad.load_training_state(model, f"{root}-s", optimizer=opt, verify=verify)
            out["verified" if verify else "unverified"] = time.perf_counter() - t
        if rep:
            for k, v in out.items():
                rows[k].append(v)
    return {"bytes_written": n, **rows} if rank == 0 else None


def main():
    framework, elements, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    found = run_local(_rank, 2, framework, elements, reps, timeout=3600, env={"DS_ACCELERATOR": "cpu"})[0]
    med = {k: statistics.median(v) for k, v in found.items() if isinstance(v, list)}
    print(json.dumps({"framework": framework, "elements": elements, "reps": reps, **found}, indent=None))
    written = found["bytes_written"] / 1e6
    print(f"{framework}, {elements / 1e6:.1f}M elements, rank 0 writes {written:.0f} MB, medians of {reps}:")
    print(
        f"  call {med['call'] * 1e3:.0f} ms; copy {med['copy'] * 1e3:.0f} ms;"
        f" call / copy {med['call'] / med['copy']:.2f}x; sync save {med['sync'] * 1e3:.0f} ms;"
        f" call / sync {med['call'] / med['sync']:.3f}x"
    )
    print(
        f"  until durable: async {med['durable'] * 1e3:.0f} ms, sync {med['sync'] * 1e3:.0f} ms, unhashed sync"
        f" {med['unhashed'] * 1e3:.0f} ms: hashing adds {100 * (med['sync'] / med['unhashed'] - 1):.1f}%"
    )
    print(
        f"  {STEPS} steps alone {med['alone'] * 1e3:.0f} ms, beside a write {med['beside'] * 1e3:.0f} ms"
        f" ({100 * (med['beside'] / med['alone'] - 1):.0f}% slower), the background using {med['cores']:.2f} cores"
    )
    print(
        f"  load verified {med['verified'] * 1e3:.0f} ms, unverified {med['unverified'] * 1e3:.0f} ms:"
        f" {med['verified'] / med['unverified']:.2f}x"
    )
    for suffix in ("a", "s", "u"):
        shutil.rmtree(f"/tmp/collgrad-async-{framework}-{suffix}", ignore_errors=True)


if __name__ == "__main__":
    main()
