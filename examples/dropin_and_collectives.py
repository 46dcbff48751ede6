"""collgrad's model-wide calls on one DeepSpeed ZeRO-2 engine, DeepSpeed's own accessors served by
collgrad (the drop-in), and the coalesced collectives, on 2 local CPU ranks:

    pip install '.[deepspeed]'
    DS_ACCELERATOR=cpu python examples/dropin_and_collectives.py

Two training steps. After the first backward: the gradients read whole, streamed, summarised, edited
and written; DeepSpeed's documented per-parameter loop, unchanged, answered by collgrad and compared
with collgrad's model-wide read. At the second step: a pre-step hook inside DeepSpeed's step(). Then
the fp32 master weights and Adam's moments read and written, and a few tensors of mixed dtypes
all-reduced and all-gathered in one call each. The same calls work unchanged under torchrun / the
deepspeed launcher on GPUs (drop the local launcher at the bottom).
"""

from __future__ import annotations

import argparse
import os

import torch

MAX_NORM = 0.05


def train(rank: int, world: int) -> list[str]:
    import deepspeed
    import deepspeed.utils

    import collgrad
    import collgrad.integrations.deepspeed as dropin

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=config
    )
    log = []

    # Step 1: the model-wide gradient calls, between the boundary backward() and step().
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())

    def clip(name: str, grad: torch.Tensor) -> None:  # in place (or return a new tensor)
        grad.mul_(min(1.0, MAX_NORM / (float(grad.norm()) + 1e-12)))  # every rank computes the same

    grads = collgrad.safe_get_full_model_grads(engine)  # {name: full gradient}, on every rank
    for name, grad in collgrad.iter_full_model_grads(engine, bucket_bytes=64 << 20):
        assert torch.equal(grad, grads[name])  # the same, streamed: about two buckets held at a time
    stats = collgrad.safe_get_full_model_grad_stats(engine, by="module")  # no full gradient is built
    norms = {layer: s.norm for layer, s in stats.groups.items()}  # the same numbers on every rank
    collgrad.safe_update_full_model_grads(engine, clip)  # every gradient through clip(), written back
    collgrad.safe_set_full_model_grads(engine, {"2.bias": torch.zeros(4)})  # any subset, true values
    log.append(f"global norm {stats.global_norm:.4f}; layer 0 {norms['0']:.4f}, layer 2 {norms['2']:.4f}")

    # The drop-in: DeepSpeed's documented loop, unchanged, served with one collective per bucket.
    dropin.install(engine)
    loop = {}
    for name, p in engine.module.named_parameters():
        loop[name] = deepspeed.utils.safe_get_full_grad(p)  # answered from a window of buckets
    whole = collgrad.safe_get_full_model_grads(engine)
    same = all(torch.equal(loop[name], g) for name, g in whole.items())
    log.append(f"DeepSpeed's loop through the drop-in equal to safe_get_full_model_grads: {same}")
    engine.step()  # clips, checks overflow and steps from the edited gradients

    # Step 2: a function run inside DeepSpeed's step(), where Accelerate and the Trainer call it.
    handle = collgrad.register_pre_step_hook(engine, lambda e: collgrad.safe_update_full_model_grads(e, clip))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()  # the hook runs in here, before DeepSpeed clips and steps
    handle.remove()

    # The rest of the training state, at any time outside step(): no backward needed.
    weights = collgrad.safe_get_full_model_fp32_params(engine)  # {name: full fp32 master weight}
    second = collgrad.safe_get_full_model_optimizer_states(engine, "exp_avg_sq")  # Adam's second moment
    for name, w in collgrad.iter_full_model_fp32_params(engine):  # streamed: about two buckets held
        assert torch.equal(w, weights[name])
    collgrad.safe_set_full_model_fp32_params(engine, {n: w * 0.5 for n, w in weights.items()})
    collgrad.safe_set_full_model_optimizer_states(engine, "exp_avg_sq", {n: s * 0.5 for n, s in second.items()})
    halved = collgrad.safe_get_full_model_fp32_params(engine)
    log.append(f"fp32 master weights halved: {all(torch.equal(halved[n], w * 0.5) for n, w in weights.items())}")
    dropin.uninstall()

    # Coalesced collectives: any mix of dtypes, shapes, non-contiguous or empty tensors, one call each.
    tensors = [torch.full((3,), float(rank)), torch.ones(2, 5, dtype=torch.float64).t(), torch.zeros(0)]
    record = collgrad.all_reduce_coalesced(tensors)  # in place, on every rank of the group (default WORLD)
    log.append(record.summary())
    inputs = [torch.full((2,), float(rank)), torch.full((3,), rank, dtype=torch.int64)]
    outputs = [torch.empty(world * t.numel(), dtype=t.dtype) for t in inputs]
    collgrad.all_gather_coalesced(outputs, inputs)  # outputs[i]: world_size * inputs[i].numel(), rank-major
    log.append(f"all-reduced {tensors[0].tolist()}; all-gathered {outputs[1].tolist()}")
    return log


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from collgrad.launch import run_local

    for line in run_local(train, 2)[0]:
        print(line)


if __name__ == "__main__":
    main()
