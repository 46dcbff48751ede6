"""A MoE model's experts spread over expert-parallel ranks are saved whole, each under the name the same
model has at ``ep_size`` 1 (global index ``ep_rank * local_count + i``): a training state written at
ep 2 (ZeRO-2) resumes at ep 1 (ZeRO-1), at world 2 and from world 4 (where ZeRO partitions each expert
over its expert-data-parallel group of 2), every fp32 master and Adam state bitwise DeepSpeed's own
(``safe_get_full_fp32_param``; the moments, which its accessor does not give for a MoE engine, by one
plain all-gather of each partition) joined by hand across the expert-parallel ranks, the step count
kept and each param group's ``name``/``moe`` keys the destination's own; training on takes the
uninterrupted run's step within 1e-5 (relative). Saved again at ep 1, it resumes at ep 2 bitwise.
``save_full_model`` at ep 2 loads at ep 1 into the same weights and logits."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import os
import re

import torch
import torch.distributed as dist

from tests.harness import run_ranks

EXPERTS = 4
KEYS = ("exp_avg", "exp_avg_sq")


def _global(name: str, ep_rank: int, local: int) -> str:
    """An expert parameter's name as the model has it at ep 1."""
    found = re.match(r"(.*deepspeed_experts\.)(\d+)(\..*)", name)
    return f"{found[1]}{ep_rank * local + int(found[2])}{found[3]}" if found else name


def _whole_state(eng, ep: int) -> dict[str, torch.Tensor]:
    """The fp32 masters (DeepSpeed's accessor) and Adam's moments of every trainable parameter, each
    expert under its global name, gathered from every rank (each rank's experts are its own)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from tests.deepspeed.test_state_read import _rebuilt

    trainable = [(n, p) for n, p in eng.module.named_parameters() if p.requires_grad]
    local = {"fp32": {n: safe_get_full_fp32_param(p) for n, p in trainable}}
    local.update((key, _rebuilt(eng, key, trainable)) for key in KEYS)
    # DeepSpeed's expert-parallel groups are consecutive ranks: the expert-parallel rank is rank % ep
    ep_rank, count = dist.get_rank() % ep, EXPERTS // ep
    mine = {f"{what}/{_global(n, ep_rank, count)}": t.clone() for what, held in local.items() for n, t in held.items()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.items():
            assert name not in out or torch.equal(out[name], tensor), name  # replicas agree
            out[name] = tensor
    return out


def _batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a global batch of 16 rows, whatever the world (2 or 4)."""
    from tests.deepspeed import models

    parts = [models.batch(r, step) for r in range(rank * 4 // world, (rank + 1) * 4 // world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _step(eng, rank: int, world: int, step: int, between=None) -> None:
    x, y = _batch(rank, world, step)
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))
    if between is not None:
        between()
    eng.step()


def _whole_grads(eng, ep: int, out: dict) -> None:
    """Whole reads of the gradients (against DeepSpeed's accessor joined by hand across the
    expert-parallel ranks), their statistics, and whole writes: each rank writes its own experts."""
    from deepspeed.utils import safe_get_full_grad

    import collgrad

    ep_rank, count = dist.get_rank() % ep, EXPERTS // ep
    theirs = {_global(n, ep_rank, count): safe_get_full_grad(p) for n, p in eng.module.named_parameters()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, theirs)
    joined = {n: t for part in parts for n, t in part.items()}
    grads = collgrad.safe_get_full_model_grads(eng, model_parallel="whole")
    stats = collgrad.safe_get_full_model_grad_stats(eng, model_parallel="whole")
    norm = float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in joined.values()])))
    collgrad.safe_set_full_model_grads(eng, {n: g * 2 for n, g in grads.items()}, model_parallel="whole")
    doubled = collgrad.safe_get_full_model_grads(eng, model_parallel="whole")
    collgrad.safe_set_full_model_grads(eng, dict(grads), model_parallel="whole")  # as they were
    out["grads"] = {
        "order": list(grads),
        "differs": _differs(dict(grads), joined),
        "norm": abs(stats.global_norm - norm) <= 1e-6 * norm and list(stats.params) == list(grads),
        "written": _differs(dict(doubled), {n: g * 2 for n, g in joined.items()}),
        "local": sorted(grads.model_parallel),
        "collectives": [c.collectives for c in grads.record.model_parallel_calls],
    }


def _engine(stage: int, ep: int):
    from tests.deepspeed import models

    cfg = models.config(stage)
    cfg["gradient_clipping"] = 0.0
    return models.moe_engine(cfg, ep, EXPERTS)


def _differs(ours: dict, theirs: dict, rtol: float = 0.0) -> list[str]:
    """The names whose tensors differ (beyond ``rtol`` of the tensor's largest magnitude), or are on one
    side only."""
    if set(ours) != set(theirs):
        return sorted(set(ours) ^ set(theirs))
    if not rtol:
        return [n for n in ours if not torch.equal(ours[n], theirs[n])]
    return [
        n
        for n in ours
        if not torch.allclose(ours[n], theirs[n], rtol=rtol, atol=rtol * float(theirs[n].abs().max()) + 1e-30)
    ]


def _logits(eng) -> torch.Tensor:
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return eng(x)


