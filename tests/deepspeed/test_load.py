"""load_full_model into real DeepSpeed engines, 2 and 3 CPU ranks: every module weight and fp32 master is
the file's tensor (bitwise, after the documented cast), read against DeepSpeed's own accessors and
``GatheredParameters``; the engine trains on from the loaded state exactly as one built from the file's
weights; each rank reads only the bytes it holds under ZeRO-3 and no collective carries a weight; every
malformed checkpoint is refused on every rank with the model unchanged; an I/O error raises everywhere.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import attempt, run_ranks

# name: (stage, dtype, CPU offload)
CONFIGS = {
    "zero3_fp32": (3, "fp32", False),
    "zero3_bf16_offload": (3, "bf16", True),
    "zero2_bf16": (2, "bf16", False),
    "zero2_fp32_offload": (2, "fp32", True),
    "zero1_fp32": (1, "fp32", False),
    "zero1_bf16_optimizer": (1, "bf16_acc32", False),  # BF16_Optimizer: its masters through DeepSpeed's setter
    "zero0_fp32": (0, "fp32", False),
}
#: trained on after the load against an engine built from the file's weights (fp32: DeepSpeed keeps the
#: masters of a bf16 engine built from fp32 weights rounded to bf16, a load keeps the file's fp32 values)
TRAINED = ("zero3_fp32", "zero2_fp32_offload")
SHARD = 600  # bytes: the small model in several shards


def _model():
    from tests.deepspeed import models

    net = models.Net()
    net.register_buffer("seen", torch.arange(3, dtype=torch.float32))
    return net


def _pretrained():
    """The model whose weights the checkpoints hold: every tensor other than the engines' own."""
    net = _model()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        net.seen.copy_(torch.randn(3, generator=g))
    return net


def _config(stage, dtype, offload):
    from tests.deepspeed import models

    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}  # partitions, not whole copies
    cfg = models.config(stage, dtype=dtype, offload=offload, **extra)
    cfg["gradient_clipping"] = 0.0
    return cfg


