"""A training state saved under AutoTP (tensor-parallel 2 x data-parallel 2, ZeRO-2) holds every tensor
whole: it resumes under ZeRO-3 at data-parallel 2 without tensor parallelism, every fp32 master and Adam
state bitwise DeepSpeed's accessors joined by hand across the tensor-parallel group at the save, the
step count kept; saved again there, it resumes under AutoTP tensor-parallel 2 (ZeRO-1), each rank's
shards the same slices of the same whole tensors; and in FSDP2 (``full_tensor()`` of every parameter and
Adam state bitwise the saved). Training on from it takes the uninterrupted run's step (within 1e-5). At
world 3 under tensor-parallel 3 (uneven shards) it resumes bitwise, and saved there holds the same."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import os

import torch
import torch.distributed as dist

from tests.deepspeed.test_autotp import SPLIT_DIMS, TP
from tests.harness import run_ranks

KEYS = ("exp_avg", "exp_avg_sq")


def _whole_state(eng) -> dict[str, torch.Tensor]:
    """The fp32 masters and Adam's states of every trainable parameter as the unsharded model has them,
    from DeepSpeed's accessors (each rank's tensor-parallel shard, whole across the data-parallel group),
    all-gathered over the tensor-parallel group and joined along the split dimension by hand."""
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    split = hasattr(eng.module.up_proj.weight, "ds_autotp_universal_checkpoint_meta")
    out = {}
    for name, param in eng.module.named_parameters():
        values = {"fp32": safe_get_full_fp32_param(param)}
        values.update((key, safe_get_full_optimizer_state(param, key)) for key in KEYS)
        for what, local in values.items():
            if split and name in SPLIT_DIMS:  # uneven shards (tensor-parallel 3: 3 + 3 + 2 rows) too
                group = groups.get_tensor_model_parallel_group()
                parts = [None] * dist.get_world_size(group)
                dist.all_gather_object(parts, local.contiguous(), group=group)
                local = torch.cat(parts, SPLIT_DIMS[name])
            out[f"{what}/{name}"] = local.contiguous()
    return out


def _step(eng, data_parallel_rank: int, step: int = 0) -> None:
    from tests.deepspeed import models

    x, y = models.batch(data_parallel_rank, step)
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))
    eng.step()


def _save_under_autotp(rank, world, root):
    from safetensors.torch import save_file

    import collgrad
    from tests.deepspeed import models

    eng = models.engine(models.autotp_config(2, TP), models.TPNet())
    _step(eng, rank // TP)  # tensor-parallel peers see the same batch
    saved = collgrad.save_training_state(eng, os.path.join(root, "autotp"))
    eng.save_checkpoint(os.path.join(root, "ds"), tag="step1")  # DeepSpeed's own: per (tp, dp) rank files
    whole = _whole_state(eng)
    _step(eng, rank // TP, 1)  # the uninterrupted run's next step
    after = _whole_state(eng)
    if rank == 0:
        save_file(whole, os.path.join(root, "expected.safetensors"))
        save_file(after, os.path.join(root, "after.safetensors"))
    return saved.files


def _resume_elsewhere(rank, world, root):
    from safetensors.torch import load_file

    import collgrad
    from tests.deepspeed import models

    expected = load_file(os.path.join(root, "expected.safetensors"))
    out = {}
    # without tensor parallelism, ZeRO-3 at data-parallel 2
    eng = models.engine(models.config(3), models.TPNet())
    collgrad.load_training_state(eng, os.path.join(root, "autotp"))
    got = _whole_state(eng)
    out["zero3"] = ([k for k in expected if not torch.equal(got[k], expected[k])], eng.global_steps)
    collgrad.save_training_state(eng, os.path.join(root, "zero3"))
    # training on: the same global batch as the uninterrupted run's next step, the same update but for
    # the order the sharded forward added the row-parallel layer's partial sums in (down_proj: 8 inputs
    # in two partial sums); within the 1e-5 relative, of each tensor's scale (Adam's second moment
    # is ~1e-7: an absolute 1e-7 alone would pass anything there), never wider than 1e-7
    after = load_file(os.path.join(root, "after.safetensors"))
    _step(eng, rank, 1)
    got = _whole_state(eng)
    scale = {k: float(t.abs().max()) for k, t in after.items()}
    out["trained on"] = [
        k for k in after if not torch.allclose(got[k], after[k], rtol=1e-5, atol=min(1e-7, 1e-5 * scale[k]))
    ]
    # back under AutoTP tensor-parallel 2 (data-parallel 1), ZeRO-1
    eng = models.engine(models.autotp_config(1, TP), models.TPNet())
    collgrad.load_training_state(eng, os.path.join(root, "zero3"))
    got = _whole_state(eng)
    out["autotp"] = ([k for k in expected if not torch.equal(got[k], expected[k])], eng.global_steps)
    # in FSDP2, data-parallel 2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = models.TPNet()
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    collgrad.load_training_state(net, os.path.join(root, "autotp"), optimizer=opt)
    got = {}
    for name, param in net.named_parameters():
        got[f"fp32/{name}"] = param.full_tensor()
        got.update((f"{key}/{name}", opt.state[param][key].full_tensor()) for key in KEYS)
    steps = {int(state["step"]) for state in opt.state.values()}
    out["fsdp2"] = ([k for k in expected if not torch.equal(got[k], expected[k])], *steps)
    return out


def _uneven(rank, world, root):
    """World 3 under AutoTP tensor-parallel 3 (ZeRO-2): shards of 3, 3 and 2 rows or columns. The state
    saved at tensor-parallel 2 resumes bitwise; saved here, its files hold the same whole tensors."""
    from safetensors.torch import load_file

    import collgrad
    from tests.deepspeed import models

    expected = load_file(os.path.join(root, "expected.safetensors"))
    eng = models.engine(models.autotp_config(2, 3), models.TPNet())
    collgrad.load_training_state(eng, os.path.join(root, "autotp"))
    got = _whole_state(eng)
    resumed = [k for k in expected if not torch.equal(got[k], expected[k])]
    # whole reads of uneven shards (each rank's run padded to the largest): the same whole tensors
    whole = {f"fp32/{n}": t for n, t in collgrad.safe_get_full_model_fp32_params(eng, model_parallel="whole").items()}
    for key in KEYS:
        states = collgrad.safe_get_full_model_optimizer_states(eng, key, model_parallel="whole")
        whole.update((f"{key}/{n}", t) for n, t in states.items())
    resumed += [k for k in expected if not torch.equal(whole[k], expected[k])]
    saved = collgrad.save_training_state(eng, os.path.join(root, "uneven"))
    eng.save_checkpoint(os.path.join(root, "ds-uneven"), tag="step1")
    stored = {}
    for stem in ("fp32", *KEYS):
        name = "fp32" if stem == "fp32" else f"optimizer-{sorted(KEYS).index(stem)}"
        files = [f for f in saved.files if f.startswith(f"training_state/{name}-")]
        for file in files:
            stored.update((f"{stem}/{n}", t) for n, t in load_file(os.path.join(root, "uneven", file)).items())
    written = [k for k in expected if not torch.equal(stored[k], expected[k])]
    return resumed, written, eng.global_steps


def _stored(directory: str) -> dict[str, torch.Tensor]:
    """A training state's tensors by ``<what>/<name>``: ``model``, ``fp32`` and each Adam state's key."""
    import re

    from safetensors.torch import load_file

    out = {}
    for folder, _, files in os.walk(directory):
        for file in files:
            found = re.match(r"^(model|fp32|optimizer-(\d+))-[0-9a-f]+-\d+-of-\d+\.safetensors$", file)
            if found:
                what = KEYS[int(found[2])] if found[2] else found[1]
                out.update((f"{what}/{n}", t) for n, t in load_file(os.path.join(folder, file)).items())
    return out


def _converted(root: str, ds: str, ours: str) -> list[str]:
    """DeepSpeed's AutoTP checkpoint converted offline: what differs from collgrad's own training state
    of the same engine at the same step (every tensor whole, bitwise), or the manifests' step counts."""
    import json

    import collgrad

    converted = collgrad.convert_deepspeed_checkpoint(os.path.join(root, ds), os.path.join(root, ds + "-converted"))
    got, want = _stored(converted.directory), _stored(os.path.join(root, ours))
    differ = sorted(set(got) ^ set(want)) or [k for k in want if not torch.equal(got[k], want[k])]
    manifests = [
        os.path.join(d, "training_state", "manifest.json") for d in (converted.directory, os.path.join(root, ours))
    ]
    steps = [json.load(open(m))["counters"]["global_steps"] for m in manifests]
    return differ + ([] if steps[0] == steps[1] == 1 else [f"steps {steps}"])


