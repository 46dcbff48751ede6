"""Checkpoints that prove their bytes: a training state's save (and ``save_full_model``'s) records the
hash of every piece each rank wrote; ``python -m collgrad verify`` exits 0 on an intact copy and non-zero
naming the file where one byte of an optimizer state or of the weights is flipped; a load that reads
that file (``load_training_state``, ``load_full_model``) raises on every rank, naming it, with the
model, its masters and its optimizer exactly as before (no optimizer state created in an engine that
never stepped), also after the optimizer has stepped."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import contextlib
import io
import json
import os
import shutil
import struct

import torch

from tests.harness import attempt, run_ranks

KEYS = ("exp_avg", "exp_avg_sq")


#: A frozen parameter: the weights a training state's load reads (trainable ones come from the masters).
FROZEN = "frozen.weight"


def _flip(path: str, stem: str) -> str:
    """One byte flipped in the first file of ``stem`` (``model``: in the frozen parameter's bytes;
    ``optimizer-0``: in its first tensor's); that file's name in the checkpoint."""
    folder = path if stem == "model" else os.path.join(path, "training_state")
    stems = (stem + "-", stem + ".safetensors")
    for file in sorted(f for f in os.listdir(folder) if f.startswith(stems) and f.endswith(".safetensors")):
        where = os.path.join(folder, file)
        with open(where, "r+b") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            name = FROZEN if stem == "model" else next(n for n in header if n != "__metadata__")
            if name not in header:
                continue
            at = 8 + size + header[name]["data_offsets"][0] + 1
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
        return os.path.relpath(where, path)
    raise AssertionError(f"no file of {stem} holds the tensor")


def _engine():
    from tests.deepspeed import models

    assert not models.Net().get_parameter(FROZEN).requires_grad
    return models.engine(models.config(2))


def _state(eng) -> dict[str, torch.Tensor]:
    import collgrad

    out = {f"fp32/{n}": t.clone() for n, t in collgrad.safe_get_full_model_fp32_params(eng).items()}
    for key in KEYS:
        out.update(
            (f"{key}/{n}", t.clone()) for n, t in collgrad.safe_get_full_model_optimizer_states(eng, key).items()
        )
    out.update((f"weights/{n}", p.detach().clone()) for n, p in eng.module.named_parameters())
    return out


def _unchanged(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _worker(rank, world, root):
    import collgrad
    from tests.deepspeed import models

    eng = _engine()
    models.run_backward(eng, rank)
    eng.step()
    good = os.path.join(root, "good")
    saved = collgrad.save_training_state(eng, good)
    whole = os.path.join(root, "full")
    full = collgrad.save_full_model(eng, whole)
    flipped = {}
    for stem, source in (("optimizer-0", good), ("model", good), ("full", whole)):
        path = os.path.join(root, f"flipped-{stem}")
        if rank == 0:
            shutil.copytree(source, path)
            flipped[stem] = (path, _flip(path, "model" if stem == "full" else stem))
        torch.distributed.barrier()
    out = {"hash files": sorted(f for f in saved.files if f.startswith("training_state/hashes-"))}
    out["full hash files"] = sorted(f for f in os.listdir(whole) if f.startswith("model.safetensors.hashes"))
    out["full written"] = full.bytes_written > 0
    out["intact load"] = attempt(lambda: collgrad.load_training_state(eng, good).bytes_read)["error"]
    out["intact full load"] = attempt(lambda: collgrad.load_full_model(eng, whole))["error"]
    for when in ("saved", "stepped"):
        if when == "stepped":  # the optimizer has stepped once since the save
            models.run_backward(eng, rank, micro_steps=1)
            eng.step()
        before = _state(eng)
        for stem in ("optimizer-0", "model", "full"):
            path = os.path.join(root, f"flipped-{stem}")
            load = collgrad.load_full_model if stem == "full" else collgrad.load_training_state
            found = attempt(lambda p=path, load=load: load(eng, p))
            out[(when, stem)] = (found["error"], found.get("message", ""), _unchanged(before, _state(eng)))
    bad = os.path.join(root, "flipped-full")  # verify=False: what is there loads, the flipped bit with it
    out["unverified"] = attempt(lambda: collgrad.load_full_model(eng, bad, verify=False))["error"]
    fresh = _engine()  # never stepped: no optimizer state, and none made by a refusal
    found = attempt(lambda: collgrad.load_training_state(fresh, os.path.join(root, "flipped-optimizer-0")))
    out["fresh"] = (found["error"], len(fresh.optimizer.optimizer.state))
    return out, flipped


def _verify(path: str) -> tuple[int, str]:
    from collgrad.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["verify", path])
    return status, err.getvalue()


def test_a_flipped_byte_is_named_by_verify_and_refused_by_the_load_on_every_rank(tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path), timeout=300)
    flipped = results[0][1]
    assert _verify(str(tmp_path / "good")) == (0, "") and _verify(str(tmp_path / "full")) == (0, "")
    for stem, (path, file) in flipped.items():
        status, said = _verify(path)
        assert status == 1 and file in said and "do not hash" in said, (stem, status, said)
    for rank, (res, _) in enumerate(results):
        assert len(res["hash files"]) == 2 and res["intact load"] is None, res  # each rank wrote its part
        assert res["full hash files"] == [
            "model.safetensors.hashes-00000.json",
            "model.safetensors.hashes-00001.json",
            "model.safetensors.hashes.json",
        ]
        assert res["full written"] and res["intact full load"] is None and res["unverified"] is None, res
        for when in ("saved", "stepped"):
            for stem, (_, file) in flipped.items():
                error, message, unchanged = res[(when, stem)]
                assert error == "CheckpointError" and file in message, (rank, when, stem, message)
                assert unchanged, (rank, when, stem)
        assert res["fresh"] == ("CheckpointError", 0), res["fresh"]