def _state(eng):
    """The module's weights (whole: gathered under ZeRO-3) and the fp32 masters as DeepSpeed's own
    accessor returns them (the module's weights at stage 0), and the buffer. Collective."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = eng.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=eng.zero_optimization_stage() == 3):
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if eng.zero_optimization_stage() == 0:
        masters = {n: p.detach().float().clone() for n, p in trainable}
    else:
        masters = {n: safe_get_full_fp32_param(p) for n, p in trainable}
    return weights, masters, module.seen.clone()


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def _worker(rank, world, root):
    from safetensors.torch import save_file

    import collgrad
    from tests.counting import as_on_a_network_file_system, count_collectives
    from tests.deepspeed import models

    as_on_a_network_file_system()  # the small slices of ZeRO-3 exchanged, as where a call costs ~1 ms
    source = _pretrained()
    file = {k: v.detach().clone() for k, v in source.state_dict().items() if k != "tied_out.weight"}
    single = os.path.join(root, f"single-{world}.safetensors")
    sharded = os.path.join(root, f"sharded-{world}")
    shifted_path = os.path.join(root, f"shifted-{world}.safetensors")
    shifted = {k: v + 1 for k, v in file.items()}
    if rank == 0:
        save_file(file, single)
        save_file(shifted, shifted_path)
    collgrad.save_full_model(source, sharded, max_shard_bytes=SHARD)  # a plain module: rank 0 writes
    torch.distributed.barrier()
    plain = _model()  # a plain module (replicated, as under DDP): every rank reads every tensor whole
    loaded = collgrad.load_full_model(plain, sharded)
    out = {
        "plain": {
            "equal": _same({k: v for k, v in plain.state_dict().items() if k != "tied_out.weight"}, file),
            "tied": plain.tied_out.weight is plain.tied_in.weight,
            "bytes_read": loaded.bytes_read,
        }
    }
    out["kept plan"] = _kept_plan(rank, root, world, plain, file)
    for name, (stage, dtype, offload) in CONFIGS.items():
        eng = models.engine(_config(stage, dtype, offload), _model())
        path = single if name.startswith("zero2") else sharded
        low = eng.module.inp.weight.dtype
        shared = _shared_load(eng, shifted_path, shifted, low)  # first: the load below puts the file back
        with count_collectives() as seen:
            loaded = collgrad.load_full_model(eng, path)
        weights, masters, seen_buffer = _state(eng)
        entry = {
            "shared": shared,
            "calls": (seen.data, seen.agreements),
            "metadata": (seen.metadata, loaded.header_bytes),
            "weights": {
                n: torch.equal(w, file[n if n != "tied_out.weight" else "tied_in.weight"].to(low))
                for n, w in weights.items()
            },
            "masters": {
                n: torch.equal(m, file[n if n != "tied_out.weight" else "tied_in.weight"].float())
                for n, m in masters.items()
            },
            "collgrad_masters": _same(collgrad.safe_get_full_model_fp32_params(eng), masters),
            "buffer": torch.equal(seen_buffer, file["seen"]),
            "loaded": (loaded.tensors, loaded.missing_keys, loaded.unexpected_keys),
            "bytes_read": loaded.bytes_read,
        }
        if name in TRAINED:
            reference = models.engine(_config(stage, dtype, offload), _pretrained())
            for e in (eng, reference):
                models.run_backward(e, rank)
                e.step()
            ours, theirs = _state(eng), _state(reference)
            entry["trained"] = _same(ours[0], theirs[0]) and _same(ours[1], theirs[1])
        if name == "zero3_fp32":
            out["refusals"] = _refusals(eng, rank, world, root)
        out[name] = entry
    return out


def _shared_load(eng, path, file, low):
    """``eng`` loaded from ``path`` with what the ranks hold alike read once between them whatever its size
    (COLLGRAD_SHARED_READ_BYTES=0): each rank its turn, then one gather: the same state, bitwise."""
    import collgrad
    from tests.counting import count_collectives

    os.environ["COLLGRAD_SHARED_READ_BYTES"] = os.environ["COLLGRAD_FILE_SYSTEM_BYTES_PER_SECOND"] = "0"
    try:
        with count_collectives() as seen:
            loaded = collgrad.load_full_model(eng, path)
    finally:
        del os.environ["COLLGRAD_SHARED_READ_BYTES"], os.environ["COLLGRAD_FILE_SYSTEM_BYTES_PER_SECOND"]
    weights, masters, buffer = _state(eng)
    named = lambda n: n if n != "tied_out.weight" else "tied_in.weight"  # noqa: E731
    return {
        "equal": all(torch.equal(w, file[named(n)].to(low)) for n, w in weights.items())
        and all(torch.equal(m, file[named(n)].float()) for n, m in masters.items())
        and torch.equal(buffer, file["seen"]),
        "calls": (seen.data, seen.agreements),
        "metadata": (seen.metadata, loaded.header_bytes),
        "bytes_read": loaded.bytes_read,
    }


def _kept_plan(rank, root, world, plain, file) -> list[bool]:
    """A load's plan is kept for the next load of a checkpoint laid out the same into the same tensors:
    rewritten in place with other values, the file's new values are what a load reads; a parameter
    given a new tensor gets them too (the plan kept for the old one is not used)."""
    from safetensors.torch import save_file

    import collgrad

    again, other = os.path.join(root, f"again-{world}.safetensors"), {k: v + 1 for k, v in file.items()}
    seen = []
    for values, replace in ((other, False), (file, False), (other, True)):
        torch.distributed.barrier()
        if rank == 0:
            save_file(values, again)
        torch.distributed.barrier()
        if replace:
            plain.inp.weight.data = torch.zeros_like(plain.inp.weight)  # a new tensor where the plan had one
        collgrad.load_full_model(plain, again)
        seen.append(_same({k: v for k, v in plain.state_dict().items() if k != "tied_out.weight"}, values))
    return seen


def _raw(path, header, data: bytes) -> None:
    """A safetensors file as given: ``header`` a dict (as JSON) or raw bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def _bad_checkpoints(root, world, file) -> dict[str, tuple[str, bool]]:
    """Each malformed checkpoint (path, strict) by case; written by the caller's rank 0."""
    from safetensors.torch import save_file

    base = os.path.join(root, f"bad-{world}")
    os.makedirs(base, exist_ok=True)
    cases = {}

    def path(case):
        return os.path.join(base, f"{case}.safetensors")

    one = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    with open(path("header_past_end"), "wb") as f:
        f.write(struct.pack("<Q", 10**6) + b"{}")
    _raw(path("invalid_json"), b"{not json", b"")
    _raw(path("unknown_dtype"), {"x": dict(one, dtype="Q7")}, bytes(8))
    _raw(path("overlapping"), {"x": one, "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    _raw(path("out_of_file"), {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    _raw(path("size_mismatch"), {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    save_file(file, path("truncated"))
    size = os.path.getsize(path("truncated"))
    with open(path("truncated"), "r+b") as f:
        f.truncate(size - 40)
    for case in (
        "header_past_end",
        "invalid_json",
        "unknown_dtype",
        "overlapping",
        "out_of_file",
        "size_mismatch",
        "truncated",
    ):
        cases[case] = (path(case), True)
    # indexes that name shards outside the checkpoint's directory
    outside = os.path.join(root, f"outside-{world}.safetensors")
    save_file(file, outside)
    for case, shard in (
        ("index_parent", f"../outside-{world}.safetensors"),
        ("index_absolute", outside),
        ("symlink_out", "link.safetensors"),
    ):
        directory = os.path.join(base, case)
        os.makedirs(directory, exist_ok=True)
        if case == "symlink_out":
            os.symlink(outside, os.path.join(directory, shard))
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: shard for k in file}}, f)
        cases[case] = (directory, True)
    # names and shapes that do not match the model
    missing = dict(file)
    missing.pop("mid.bias")
    save_file(missing, path("missing_key"))
    save_file(dict(file, extra=torch.zeros(2)), path("unexpected_key"))
    save_file(dict(file, **{"mid.bias": torch.zeros(4)}), path("wrong_shape"))
    cases["missing_key"] = (path("missing_key"), True)
    cases["unexpected_key"] = (path("unexpected_key"), True)
    cases["wrong_shape"] = (path("wrong_shape"), True)
    cases["wrong_shape_not_strict"] = (path("wrong_shape"), False)
    return cases


