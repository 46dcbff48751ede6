"""Writing full gradients on real DeepSpeed engines (2 and 3 ranks): what is written is what is read
back (by collgrad and by DeepSpeed's accessor), and training with an edit written before every step
gives the parameters of plain PyTorch trained with the same edit, in every variant DeepSpeed's own
setter gets wrong (CPU offload with clipping, ZeRO-3 sizes not divisible by the world, BF16_Optimizer)
and the others; safe_update_full_model_grads equals get -> edit -> set; different values on one rank make
every rank raise."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.edits import write_edit
from tests.harness import attempt, run_ranks

STEPS = 3
CLIP = 0.05  # small enough that every step clips: the edit changes the norm DeepSpeed clips with

# name: (stage, dtype, offload, gas, extra zero config)
CONFIGS = {
    "zero1_fp32": (1, "fp32", False, 1, {}),
    "zero2_fp32": (2, "fp32", False, 1, {}),
    "zero3_fp32": (3, "fp32", False, 1, {}),
    "zero2_offload": (2, "fp32", True, 1, {}),
    "zero3_offload": (3, "fp32", True, 1, {}),
    "zero2_gas2": (2, "fp32", False, 2, {}),
    "zero1_round_robin": (1, "fp32", False, 1, {"round_robin_gradients": True}),
    "zero0_fp32": (0, "fp32", False, 1, {}),
    "zero1_bf16_acc32": (1, "bf16_acc32", False, 1, {}),  # BF16_Optimizer
    "zero2_bf16_acc32": (2, "bf16_acc32", False, 1, {}),
    "zero2_fp16": (2, "fp16", False, 1, {}),
}
LOW = {k for k, v in CONFIGS.items() if v[1] != "fp32"}


def edit(name: str, g: torch.Tensor) -> torch.Tensor:
    """Per-layer scaling and a mask: changes the gradient norm and the direction."""
    out = g * (3.0 if "weight" in name else 0.25)
    if out.dim() == 2:
        out = out.clone()
        out[:, 0] = 0.0
    return out


def _reference(world: int, gas: int, edited: bool, make=None, batch=None) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the mean gradient over ranks and micro-steps, edited, clipped, Adam (the model
    ``make()`` on ``batch(rank, micro)``, default the tests' Net and batches)."""
    return _reference_and_bound(world, gas, edited, make, batch)[0]


