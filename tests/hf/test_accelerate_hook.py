"""The pre-step hook inside Hugging Face Accelerate, where ``accelerator.backward(loss)`` runs
DeepSpeed's backward and step in one call (2 CPU ranks, ZeRO-1/2/3, fp32 and bf16 with fp32
accumulation, gradient accumulation 2, gradient clipping): at each boundary the hook sees the
gradients plain PyTorch computes on the same data, and an edit made in the hook trains the model
exactly as the same edit does in plain PyTorch (DeepSpeed clips the edited gradients)."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'collgrad[hf]')")

import torch

from tests.harness import run_ranks

GAS, STEPS, WORLD = 2, 3, 2
CONFIGS = {  # name: (stage, dtype)
    "zero1_fp32": (1, "fp32"),
    "zero2_fp32": (2, "fp32"),
    "zero3_fp32": (3, "fp32"),
    "zero1_bf16_acc32": (1, "bf16_acc32"),
    "zero2_bf16_acc32": (2, "bf16_acc32"),
    "zero3_bf16_acc32": (3, "bf16_acc32"),
}
SCALED = "mid.weight"
CLIP = 0.05  # every step clips: the edit changes the norm DeepSpeed clips with


def _plain(world: int, edited: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Plain PyTorch on the same data: the mean gradient over ranks and micro-steps at each step
    (before the edit), and the parameters after STEPS Adam steps."""
    from tests.deepspeed import models

    model = models.Net()
    opt = _optimizer(model)
    seen = []
    for step in range(STEPS):
        model.zero_grad()
        for rank in range(world):
            for micro in range(GAS):
                x, y = models.batch(rank, GAS * step + micro)
                (torch.nn.functional.mse_loss(model(x), y) / (world * GAS)).backward()
        seen.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        if edited:
            model.get_parameter(SCALED).grad.mul_(0.5)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
    return seen, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam's update is invariant to scaling a parameter's gradient, which would hide the edit
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))


def _worker(rank, world):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    import collgrad
    from collgrad.integrations.accelerate import register_pre_step_hook
    from tests.deepspeed import models
    from tests.deepspeed.test_write import _params

    plain = {edited: _plain(world, edited) for edited in (False, True)}
    out = {"edit_matters": max(_rel(plain[True][1][n], plain[False][1][n]) for n in plain[True][1])}
    for name, (stage, dtype) in CONFIGS.items():
        for edited in (False, True):
            AcceleratorState._reset_state(True)
            cfg = models.config(stage, dtype=dtype, gas=GAS)
            cfg["gradient_clipping"] = CLIP
            accelerator = Accelerator(
                deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=GAS
            )
            model = models.Net()
            opt = _optimizer(model)
            model, opt = accelerator.prepare(model, opt)
            errors, fired = [], []

            def hook(engine, edited=edited, errors=errors, fired=fired):
                grads = collgrad.safe_get_full_model_grads(engine)
                expected = plain[edited][0][len(fired)]
                errors.append(max(_rel(grads[n], expected[n]) for n in expected))
                fired.append(engine.global_steps)
                if edited:
                    collgrad.update_full_model_grads(engine, lambda n, g: g * 0.5 if n == SCALED else None)

            handle = register_pre_step_hook(accelerator, hook)
            dtype_in = next(model.parameters()).dtype
            micro_steps = 0
            for step in range(STEPS):
                for micro in range(GAS):
                    with accelerator.accumulate(model):
                        x, y = models.batch(rank, GAS * step + micro, dtype_in)
                        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
                        accelerator.backward(loss)
                        opt.step()
                        opt.zero_grad()
                    micro_steps += 1
            handle.remove()
            trained = _params(model)
            out[(name, edited)] = {
                "grad_error": max(errors),
                "fired": len(fired),
                "boundaries": handle.boundaries,
                "micro_steps": micro_steps,
                "param_error": max(_rel(trained[n], plain[edited][1][n]) for n in trained),
            }
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=1200)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_hook_sees_plain_pytorch_gradients_at_each_boundary_and_only_there(results, config):
    tol = 1e-5 if CONFIGS[config][1] == "fp32" else 2e-2  # bf16 forward and backward round
    for res in results:
        for edited in (False, True):
            entry = res[(config, edited)]
            assert entry["grad_error"] < tol, entry
            assert entry["micro_steps"] == GAS * STEPS and entry["fired"] == entry["boundaries"] == STEPS, entry


@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_edit_in_the_hook_trains_as_the_same_edit_in_plain_pytorch(results, config):
    tol = 1e-5 if CONFIGS[config][1] == "fp32" else 2e-2
    for res in results:
        assert res["edit_matters"] > 1e-2  # plain PyTorch with and without the edit differ
        assert res[(config, True)]["param_error"] < tol, res[(config, True)]
        assert res[(config, False)]["param_error"] < tol, res[(config, False)]