def _refusals(eng, rank, world, root):
    """Every malformed checkpoint refused on every rank, the model unchanged; strict=False; an I/O error."""
    import collgrad

    file = {k: v for k, v in _pretrained().state_dict().items() if k != "tied_out.weight"}
    if rank == 0:
        _bad_checkpoints(root, world, file)
    torch.distributed.barrier()
    base = os.path.join(root, f"bad-{world}")
    before = _state(eng)
    out = {}
    for case in REFUSED:
        name = "wrong_shape" if case == "wrong_shape_not_strict" else case
        directory = os.path.join(base, name)
        path = directory if os.path.isdir(directory) or case == "no_such_path" else f"{directory}.safetensors"
        strict = case != "wrong_shape_not_strict"
        out[case] = attempt(lambda path=path, strict=strict: collgrad.load_full_model(eng, path, strict=strict))
    # ranks that see other files (the same tensors, names, dtypes and shapes, laid out otherwise: a directory
    # that is not shared): the places each would read for another differ, refused on every rank
    single, sharded = os.path.join(root, f"single-{world}.safetensors"), os.path.join(root, f"sharded-{world}")
    out["other_files"] = attempt(lambda: collgrad.load_full_model(eng, single if rank == 0 else sharded))
    after = _state(eng)
    out["unchanged"] = all(_same(a, b) for a, b in zip(before[:2], after[:2])) and torch.equal(before[2], after[2])
    # strict=False: what matches is loaded, the rest named
    partial = attempt(
        lambda: collgrad.load_full_model(eng, os.path.join(base, "missing_key.safetensors"), strict=False), keep=True
    )
    extra = attempt(
        lambda: collgrad.load_full_model(eng, os.path.join(base, "unexpected_key.safetensors"), strict=False), keep=True
    )
    out["not_strict"] = (
        partial["error"],
        partial.get("value") and partial["value"].missing_keys,
        extra["error"],
        extra.get("value") and extra["value"].unexpected_keys,
    )
    # an I/O error on rank 0 while reading (after the checks): every rank raises
    real = os.preadv

    def failing(fd, buffers, offset):
        raise OSError(5, os.strerror(5))

    os.preadv = failing if rank == 0 else real
    try:
        out["io_error"] = attempt(
            lambda: collgrad.load_full_model(eng, os.path.join(base, "unexpected_key.safetensors"), strict=False)
        )
    finally:
        os.preadv = real
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp(f"load{request.param}"))
    return request.param, run_ranks(_worker, request.param, root, timeout=600)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_weight_and_master_is_the_files_tensor(results, config):
    _, per_rank = results
    for res in per_rank:
        entry = res[config]
        assert all(entry["weights"].values()), {k: v for k, v in entry["weights"].items() if not v}
        assert all(entry["masters"].values()), {k: v for k, v in entry["masters"].items() if not v}
        assert entry["collgrad_masters"] and entry["buffer"]
        assert entry["loaded"] == (13, (), ())  # 12 parameters (the tied one once) and the buffer


