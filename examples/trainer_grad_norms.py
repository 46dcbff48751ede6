"""Per-layer gradient norms of a small causal language model trained by the Transformers Trainer with
DeepSpeed ZeRO-2 on 2 local CPU ranks, logged by collgrad's GradStatsCallback and plotted to a PNG:

    pip install 'collgrad[deepspeed,hf,plot]'
    DS_ACCELERATOR=cpu python examples/trainer_grad_norms.py [--steps 40] [--png grad_norms.png]

The model is built from a config (nothing is downloaded). Under torchrun / accelerate launch on GPUs,
the same Trainer code and callback work unchanged (drop the local launcher at the bottom).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def train(rank: int, world: int, steps: int, out_dir: str) -> list[dict[str, float]]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from collgrad.integrations.transformers import GradStatsCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    gen = torch.Generator().manual_seed(0)
    # A toy language: each sequence counts upwards from a random start (learnable, so norms move).
    starts = torch.randint(0, 192, (512,), generator=gen)
    data = [{"input_ids": s + torch.arange(32), "labels": s + torch.arange(32)} for s in starts]
    deepspeed_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "zero_force_ds_cpu_optimizer": False,
    }
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"rank{rank}"),
        per_device_train_batch_size=8,
        max_steps=steps,
        logging_steps=1,
        learning_rate=3e-3,
        deepspeed=deepspeed_config,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    GradStatsCallback.attach(trainer)  # first in the list: every reporter sees its entries
    trainer.train()
    return [h for h in trainer.state.log_history if "grad_norm/global" in h]


def plot(logs: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modules = [k for k in logs[0] if k.startswith("grad_norm/") and k != "grad_norm/global"]
    steps = [h["step"] for h in logs]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    cmap = plt.get_cmap("viridis", len(modules))
    for i, key in enumerate(modules):
        ax.plot(
            steps,
            [h[key] for h in logs],
            color=cmap(i),
            linewidth=1,
            label=key.split("/", 1)[1].replace("transformer.", ""),
        )
    ax.plot(steps, [h["grad_norm/global"] for h in logs], color="black", linewidth=2.5, label="global")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Per-layer gradient norms: GPT-2 (4 layers), Trainer + DeepSpeed ZeRO-2, 2 CPU ranks")
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    from collgrad.launch import run_local

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--png", default="grad_norms.png")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        logs = run_local(train, 2, opts.steps, tmp, timeout=900)[0]
    for h in logs[:: max(1, len(logs) // 8)]:
        print(f"step {h['step']}: loss {h['loss']:.3f}, global norm {h['grad_norm/global']:.4f}")
    plot(logs, opts.png)
    print(f"wrote {opts.png}")


if __name__ == "__main__":
    main()
