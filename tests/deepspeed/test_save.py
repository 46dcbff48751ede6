"""save_full_model on real DeepSpeed engines, 2 and 3 CPU ranks: the shards load with ``safetensors``,
hold every entry of the module's ``state_dict`` (frozen parameters, persistent buffers, a tied weight
once), bitwise equal to ``_zero3_consolidated_16bit_state_dict()`` (ZeRO-3), to the module's own weights
(ZeRO-1/2, stage 0) and, with ``dtype=torch.float32``, to DeepSpeed's fp32 master weights; split across
writing ranks; one collective per bucket; and a failure on one rank (a bad directory, a full disk)
raises on every rank and leaves no shard under a final name.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import attempt, run_ranks

# name: (stage, dtype)
CONFIGS = {
    "zero3_fp32": (3, "fp32"),
    "zero3_bf16": (3, "bf16"),
    "zero3_fp16": (3, "fp16"),
    "zero2_bf16": (2, "bf16"),
    "zero1_fp32": (1, "fp32"),
    "zero0_fp32": (0, "fp32"),
}
SHARD = 600  # bytes: the small model in several shards


def _model():
    from tests.deepspeed import models

    net = models.Net()
    net.register_buffer("seen", torch.arange(3, dtype=torch.float32))  # persistent: saved
    net.register_buffer("scratch", torch.ones(2), persistent=False)  # not in state_dict: not saved
    return net


def _load(directory: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of the checkpoint, through the index (or the single file), with safetensors."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(directory) if not f.startswith("."))
    index_path = os.path.join(directory, "model.safetensors.index.json")
    shards = sorted(set(json.load(open(index_path))["weight_map"].values())) if os.path.exists(index_path) else []
    out = {}
    for shard in shards or ["model.safetensors"]:
        with safe_open(os.path.join(directory, shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out, files


def _expected(eng, rank: int, fp32: bool) -> dict[str, torch.Tensor] | None:
    """What the checkpoint must hold, on rank 0: DeepSpeed's consolidated 16-bit state dict (ZeRO-3) or
    the module's state_dict, without the tied alias; with ``fp32``, DeepSpeed's fp32 master weights for
    the trainable parameters. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = eng.module
    if eng.zero_optimization_stage() == 3:
        full = eng._zero3_consolidated_16bit_state_dict()
    else:
        full = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if eng.zero_optimization_stage() == 0:  # no master copy: the module's weights (DeepSpeed's accessor: None)
        masters = {n: p.detach().float() for n, p in trainable}
    else:
        masters = {n: safe_get_full_fp32_param(p) for n, p in trainable}
    if rank != 0:
        return None
    full.pop("tied_out.weight")  # tied to tied_in.weight: stored once, as save_pretrained does
    if fp32:
        full = {k: (masters[k] if k in masters else v.float()) for k, v in full.items()}
    return full


def _worker(rank, world, root):
    from deepspeed.accelerator import get_accelerator

    import collgrad
    from tests.counting import count_collectives
    from tests.deepspeed import models

    # DeepSpeed's CPU accelerator refuses fp16 only for want of oneDNN fp16 (see test_write.py)
    type(get_accelerator()).is_fp16_supported = lambda self: True
    out = {}
    for name, (stage, dtype) in CONFIGS.items():
        eng = models.engine(models.config(stage, dtype=dtype), _model())
        models.run_backward(eng, rank)
        eng.step()
        entry = {}
        for fp32 in (False, True):
            directory = os.path.join(root, f"{name}-{world}-{'fp32' if fp32 else 'own'}")
            expected = _expected(eng, rank, fp32)
            with count_collectives() as seen:
                saved = collgrad.save_full_model(
                    eng, directory, dtype=torch.float32 if fp32 else None, max_shard_bytes=SHARD
                )
            torch.distributed.barrier()
            result = {"calls": (seen.data, seen.agreements), "saved": (saved.files, saved.tensors, saved.bytes)}
            result["shared"] = (saved.shared, saved.bytes_written, saved.written_here)
            if rank == 0:
                loaded, files = _load(directory)
                # the shards, the index, each rank's hash file and their record
                hashed = len(saved.hash_files) == world + 1
                result["files"] = files == sorted(saved.files + saved.hash_files) and hashed
                result["names"] = sorted(loaded) == sorted(expected)
                result["equal"] = {k: torch.equal(loaded[k], expected[k]) for k in expected if k in loaded}
                result["dtypes"] = sorted({str(t.dtype) for t in loaded.values()})
                result["bytes"] = saved.bytes == sum(t.numel() * t.element_size() for t in loaded.values())
                shards = [f for f in saved.files if f.endswith(".safetensors")]
                result["file_bytes"] = sum(os.path.getsize(os.path.join(directory, f)) for f in shards)
            entry["fp32" if fp32 else "own"] = result
        out[name] = entry
        if name == "zero3_bf16":
            out.update(_failures(eng, rank, world, root))
    return out