@pytest.mark.parametrize("config", list(CONFIGS))
def test_what_every_rank_holds_alike_read_once_between_them_loads_the_same(results, config):
    """With sharing forced on (COLLGRAD_SHARED_READ_BYTES=0): every weight, master and the buffer the
    file's, bitwise; one gather carries what the ranks hold alike; below ZeRO-3 (every rank holds the
    weights whole) each rank reads less than the whole file and together they read it about once."""
    world, per_rank = results
    total = sum(t.numel() * t.element_size() for k, t in _pretrained().state_dict().items() if k != "tied_out.weight")
    for rank, res in enumerate(per_rank):
        shared = res[config]["shared"]
        assert shared["equal"], config
        # where what the ranks hold alike is shared, so is the metadata: the index and the headers read by
        # rank 0 alone, sent to the others in one broadcast (and its length)
        broadcasts, header_bytes = shared["metadata"]
        assert broadcasts == 2 and (header_bytes > 0) == (rank == 0), (config, rank, broadcasts, header_bytes)
        data, agreements = shared["calls"]
        # one gather window (under ZeRO-3 also the exchange of its small slices) and the load's two
        # agreements (the first gather on the group agrees its capabilities)
        assert data == 1 + _exchanges(config) and agreements in (2, 3), (config, shared["calls"])
    if CONFIGS[config][0] < 3 and config != "zero1_bf16_optimizer":  # BF16_Optimizer: masters through its setter
        read = [res[config]["shared"]["bytes_read"] for res in per_rank]
        assert all(r < total for r in read) and sum(read) < 1.5 * total, (config, read, total)


def _exchanges(config: str) -> int:
    """The all-to-alls of a load of this small model: under ZeRO-3 every slice is small (a few hundred
    bytes): each tensor read by one rank and its slices sent to their holders, in one window."""
    return 1 if CONFIGS[config][0] == 3 else 0


@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_collective_carries_a_weight_but_small_slices_exchanged(results, config):
    _, per_rank = results
    for rank, res in enumerate(per_rank):
        data, agreements = res[config]["calls"]
        assert data == _exchanges(config) and agreements == 2, (config, data, agreements)
        # the index and the headers read by every rank at this world (on these costs one read and a
        # broadcast do not pay: IoCosts.shares)
        broadcasts, header_bytes = res[config]["metadata"]
        assert broadcasts == 0 and header_bytes > 0, (config, rank, broadcasts, header_bytes)