def _reference_and_bound(world: int, gas: int, edited: bool, make=None, batch=None, after_step=None):
    """``_reference``'s parameters, and per parameter how far (relative 2-norm) fp32 training that sums
    the same local gradients in another order (DeepSpeed's reduction) may end from them. ``after_step(step,
    named, optimizer, dp, dm)``: a change made to the training between steps (it scales the bound's
    parameter and first-moment errors ``dp``, ``dm`` as it scales what they are errors of).

    The derivation, first order, per element i and step t (tests/tolerance.py for the sums):
    - the mean gradient G differs by at most d = reordered_sum(world * gas + 1) * M, M the mean of the
      local gradients' magnitudes (one rounding more per term: the loss scaled by 1/gas, the division
      by the world before the reduction); the edit scales M as it scales G (factors > 0, a mask);
    - clipping multiplies by c = CLIP / ||G||: c's relative error is at most ||d|| / ||G|| plus the
      rounding of the norm's sum of squares (norm_of_sum_of_squares over every element);
    - Adam: m and v are sums of the clipped gradients with weights (1 - b1) b1^k, (1 - b2) b2^k, so
      their errors are the same sums of the gradient's errors (v's of 2 |g| dg); the update
      lr * m^ / (sqrt(v^) + eps) then differs by lr * (dm^ / (sqrt(v^) + eps) + |m^| dv^ / (2 sqrt(v^)
      (sqrt(v^) + eps)^2)). Where dv^ > v^ / 2 the first order does not hold (elements whose mean
      cancels to about its rounding, whose sign may flip): there the two updates differ by at most the
      sum of their sizes, each at most lr * sqrt(sum_k w_k^2 / u_k) (Cauchy-Schwarz, w and u the
      bias-corrected weights of m^ and v^);
    - the parameters differ by the sum of the updates' differences over the steps.
    What the differences in the parameters change in later gradients is second order and left out,
    as is what Adam rounds itself (the same elementwise arithmetic on both sides). The bound is twice
    the first-order sum."""
    from tests.deepspeed import models
    from tests.tolerance import norm_of_sum_of_squares, reordered_sum

    model = make() if make is not None else models.Net()
    batch = batch if batch is not None else models.batch
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = torch.optim.Adam(params, lr=1e-3)
    lr, (b1, b2), eps = opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]
    slack = reordered_sum(world * gas + 1, torch.float32)
    norm_slack = norm_of_sum_of_squares(sum(p.numel() for p in params), torch.float32)
    dm = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    dv = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    dp = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        magnitude = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
        for rank in range(world):
            for micro in range(gas):
                before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in named}
                x, y = batch(rank, micro)
                (torch.nn.functional.mse_loss(model(x), y) / (world * gas)).backward()
                for n, p in named:  # this term's magnitude (what the backward added)
                    magnitude[n] += (p.grad.double() - before[n].double()).abs()
        if edited:
            for n, p in named:
                p.grad = edit(n, p.grad)
                magnitude[n] = edit(n, magnitude[n])
        grad = {n: p.grad.double() for n, p in named}
        d = {n: slack * magnitude[n] for n, _ in named}
        norm = float(torch.sqrt(sum((g**2).sum() for g in grad.values())))
        coef = min(CLIP / (norm + 1e-6), 1.0)
        dcoef = float(torch.sqrt(sum((e**2).sum() for e in d.values()))) / norm + norm_slack if coef < 1 else 0.0
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        w = [(1 - b1) * b1 ** (step - k) / (1 - b1**step) for k in range(1, step + 1)]
        u = [(1 - b2) * b2 ** (step - k) / (1 - b2**step) for k in range(1, step + 1)]
        largest = lr * sum(a * a / c for a, c in zip(w, u)) ** 0.5
        for n, p in named:
            g, dg = grad[n] * coef, (d[n] + grad[n].abs() * dcoef) * coef
            dm[n] = b1 * dm[n] + (1 - b1) * dg
            dv[n] = b2 * dv[n] + (1 - b2) * 2 * g.abs() * dg
            m_hat = opt.state[p]["exp_avg"].double() / (1 - b1**step)
            v_hat = opt.state[p]["exp_avg_sq"].double() / (1 - b2**step)
            dm_hat, dv_hat = dm[n] / (1 - b1**step), dv[n] / (1 - b2**step)
            root = v_hat.sqrt()
            dv_term = m_hat.abs() * dv_hat / (2 * root.clamp_min(1e-30) * (root + eps) ** 2)
            first = lr * (dm_hat / (root + eps) + dv_term)
            dp[n] += torch.where(dv_hat > v_hat / 2, torch.full_like(first, 2 * largest), first)
        if after_step is not None:
            after_step(step, named, opt, dp, dm)
    out = {n: p.detach().clone() for n, p in named}
    bound = {n: 2 * float(dp[n].norm()) / max(float(out[n].norm()), 1e-30) for n in out}
    return out, bound


def _params(eng) -> dict[str, torch.Tensor]:
    import collgrad  # noqa: F401

    out = {}
    for n, p in eng.module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_tensor"):  # ZeRO-3: gather the partitioned parameter
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                out[n] = p.detach().float().clone()
        else:
            out[n] = p.detach().float().clone()
    return out


def _rel(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in b)


