"""A training run saved once and resumed elsewhere, on local CPU ranks: a tiny GPT-2 trained under
DeepSpeed ZeRO-2 on 2 ranks and saved with ``collgrad.save_training_state``; resumed under ZeRO-3 on 3
ranks (its fp32 masters and Adam states bitwise the saved ones) and under FSDP2 on 2 (training goes on
as the uninterrupted run did); and the same directory loaded by ``from_pretrained``. DeepSpeed's own
checkpoint of the same moment, converted offline by ``collgrad.convert_deepspeed_checkpoint``, loads the
same (tests/deepspeed/test_training_state.py resumes converted checkpoints at other sizes and stages).

    pip install 'collgrad[deepspeed,hf]'
    DS_ACCELERATOR=cpu python examples/resume_anywhere.py --out run

No rank ever holds the whole training state: each writes and reads only the ranges it holds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import torch

STEPS, MORE = 3, 2


def tiny_gpt2_config():  # type: ignore[no-untyped-def]
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(100 * rank + step))


def schedule(step: int) -> float:
    return 0.9**step


def digest(model: Any, optimizer: Any = None) -> str:
    """The fp32 master weights and Adam's two states, whole, as one hash (every rank calls; collective)."""
    import collgrad

    h = hashlib.sha256()
    parts = [collgrad.safe_get_full_model_fp32_params(model)]
    parts += [
        collgrad.safe_get_full_model_optimizer_states(model, k, optimizer=optimizer) for k in ("exp_avg", "exp_avg_sq")
    ]
    for part in parts:
        for name, tensor in part.items():
            h.update(name.encode() + tensor.float().contiguous().numpy().tobytes())
    return h.hexdigest()


def zero(stage: int):  # type: ignore[no-untyped-def]
    import deepspeed
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    config["gradient_clipping"] = 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def train(engine: Any, rank: int, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        ids = batch(rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def first_run(rank: int, world: int, out: str) -> dict[str, Any]:
    import collgrad

    engine = zero(2)
    train(engine, rank, 0, STEPS)
    collgrad.save_training_state(engine, out)  # each rank its own ranges, straight to their offsets
    engine.save_checkpoint(out + "-deepspeed")  # DeepSpeed's own checkpoint of the same state, for convert
    if rank == 0:
        engine.module.config.save_pretrained(out)  # beside the weights: from_pretrained loads the directory
        with torch.no_grad():
            logits = engine.module(input_ids=batch(0, 0)).logits
        torch.save(logits, os.path.join(out, "logits-at-save.pt"))
    saved = digest(engine)
    return {"saved": saved, "uninterrupted": train(engine, rank, STEPS, MORE)}


def under_zero3(rank: int, world: int, out: str) -> str:
    import collgrad

    engine = zero(3)  # a fresh engine: its optimizer has never stepped
    collgrad.load_training_state(engine, out)  # its states are created, then every rank reads its own
    return digest(engine)


def under_fsdp2(rank: int, world: int, out: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import collgrad

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_gpt2_config())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    collgrad.load_training_state(model, out, optimizer=optimizer, lr_scheduler=scheduler)
    losses = []
    for step in range(STEPS, STEPS + MORE):
        ids = batch(rank, step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="run")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoModelForCausalLM

    from collgrad.launch import run_local

    out = os.path.abspath(args.out)
    first = run_local(first_run, 2, out)[0]
    print(f"ZeRO-2, 2 ranks: trained {STEPS} steps, saved to {args.out}, then {MORE} more: {first['uninterrupted']}")
    resumed = run_local(under_zero3, 3, out)[0]
    print(f"ZeRO-3, 3 ranks: fp32 masters and Adam states equal to the saved: {resumed == first['saved']}")
    losses = run_local(under_fsdp2, 2, out)[0]
    close = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, first["uninterrupted"]))
    print(f"FSDP2, 2 ranks: {MORE} more steps {losses}, as the uninterrupted run's: {close}")
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out)(input_ids=batch(0, 0)).logits
    saved = torch.load(os.path.join(out, "logits-at-save.pt"), weights_only=True)
    print(f"from_pretrained({args.out!r}): logits equal to the model's at the save: {torch.equal(logits, saved)}")
    converted = convert(out)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(converted)(input_ids=batch(0, 0)).logits
    print(f"DeepSpeed's own checkpoint, converted: from_pretrained's logits equal: {torch.equal(logits, saved)}")


def convert(out: str) -> str:
    """DeepSpeed's own checkpoint of the run (``engine.save_checkpoint``, per-rank files) made a training
    state offline, in this one process, with the config beside it."""
    import shutil

    import collgrad

    collgrad.convert_deepspeed_checkpoint(out + "-deepspeed", out + "-converted")
    shutil.copy(os.path.join(out, "config.json"), out + "-converted")
    return out + "-converted"


if __name__ == "__main__":
    main()