def _save_at_world_4(rank, world, root):
    from safetensors.torch import save_file

    import collgrad

    eng = _engine(2, 2)
    _step(eng, rank, world, 0)
    collgrad.save_training_state(eng, os.path.join(root, "w4"))
    eng.save_checkpoint(os.path.join(root, "ds-w4"), tag="step1")  # DeepSpeed's own, for convert
    state = _whole_state(eng, 2)
    _step(eng, rank, world, 1)
    after = _whole_state(eng, 2)
    if rank == 0:
        save_file(state, os.path.join(root, "w4-state.safetensors"))
        save_file(after, os.path.join(root, "w4-after.safetensors"))
    return eng.global_steps


def _resume(rank, world, root):
    from safetensors.torch import load_file

    import collgrad

    out = {}
    ep2 = _engine(2, 2)
    _step(ep2, rank, world, 0, lambda: _whole_grads(ep2, 2, out))
    saved = collgrad.save_training_state(ep2, os.path.join(root, "w2"))
    ep2.save_checkpoint(os.path.join(root, "ds-w2"), tag="step1")
    collgrad.save_full_model(ep2, os.path.join(root, "full"))
    expected, logits = _whole_state(ep2, 2), _logits(ep2)
    # loaded back at ep 2: each rank its own experts, the others' neither loaded nor unexpected
    loaded = collgrad.load_full_model(ep2, os.path.join(root, "full"))
    out["full at ep 2"] = (loaded.missing_keys, loaded.unexpected_keys, _differs(_whole_state(ep2, 2), expected))
    # whole reads of the masters and moments: every expert under its global name, as DeepSpeed's joined
    whole = {f"fp32/{n}": t for n, t in collgrad.safe_get_full_model_fp32_params(ep2, model_parallel="whole").items()}
    for key in KEYS:
        states = collgrad.iter_full_model_optimizer_states(ep2, key, model_parallel="whole", bucket_bytes=64)
        whole.update((f"{key}/{n}", t.clone()) for n, t in states)
    out["whole"] = _differs(whole, expected)
    out["files"] = sorted(os.path.basename(f) for f in saved.files)
    _step(ep2, rank, world, 1)
    after = _whole_state(ep2, 2)

    ep1 = _engine(1, 1)
    out["grads"]["order"] = out["grads"]["order"] == [n for n, _ in ep1.module.named_parameters()]
    names_before = [(g.get("name"), g.get("moe")) for g in ep1.optimizer.optimizer.param_groups]
    for case, (path, want, then) in {
        "w2": ("w2", expected, after),
        "w4": ("w4", load_file(os.path.join(root, "w4-state.safetensors")), None),
    }.items():
        collgrad.load_training_state(ep1, os.path.join(root, path))
        got = _whole_state(ep1, 1)
        out[case] = {
            "differs": _differs(got, want),
            "steps": ep1.global_steps,
            "groups": [(g.get("name"), g.get("moe")) for g in ep1.optimizer.optimizer.param_groups] == names_before,
        }
        _step(ep1, rank, world, 1)  # training on: the uninterrupted run's next step, at the same global batch
        then = then if then is not None else load_file(os.path.join(root, "w4-after.safetensors"))
        out[case]["training_on"] = _differs(_whole_state(ep1, 1), then, rtol=1e-5)

    # the weights save at ep 2 loads at ep 1: the same weights, the same logits
    collgrad.load_full_model(ep1, os.path.join(root, "full"))
    weights = {f"fp32/{n}": p.detach() for n, p in ep1.module.named_parameters()}
    out["full"] = {
        "weights": _differs(weights, {n: t for n, t in expected.items() if n.startswith("fp32/")}),
        "logits": torch.equal(_logits(ep1), logits),
    }

    # and back: saved at ep 1, resumed at ep 2
    collgrad.load_training_state(ep1, os.path.join(root, "w2"))
    _step(ep1, rank, world, 2)
    collgrad.save_training_state(ep1, os.path.join(root, "ep1"))
    state = _whole_state(ep1, 1)
    collgrad.load_training_state(ep2, os.path.join(root, "ep1"))
    out["back"] = {"differs": _differs(_whole_state(ep2, 2), state), "steps": ep2.global_steps}
    return out


def test_experts_saved_under_global_names_resume_at_another_expert_parallel_degree(tmp_path):
    root = str(tmp_path)
    steps = run_ranks(_save_at_world_4, 4, root, timeout=300)
    assert steps == [2] * 4
    results = run_ranks(_resume, 2, root, timeout=300)
    for rank, res in enumerate(results):
        # whole reads: every expert under its global name, in the order of the model at ep 1; one small
        # collective for the experts of the bucket (the expert-parallel group's), none per parameter
        grads = res["grads"]
        assert grads.pop("collectives") == [1], grads
        assert grads == {"order": True, "differs": [], "norm": True, "written": [], "local": []}, (rank, grads)
        assert res["whole"] == [], (rank, res["whole"])
        assert res["w2"] == {"differs": [], "steps": 1, "groups": True, "training_on": []}, (rank, res["w2"])
        assert res["w4"] == {"differs": [], "steps": 1, "groups": True, "training_on": []}, (rank, res["w4"])
        assert res["full"] == {"weights": [], "logits": True}, (rank, res["full"])
        assert res["back"] == {"differs": [], "steps": 2}, (rank, res["back"])
        assert res["full at ep 2"] == ((), (), []), (rank, res["full at ep 2"])
    assert "model.safetensors.index.json" in results[0]["files"]
    # DeepSpeed's own checkpoints of the same engines (every expert in its own weights file, each expert
    # group's partitions over its expert-data-parallel ranks), converted: collgrad's own states, bitwise
    from tests.deepspeed.test_tensor_parallel_resume import _converted

    assert _converted(root, "ds-w4", "w4") == [] and _converted(root, "ds-w2", "w2") == []
