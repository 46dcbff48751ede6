"""Per-layer gradient clipping and per-layer norm logging with DeepSpeed ZeRO-2, on 2 local CPU ranks:

    pip install 'collgrad[deepspeed]'
    DS_ACCELERATOR=cpu python examples/edit_and_watch.py

The same three calls work unchanged under torchrun / the deepspeed launcher on GPUs.
"""

from __future__ import annotations

import argparse
import os

import torch

MAX_LAYER_NORM = 0.05


def train(rank: int, world: int) -> list[str]:
    import deepspeed

    import collgrad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=config
    )
    log = []
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)

        # Watch: per-layer norms, max |g| and NaN/Inf counts, from each rank's own shard, in one small
        # all-gather; the same numbers on every rank.
        stats = collgrad.safe_get_full_model_grad_stats(engine, by="module")
        log.append(
            f"step {step}: global norm {stats.global_norm:.4f}; "
            + ", ".join(f"{layer or '<root>'} {s.norm:.4f}" for layer, s in stats.groups.items())
        )

        # Edit: clip every parameter's full gradient to MAX_LAYER_NORM, streamed bucket by bucket and
        # written back where the optimizer steps from.
        def clip(name: str, grad: torch.Tensor) -> None:
            grad.mul_(min(1.0, MAX_LAYER_NORM / (float(grad.norm()) + 1e-12)))

        collgrad.safe_update_full_model_grads(engine, clip)

        # Read back (or set directly with collgrad.safe_set_full_model_grads(engine, {name: tensor})).
        grads = collgrad.safe_get_full_model_grads(engine)
        assert all(float(g.norm()) <= MAX_LAYER_NORM * (1 + 1e-5) for g in grads.values())
        engine.step()
    return log


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from collgrad.launch import run_local

    for line in run_local(train, 2)[0]:
        print(line)


if __name__ == "__main__":
    main()