def _refused_spoiled(tmp_path, key: str, patterns: list[str], words: str) -> None:
    """A copy of DeepSpeed's AutoTP checkpoint whose first part records ``patterns`` under ``key``: its
    conversion refused with ``words``, nothing written."""
    import shutil

    import collgrad

    spoiled = tmp_path / "spoiled"
    shutil.rmtree(spoiled, ignore_errors=True)
    shutil.copytree(tmp_path / "ds", spoiled)
    model = spoiled / "step1" / "mp_rank_00_model_states.pt"
    found = torch.load(model, weights_only=False)
    found["universal_checkpoint_info"][key] = patterns
    torch.save(found, model)
    with pytest.raises(collgrad.CheckpointError, match=words):
        collgrad.convert_deepspeed_checkpoint(spoiled, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_an_autotp_training_state_resumes_without_tensor_parallelism_and_back(tmp_path):
    files = run_ranks(_save_under_autotp, 4, str(tmp_path), timeout=600)[0]
    assert "model.safetensors.index.json" in files and "training_state/manifest.json" in files
    # DeepSpeed's own AutoTP checkpoint (tensor-parallel 2 x data-parallel 2), converted: the same state
    assert _converted(str(tmp_path), "ds", "autotp") == []
    # what AutoTP recorded of its layout, spoiled: refused, naming why, before anything is written
    for key, patterns, words in [
        ("tp_replicated_parameter_patterns", ["^.*$"], "not an exact name"),  # never evaluated
        ("parameter_to_average_patterns", ["^up_proj\\.weight$"], "fused or undescribed layout"),
        ("parameter_with_row_parallelism_patterns", ["^up_proj\\.bias$"], "do not join"),
    ]:
        _refused_spoiled(tmp_path, key, patterns, words)
    for rank, resumed in enumerate(run_ranks(_resume_elsewhere, 2, str(tmp_path), timeout=600)):
        assert resumed.pop("trained on") == [], rank
        for where, (unequal, steps) in resumed.items():
            assert unequal == [] and steps == 1, (rank, where, unequal, steps)
    # at world 3, tensor-parallel 3: uneven shards read and written
    assert run_ranks(_uneven, 3, str(tmp_path), timeout=600) == [([], [], 1)] * 3
    assert _converted(str(tmp_path), "ds-uneven", "uneven") == []
