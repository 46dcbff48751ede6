"""An EMA of the fp32 master weights under ZeRO-3, each rank keeping it for its own partition only (no
gather, no full copy anywhere), and a final checkpoint of the EMA model that Transformers loads, on 2
local CPU ranks:

    pip install 'collgrad[deepspeed,hf]'
    DS_ACCELERATOR=cpu python examples/ema_and_save.py --out ema-model

Saving swaps the EMA into the master weights for the time of ``collgrad.save_full_model`` (streamed
bucket by bucket into safetensors shards; rank 0 never holds the model), then training goes on from the
live weights. The same calls work under torchrun / the deepspeed launcher on GPUs.
"""

from __future__ import annotations

import argparse
import os

import torch

DECAY = 0.9


def train(rank: int, world: int, out: str, steps: int, check: bool) -> str | None:
    import deepspeed
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    import collgrad
    from collgrad.integrations.transformers import save_pretrained_files

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    # this rank's slice of every fp32 master weight (a view of DeepSpeed's partition: no communication)
    ema = {n: safe_get_local_fp32_param(p).clone() for n, p in named}
    # --check: the same EMA the usual way, of the whole weights gathered every step, to compare with
    gathered = dict(collgrad.safe_get_full_model_fp32_params(engine)) if check else None
    for step in range(steps):
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        for n, p in named:
            ema[n].lerp_(safe_get_local_fp32_param(p), 1 - DECAY)
        if gathered is not None:
            for n, t in collgrad.safe_get_full_model_fp32_params(engine).items():
                gathered[n].lerp_(t, 1 - DECAY)

    # Save the EMA model: the EMA in place of the master weights, a consolidated fp32 checkpoint, back.
    live = {n: safe_get_local_fp32_param(p).clone() for n, p in named}
    for n, p in named:
        safe_set_local_fp32_param(p, ema[n])
    if rank == 0:
        save_pretrained_files(engine.module, out)  # config.json, generation_config.json
    saved = collgrad.save_full_model(engine, out, dtype=torch.float32)
    whole = collgrad.safe_get_full_model_fp32_params(engine)  # the EMA, whole: only to check the files
    for n, p in named:
        safe_set_local_fp32_param(p, live[n])
    if rank != 0:
        return None
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    equal = all(torch.equal(loaded[n], t) for n, t in whole.items())
    report = f"saved {len(saved.files)} files, {saved.bytes} bytes; from_pretrained loads the EMA model: {equal}"
    if gathered is not None:
        report += (
            f"; equal to the EMA of the gathered weights: {all(torch.equal(loaded[n], t) for n, t in gathered.items())}"
        )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="ema-model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="also keep the EMA of the gathered weights, compare")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from collgrad.launch import run_local

    print(run_local(train, 2, os.path.abspath(args.out), args.steps, args.check, timeout=600)[0])


if __name__ == "__main__":
    main()