def test_a_plain_module_loads_whole_on_every_rank(results):
    _, per_rank = results
    total = sum(t.numel() * t.element_size() for k, t in _pretrained().state_dict().items() if k != "tied_out.weight")
    for res in per_rank:
        assert res["plain"] == {"equal": True, "tied": True, "bytes_read": total}


def test_a_kept_plan_reads_the_files_values_into_the_models_tensors(results):
    _, per_rank = results
    assert all(res["kept plan"] == [True, True, True] for res in per_rank)


def test_each_rank_reads_only_its_share_under_zero3(results):
    world, per_rank = results
    total = sum(t.numel() * t.element_size() for k, t in _pretrained().state_dict().items() if k != "tied_out.weight")
    buffer = 3 * 4  # read whole by every rank
    read = [res["zero3_fp32"]["bytes_read"] for res in per_rank]
    # every element of every parameter read exactly once over the ranks (small slices: each tensor by one
    # rank, which sends the others theirs), the buffer by each
    assert sum(read) == total - buffer + world * buffer, read
    assert all(r < total for r in read)
    # below ZeRO-3 every rank holds the module's weights whole: it reads them whole, once
    assert all(res["zero1_fp32"]["bytes_read"] == total for res in per_rank)


@pytest.mark.parametrize("config", TRAINED)
def test_training_goes_on_as_from_an_engine_built_from_the_file(results, config):
    _, per_rank = results
    assert all(res[config]["trained"] for res in per_rank)


REFUSED = {
    "header_past_end": "the header claims",
    "invalid_json": "not valid JSON",
    "unknown_dtype": "dtype 'Q7'",
    "overlapping": "overlaps",
    "out_of_file": "data section",
    "size_mismatch": "bytes for shape",
    "truncated": "",
    "index_parent": "outside the checkpoint's directory",
    "index_absolute": "outside the checkpoint's directory",
    "symlink_out": "resolves outside the checkpoint's directory",
    "missing_key": "missing from the checkpoint: mid.bias",
    "unexpected_key": "not in the model: extra",
    "wrong_shape": "mid.bias: [4] in the checkpoint, [9] in the model",
    "wrong_shape_not_strict": "mid.bias: [4] in the checkpoint",
    "no_such_path": "no such file or directory",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_checkpoint_is_refused_on_every_rank(results, case):
    _, per_rank = results
    for rank, res in enumerate(per_rank):
        got = res["refusals"][case]
        assert got["error"] == "CheckpointError" and "ValueError" in got["is_a"], (rank, got)
        assert REFUSED[case] in got["message"] and got["seconds"] < 10, (rank, got)


def test_ranks_that_see_other_files_are_refused_on_every_rank(results):
    """``Checkpoint.digest``, what the ranks compare: the same tensors in one file on rank 0 and in shards on
    the others are other checkpoints (a shared read would take bytes from places another rank lacks)."""
    _, per_rank = results
    for rank, res in enumerate(per_rank):
        got = res["refusals"]["other_files"]
        assert got["error"] == "ArgumentMismatchError", (rank, got)
        assert "their names and headers" in got["message"] and got["seconds"] < 10, (rank, got)


def test_the_model_is_unchanged_by_every_refusal(results):
    _, per_rank = results
    assert all(res["refusals"]["unchanged"] for res in per_rank)


def test_not_strict_loads_what_matches_and_names_the_rest(results):
    _, per_rank = results
    for res in per_rank:
        assert res["refusals"]["not_strict"] == (None, ("mid.bias",), None, ("extra",))


def test_an_io_error_on_one_rank_raises_on_every_rank(results):
    _, per_rank = results
    assert per_rank[0]["refusals"]["io_error"]["error"] == "CollgradError"
    assert "Input/output error" in per_rank[0]["refusals"]["io_error"]["message"]
    for res in per_rank[1:]:
        assert res["refusals"]["io_error"]["error"] == "RankFailedError", res["refusals"]["io_error"]