def _failures(eng, rank, world, root):
    """Two writing ranks; a bad directory; a full disk on rank 0; different arguments per rank."""
    import collgrad

    out = {}
    # two writing ranks: the shards alternate between them
    both = collgrad.save_full_model(eng, os.path.join(root, f"both-{world}"), max_shard_bytes=SHARD, ranks=(0, 1))
    out["both"] = {"files": both.files, "here": both.written_here, "shared": both.shared}
    # a subset of the parameters (and then no buffers), converted to bf16
    subset = os.path.join(root, f"subset-{world}")
    some = collgrad.save_full_model(eng, subset, params=["inp.weight", "scale"], dtype=torch.bfloat16)
    out["subset"] = {"files": some.files, "tensors": some.tensors}
    if rank == 0:
        loaded, _ = _load(subset)
        out["subset"]["loaded"] = {k: (str(t.dtype), tuple(t.shape)) for k, t in loaded.items()}
    # saved again into the same directory, now in shards: the single file of before is gone
    again = collgrad.save_full_model(eng, subset, max_shard_bytes=SHARD)
    torch.distributed.barrier()
    out["again"] = (sorted(f for f in os.listdir(subset) if not f.startswith(".")), again.files)
    # a bad directory on the writing rank: a path under a file
    blocker = os.path.join(root, f"blocker-{world}")
    open(blocker, "w").close()
    out["bad_directory"] = attempt(lambda: collgrad.save_full_model(eng, os.path.join(blocker, "x")))
    # a full disk while rank 0 writes: every rank raises, nothing is left
    real, writes = os.pwrite, []

    def full_disk(fd, data, offset):
        writes.append(offset)
        if len(writes) == 2 and rank == 0:  # its first data, after a header
            raise OSError(28, os.strerror(28))
        return real(fd, data, offset)

    os.pwrite = full_disk
    failing = os.path.join(root, f"full-{world}")
    try:
        out["full_disk"] = attempt(lambda: collgrad.save_full_model(eng, failing, max_shard_bytes=SHARD))
    finally:
        os.pwrite = real
    torch.distributed.barrier()
    out["left_behind"] = sorted(os.listdir(failing))
    out["different"] = attempt(lambda: collgrad.save_full_model(eng, os.path.join(root, f"d{rank}-{world}")))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp(f"save{request.param}"))
    return request.param, run_ranks(_worker, request.param, root, timeout=600)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("which", ["own", "fp32"])
def test_the_checkpoint_holds_the_state_dict_bitwise(results, config, which):
    _, per_rank = results
    entry = per_rank[0][config][which]
    assert entry["files"] and entry["names"] and entry["bytes"], entry
    assert entry["equal"] and all(entry["equal"].values()), {k: v for k, v in entry["equal"].items() if not v}
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(CONFIGS[config][1])
    # dtype=None keeps the model's dtype (the fp32 buffer stays fp32); dtype=float32 writes fp32 only
    assert entry["dtypes"] == (["torch.float32"] if which == "fp32" or low is None else sorted([low, "torch.float32"]))
    files, tensors, _ = entry["saved"]
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"  # several shards, then the index
    assert tensors == 13  # 12 parameters (the tied one once, the frozen ones) and the persistent buffer


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_collective_per_bucket(results, config):
    _, per_rank = results
    for res in per_rank:
        for which in ("own", "fp32"):
            data, agreements = res[config][which]["calls"]
            # the small model is one bucket; below ZeRO-3 every rank holds the module's weights whole (none),
            # and the fp32 master weights of the trainable ones are partitioned (one) but at stage 0
            stage = CONFIGS[config][0]
            weights = 1 if stage == 3 else 0
            masters = 1 if stage > 0 and which == "fp32" else 0
            frozen = weights if which == "fp32" else 0  # with dtype=, the frozen ones come apart
            assert data == (masters + frozen if which == "fp32" else weights), (config, which, data)
            assert agreements >= 3


@pytest.mark.parametrize("config", list(CONFIGS))
def test_by_default_the_ranks_share_the_writing(results, config):
    """Every rank sees the one directory here: each writes its run of the checkpoint's bytes into the
    shards, rank 0 the headers too and puts every file in place; together, every byte once."""
    world, per_rank = results
    for which in ("own", "fp32"):
        files, _, data_bytes = per_rank[0][config][which]["saved"]
        written = [res[config][which]["shared"] for res in per_rank]
        assert all(shared for shared, _, _ in written), written
        assert all(count > 0 for _, count, _ in written), written
        # every byte of the shards (headers and tensors) written once, by one rank
        assert sum(count for _, count, _ in written) == per_rank[0][config][which]["file_bytes"], written
        # about 1/world of the tensors' bytes each (a rank's run ends at a tensor's edge)
        assert max(count for _, count, _ in written[1:]) < data_bytes / world + SHARD, written
        assert written[0][2] == files and all(here == () for _, _, here in written[1:])


def test_shards_alternate_between_writing_ranks(results):
    _, per_rank = results
    assert not any(res["both"]["shared"] for res in per_rank)  # ranks= given: those ranks write whole shards
    files = per_rank[0]["both"]["files"]
    assert per_rank[0]["both"]["here"] == tuple(files[0:-1:2]) + (files[-1],)  # and the index
    assert per_rank[1]["both"]["here"] == tuple(files[1:-1:2])


def test_a_failure_on_one_rank_raises_on_every_rank_and_leaves_no_shard(results):
    _, per_rank = results
    for rank, res in enumerate(per_rank):
        for case in ("bad_directory", "full_disk"):
            expected = "CollgradError" if rank == 0 else "RankFailedError"
            assert res[case]["error"] == expected, (rank, case, res[case])
        assert "No space left" in res["full_disk"]["message"]
        assert res["left_behind"] == []  # neither final names nor temporary files
        assert res["different"]["error"] == "ArgumentMismatchError", res["different"]


def test_a_subset_of_the_parameters_in_another_dtype(results):
    _, per_rank = results
    subset = per_rank[0]["subset"]
    assert subset["files"] == ("model.safetensors",) and subset["tensors"] == 2
    assert subset["loaded"] == {"inp.weight": ("torch.bfloat16", (9, 7)), "scale": ("torch.bfloat16", (1,))}


def test_a_save_into_a_used_directory_leaves_no_weights_of_the_earlier_one(results):
    _, per_rank = results
    listed, files = per_rank[0]["again"]
    assert "model.safetensors" not in listed and set(files) <= set(listed)
    assert [f for f in listed if f.endswith(".safetensors")] == [f for f in files if f.endswith(".safetensors")]
