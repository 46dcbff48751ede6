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


def _plain(world: int, edited: bool, low: float = 0.0):
    """Plain PyTorch on the same data: the mean gradient over ranks and micro-steps at each step
    (before the edit), and the parameters after STEPS SGD steps; with, per step and parameter, how far
    (relative 2-norm) the ranks' mean may be, and per parameter how far their training may end.

    The derivation, first order (tests/tolerance.py): the world * GAS local gradients are the same on
    both sides (the loss scaled by 1/(world * GAS) = 1/4 and DeepSpeed's 1/GAS are powers of two), their
    mean is summed in another order: elementwise within d = reordered_sum(world * GAS + 1) * M, M the
    mean of their magnitudes, plus ``low`` * |G| where the ranks compute in bf16
    (models.low_precision_bound). Clipping multiplies by c = CLIP / ||G||, within ||d|| / ||G|| plus the
    norm's rounding; SGD with momentum is linear: the buffer moves by b_t = mu b_(t-1) + c (d + |G| dc),
    the parameters by lr * sum_t b_t; what that changes in later gradients is second order and left out.
    The training bound is twice that, plus one rounding of the parameters where they are kept in bf16."""
    from tests.deepspeed import models
    from tests.tolerance import norm_of_sum_of_squares, reordered_sum, unit_roundoff

    model = models.Net()
    opt = _optimizer(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lr, mu = opt.defaults["lr"], opt.defaults["momentum"]
    slack = reordered_sum(world * GAS + 1, torch.float32)
    norm_slack = norm_of_sum_of_squares(sum(p.numel() for _, p in named), torch.float32)
    seen, grad_bounds = [], []
    buffer = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    moved = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    for step in range(STEPS):
        model.zero_grad()
        magnitude = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
        for rank in range(world):
            for micro in range(GAS):
                before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in named}
                x, y = models.batch(rank, GAS * step + micro)
                (torch.nn.functional.mse_loss(model(x), y) / (world * GAS)).backward()
                for n, p in named:  # this term's magnitude (what the backward added)
                    magnitude[n] += (p.grad.double() - before[n].double()).abs()
        seen.append({n: p.grad.clone() for n, p in named})
        d = {n: slack * magnitude[n] + low * p.grad.double().abs() for n, p in named}
        grad_bounds.append({n: float(d[n].norm()) / max(float(p.grad.norm()), 1e-30) for n, p in named})
        if edited:
            model.get_parameter(SCALED).grad.mul_(0.5)
            d[SCALED] = d[SCALED] * 0.5
        grad = {n: p.grad.double() for n, p in named}
        norm = float(torch.sqrt(sum((g**2).sum() for g in grad.values())))
        coef = min(CLIP / (norm + 1e-6), 1.0)
        dcoef = float(torch.sqrt(sum((e**2).sum() for e in d.values()))) / norm + norm_slack if coef < 1 else 0.0
        for n, _ in named:
            buffer[n] = mu * buffer[n] + coef * (d[n] + grad[n].abs() * dcoef)
            moved[n] += lr * buffer[n]
        torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)
        opt.step()
    params = {n: p.detach().clone() for n, p in named}
    kept = unit_roundoff(torch.bfloat16) if low else 0.0
    bounds = {n: 2 * float(moved[n].norm()) / max(float(params[n].norm()), 1e-30) + kept for n in params}
    return seen, params, grad_bounds, bounds


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

    low = models.low_precision_bound(torch.bfloat16)
    plain = {(edited, lp): _plain(world, edited, low if lp else 0.0) for edited in (False, True) for lp in (0, 1)}
    out = {"edit_matters": max(_rel(plain[True, 0][1][n], plain[False, 0][1][n]) for n in plain[True, 0][1])}
    for name, (stage, dtype) in CONFIGS.items():
        lp = int(dtype != "fp32")
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

            def hook(engine, edited=edited, errors=errors, fired=fired, lp=lp):
                grads = collgrad.safe_get_full_model_grads(engine)
                expected, bound = plain[edited, lp][0][len(fired)], plain[edited, lp][2][len(fired)]
                errors.append(max(_rel(grads[n], expected[n]) / bound[n] for n in expected))
                fired.append(engine.global_steps)
                if edited:
                    collgrad.safe_update_full_model_grads(engine, lambda n, g: g * 0.5 if n == SCALED else None)

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
            ref = plain[edited, lp]
            out[(name, edited)] = {
                "grad_error": max(errors),
                "fired": len(fired),
                "boundaries": handle.boundaries,
                "micro_steps": micro_steps,
                # distance to plain PyTorch over _plain's bound, per parameter
                "param_error": max(_rel(trained[n], ref[1][n]) / ref[3][n] for n in trained),
                "unedited_error": max(_rel(trained[n], plain[not edited, lp][1][n]) / ref[3][n] for n in trained),
            }
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=1200)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_hook_sees_plain_pytorch_gradients_at_each_boundary_and_only_there(results, config):
    for res in results:
        for edited in (False, True):
            entry = res[(config, edited)]
            assert entry["grad_error"] <= 1, entry  # distance over _plain's bound
            assert entry["micro_steps"] == GAS * STEPS and entry["fired"] == entry["boundaries"] == STEPS, entry


@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_edit_in_the_hook_trains_as_the_same_edit_in_plain_pytorch(results, config):
    for res in results:
        assert res["edit_matters"] > 1e-2  # plain PyTorch with and without the edit differ
        # within _plain's bound of the same training, and outside it of the other (the bound can fail)
        for edited in (True, False):
            assert res[(config, edited)]["param_error"] <= 1, res[(config, edited)]
        if CONFIGS[config][1] == "fp32":
            assert res[(config, True)]["unedited_error"] > 1, res[(config, True)]