def _worker(rank, world):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import safe_get_full_grad

    import collgrad
    from tests.counting import count_collectives
    from tests.deepspeed import models
    from tests.tolerance import unit_roundoff

    # DeepSpeed's CPU accelerator refuses fp16 only because this CPU lacks oneDNN fp16; its fp16 code
    # (loss scaling, overflow checks) is the same everywhere.
    type(get_accelerator()).is_fp16_supported = lambda self: True
    refs = {(gas, edited): _reference(world, gas, edited) for gas in (1, 2) for edited in (True, False)}
    bounds = {gas: _reference_and_bound(world, gas, True)[1] for gas in (1, 2)}
    out = {"edit_matters": {gas: _rel(refs[(gas, True)], refs[(gas, False)]) for gas in (1, 2)}}
    for name, (stage, dtype, offload, gas, extra) in CONFIGS.items():
        cfg = models.config(stage, dtype=dtype, offload=offload, gas=gas, **extra)
        cfg["gradient_clipping"] = CLIP
        entry = {}
        # 1. what is written is read back
        eng = models.engine(cfg)
        models.run_backward(eng, rank, gas)
        gen = torch.Generator().manual_seed(7)  # the same values on every rank
        new = {
            n: torch.randn(p.ds_shape if hasattr(p, "ds_shape") else p.shape, generator=gen)
            for n, p in eng.module.named_parameters()
            if p.requires_grad
        }
        with count_collectives() as seen:
            record = collgrad.safe_set_full_model_grads(eng, new)
        back = collgrad.safe_get_full_model_grads(eng)
        entry["set_calls"] = (seen.data, seen.agreements, record.collectives)
        # Where gradients are held in bf16/fp16 the written fp32 values round once to that dtype: within
        # its unit roundoff, relatively, and half its subnormal spacing absolutely (tests/tolerance.py).
        held = {"fp16": torch.float16, "bf16": torch.bfloat16, "bf16_acc32": torch.bfloat16}.get(dtype)
        rtol = 0.0 if held is None else unit_roundoff(held)
        atol = 0.0 if held is None else torch.finfo(held).smallest_normal * unit_roundoff(held)
        entry["read_back"] = all(torch.allclose(back[n].float(), new[n], rtol=rtol, atol=atol) for n in new)
        entry["read_back_bitwise"] = all(torch.equal(back[n].float(), new[n]) for n in new)
        if "round_robin" not in name:  # DeepSpeed's accessor is wrong there (see the reading tests)
            ds = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad}
            scale = back.record.loss_scale
            entry["deepspeed_reads_it"] = all(
                torch.allclose(ds[n].float() / scale, new[n], rtol=rtol, atol=atol) for n in new
            )
        # 2. training with an edit before every step, against plain PyTorch
        for how in ("set", "update"):
            eng = models.engine(cfg)
            for _ in range(STEPS):
                models.run_backward(eng, rank, gas)
                write_edit(eng, how, edit)
                eng.step()
            # tensors cannot travel back from a rank: compare here, return the distances
            trained = _params(eng)
            entry[f"trained_{how}"] = (_rel(trained, refs[(gas, True)]), _rel(trained, refs[(gas, False)]))
            # per parameter: the distance to plain PyTorch over the bound of a reordered reduction
            for key, ref in (("ratio", refs[(gas, True)]), ("plain_ratio", refs[(gas, False)])):
                entry[f"{key}_{how}"] = max(_rel({n: trained[n]}, {n: ref[n]}) / bounds[gas][n] for n in trained)
            entry[f"params_{how}"] = trained
        if name in LOW:
            # bf16/fp16 parameters round every update: plain fp32 PyTorch is too far to tell an edit from
            # none. The same engine with the (linear) edit applied by parameter hooks in backward, and
            # without it, are the references there.
            for ref, hooked in (("hooked", True), ("unedited", False)):
                model = models.Net()
                if hooked:
                    for n, p in model.named_parameters():
                        if p.requires_grad:
                            p.register_hook(lambda g, n=n: edit(n, g))
                eng = models.engine(cfg, model)
                for _ in range(STEPS):
                    models.run_backward(eng, rank, gas)
                    eng.step()
                entry[ref] = _params(eng)
            for how in ("set", "update"):
                entry[f"trained_{how}"] = (
                    _rel(entry[f"params_{how}"], entry["hooked"]),
                    _rel(entry[f"params_{how}"], entry["unedited"]),
                )
            del entry["hooked"], entry["unedited"]
        for how in ("set", "update"):
            del entry[f"params_{how}"]
        out[name] = entry
    # 3. misuse, a subset, and one rank passing different values
    eng = models.engine(models.config(2, gas=2))
    ones = {"mid.weight": torch.ones(9, 9)}
    out["before_backward"] = attempt(lambda: collgrad.safe_set_full_model_grads(eng, ones))
    models.run_backward(eng, rank, gas=2, micro_steps=1)
    out["mid_accumulation"] = attempt(lambda: collgrad.safe_update_full_model_grads(eng, edit))
    eng.step()
    models.run_backward(eng, rank, gas=2, micro_steps=1)
    before = collgrad.safe_get_full_model_grads(eng)
    collgrad.safe_set_full_model_grads(eng, {"mid.weight": torch.ones(9, 9)})
    after = collgrad.safe_get_full_model_grads(eng)
    out["subset"] = {
        "written": torch.equal(after["mid.weight"], torch.ones(9, 9)),
        "others_untouched": all(torch.equal(after[n], before[n]) for n in before if n != "mid.weight"),
    }
    value = torch.full((9, 9), 2.0 if rank == world - 1 else 1.0)
    same = {"mid.bias": torch.ones(9), "scale": torch.ones(1)}
    out["different_values"] = attempt(
        lambda: collgrad.safe_set_full_model_grads(eng, {**same, "mid.weight": value}, check=True)
    )
    out["unknown_name"] = attempt(
        lambda: collgrad.safe_set_full_model_grads(eng, {"nope" if rank == 0 else "mid.weight": torch.ones(9, 9)})
    )
    out["untouched_after_errors"] = torch.equal(collgrad.safe_get_full_model_grads(eng)["mid.weight"], torch.ones(9, 9))
    # every value but one, each one in turn: where the one left out is a parameter split between ranks,
    # the rest is still written as runs of adjacent copies, and nothing of the one left out
    left_out_ok = []
    for skipped in before:
        was = collgrad.safe_get_full_model_grads(eng)
        given = {n: g + 1 for n, g in was.items() if n != skipped}
        collgrad.safe_set_full_model_grads(eng, given)
        now = collgrad.safe_get_full_model_grads(eng)
        left_out_ok.append(
            torch.equal(now[skipped], was[skipped]) and all(torch.equal(now[n], g) for n, g in given.items())
        )
    out["subset"]["every_but_one"] = all(left_out_ok) and len(left_out_ok) == len(before)
    # every value in one block of memory held by two storages (a tensor over each part of it, cut at each
    # value in turn): the values lie back to back, but a run of copies cannot span the two storages;
    # each is written all the same
    was = collgrad.safe_get_full_model_grads(eng)
    names, sizes = list(was), [g.numel() for g in was.values()]
    written = []
    for cut in range(1, len(sizes)):
        memory = bytearray(torch.cat([g.reshape(-1) + cut for g in was.values()]).numpy().tobytes())
        at = 4 * sum(sizes[:cut])
        parts = [torch.frombuffer(memoryview(memory)[a:b], dtype=torch.float32) for a, b in ((0, at), (at, None))]
        laid = [*parts[0].split(sizes[:cut]), *parts[1].split(sizes[cut:])]
        collgrad.safe_set_full_model_grads(eng, {n: v.view_as(was[n]) for n, v in zip(names, laid)})
        now = collgrad.safe_get_full_model_grads(eng)
        written.append(all(torch.equal(now[n], was[n] + cut) for n in names))
    out["subset"]["two_storages"] = all(written)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    world = request.param
    return world, run_ranks(_worker, world, timeout=1200)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_what_is_written_is_read_back_without_bulk_communication(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        assert entry["read_back"], config
        if config not in LOW:
            assert entry["read_back_bitwise"], config
        if "deepspeed_reads_it" in entry:
            assert entry["deepspeed_reads_it"], config
        data, agreements, collectives = entry["set_calls"]
        assert (data, agreements, collectives) == (0, 1, 0), entry["set_calls"]  # only the readiness check


@pytest.mark.parametrize("how", ["set", "update"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_training_with_an_edit_matches_plain_pytorch(results, config, how):
    _, per_rank = results
    gas = CONFIGS[config][3]
    for res in per_rank:
        to_edited, to_plain = res[config][f"trained_{how}"]
        assert res["edit_matters"][gas] > 1e-3  # plain PyTorch with and without the edit differ
        if config in LOW:  # against the same engine edited by hooks / not edited (see the worker)
            assert to_edited < 0.2 * to_plain, (config, how, to_edited, to_plain)
        else:  # fp32: within the bound of the same training with the reduction in another order
            ratio = res[config][f"ratio_{how}"]  # (_reference_and_bound's derivation), per parameter
            assert ratio <= 1, (config, how, ratio, to_edited, to_plain)
            assert res[config][f"plain_ratio_{how}"] > 1  # the bound tells the edit from none: it can fail


def test_misuse_raises_on_every_rank(results):
    _, per_rank = results
    for res in per_rank:
        assert res["before_backward"]["error"] == "NotReadyError", res["before_backward"]
        assert res["mid_accumulation"]["error"] == "NotReadyError", res["mid_accumulation"]
        assert "not a gradient accumulation boundary" in res["mid_accumulation"]["message"]


def test_a_subset_is_written_and_nothing_else(results):
    _, per_rank = results
    for res in per_rank:
        assert res["subset"] == {
            "written": True,
            "others_untouched": True,
            "every_but_one": True,
            "two_storages": True,
        }


def test_different_values_or_names_on_one_rank_make_every_rank_raise(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        assert res["different_values"]["error"] == "ArgumentMismatchError", res["different_values"]
        message = res["different_values"]["message"]
        assert "different values to safe_set_full_model_grads for 1 tensor(s): 'mid.weight'" in message
        assert f"{[list(range(world - 1)), [world - 1]]}" in message  # the ranks, grouped by what they passed
        assert "mid.bias" not in message and "scale" not in message
        assert res["different_values"]["seconds"] < 5
        expected = "UnknownParameterError" if rank == 0 else "ArgumentMismatchError"
        assert res["unknown_name"]["error"] == expected, res["unknown_name"]
        assert res["untouched_after_errors"]  # nothing was written by the failed calls
