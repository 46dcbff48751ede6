"""A pretrained Transformers checkpoint loaded into partitioned models with each rank reading only the
bytes it holds, on 2 local CPU ranks: no rank ever holds the whole model, and no collective carries a
weight.

    pip install 'collgrad[deepspeed,hf]'
    DS_ACCELERATOR=cpu python examples/load_pretrained.py --out gpt2-tiny

The checkpoint is a tiny GPT-2 built from a config and written by ``save_pretrained`` in several shards.
Each rank then builds the model empty and partitioned (under DeepSpeed ZeRO-3: ``from_config`` inside
``HfDeepSpeedConfig``, so ``deepspeed.zero.Init`` partitions it as it is built; under FSDP2: on the meta
device, as Accelerate does, then ``fully_shard``), and ``collgrad.load_full_model`` reads its own rows
of every tensor straight from the shards. The logits equal those of ``from_pretrained`` in one process.
"""

from __future__ import annotations

import argparse
import os

import torch

IDS = torch.arange(24).reshape(2, 12) % 128


def tiny_gpt2_config():  # type: ignore[no-untyped-def]
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)


def under_zero3(rank: int, world: int, pretrained: str) -> list[str]:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import collgrad

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - while it lives, from_config builds under zero.Init
    model = AutoModelForCausalLM.from_config(tiny_gpt2_config())  # partitioned as it is built
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    loaded = collgrad.load_full_model(engine, pretrained)  # this rank's partitions, straight from the shards
    engine.module.eval()  # as from_pretrained returns it: no dropout
    with torch.no_grad():
        logits = engine.module(input_ids=IDS).logits
    return [f"zero3 rank {rank}: read {loaded.bytes_read} of the checkpoint's bytes", _digest(logits)]


def under_fsdp2(rank: int, world: int, pretrained: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import collgrad

    with torch.device("meta"):  # no memory for weights yet, as Accelerate builds it
        model = AutoModelForCausalLM.from_config(tiny_gpt2_config())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # each rank allocates its own shards only
    loaded = collgrad.load_full_model(model, pretrained)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return [f"fsdp2 rank {rank}: read {loaded.bytes_read} of the checkpoint's bytes", _digest(logits)]


def _digest(logits: torch.Tensor) -> str:
    """The logits, exactly: their bytes as hex (compared between processes as text)."""
    return logits.float().contiguous().numpy().tobytes().hex()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpt2-tiny")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from collgrad.launch import run_local

    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(args.out, max_shard_size="20KB")
    with torch.no_grad():
        expected = _digest(AutoModelForCausalLM.from_pretrained(args.out)(input_ids=IDS).logits)
    shards = sum(name.endswith(".safetensors") for name in os.listdir(args.out))
    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out) if n.endswith(".safetensors"))
    print(f"save_pretrained wrote {shards} shards, {total} bytes")
    for how in (under_zero3, under_fsdp2):
        for lines in run_local(how, 2, os.path.abspath(args.out)):
            print(lines[0])
            print(f"  logits equal to from_pretrained's: {lines[1] == expected}")


if __name__ == "__main__":
    main()
