"""save_training_state / load_training_state across world sizes, ZeRO stages and frameworks, on real CPU
ranks: three launches (2 ranks, then 3, then 2 again) share one directory of checkpoints.

    world 2   ZeRO-2 fp32 + CPU offload, ZeRO-3 bf16, ZeRO-1 fp32, FSDP2, a plain module: each trained 2
              steps, saved, trained 2 more; loaded back into itself (the saved state bitwise, then the same
              2 steps bitwise the uninterrupted run); stages crossed (ZeRO-2 -> ZeRO-3 -> ZeRO-1), ZeRO-1
              -> FSDP2 -> ZeRO-2; a save that fails on one rank; every malformed checkpoint refused
    world 3   fresh engines (never stepped) and FSDP2 resume world 2's checkpoints, bitwise; one step on
              close to plain PyTorch from the same state; a refused load removes the states it created
    world 2   a fresh engine resumes world 3's checkpoint, bitwise

Every comparison is against the frameworks' own accessors (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``, ``GatheredParameters``, ``full_tensor()``), recorded before the save.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")

import torch

from tests.harness import attempt, run_ranks

KEYS = ("exp_avg", "exp_avg_sq")
LR = 1e-3
#: name: (stage, dtype, CPU offload, ZeRO-3 persistence threshold)
ENGINES = {
    "zero2_offload": (2, "fp32", True, None),
    "zero3_bf16": (3, "bf16", False, 0),
    "zero1": (1, "fp32", False, None),
    "bf16_optimizer": (1, "bf16_acc32", False, None),  # its masters and states through DeepSpeed's accessors
    "zero2_fp16": (2, "fp16", False, None),  # its dynamic loss scaler saved and put back
}
#: the engines whose DeepSpeed checkpoint (``save_checkpoint``, beside collgrad's) is converted
CONVERTED = ("zero1", "zero2_offload", "zero3_bf16", "bf16_optimizer")


def _engine(stage, dtype, offload, threshold=None):
    from tests.deepspeed import models

    extra = {} if threshold is None else {"stage3_param_persistence_threshold": threshold}
    cfg = models.config(stage, dtype=dtype, offload=offload, **extra)
    cfg["gradient_clipping"] = 0.0
    return models.engine(cfg, models.Net())


def _train(eng, rank, first, steps=2):
    from tests.deepspeed import models

    for step in range(first, first + steps):
        models.run_backward(eng, rank, batch=lambda r, m, dtype, s=step: models.batch(r, s, dtype))
        eng.step()


def _recorded(eng) -> dict:
    """DeepSpeed's own view of the training state: every trainable parameter's fp32 master and Adam
    states (its accessors), every module weight gathered whole. Collective."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    module = eng.module
    out = {"fp32": {}, **{k: {} for k in KEYS}}
    for n, p in module.named_parameters():
        if p.requires_grad:
            out["fp32"][n] = safe_get_full_fp32_param(p).clone()
            for k in KEYS:
                out[k][n] = safe_get_full_optimizer_state(p, k).clone()
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=eng.zero_optimization_stage() == 3):
        out["weights"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["steps"] = eng.global_steps
    out["optimizer steps"] = _steps_of(eng)
    scaler = eng.optimizer.loss_scaler if eng.fp16_enabled() else None
    out["scaler"] = None if scaler is None else (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter)
    return out


def _fsdp2(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.deepspeed import models

    net = models.Net()
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    return net, torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=LR)


def _fsdp2_train(net, opt, rank, first, steps=1):
    from tests.deepspeed import models

    for step in range(first, first + steps):
        x, y = models.batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()


def _fsdp2_recorded(net, opt) -> dict:
    out = {"fp32": {}, **{k: {} for k in KEYS}}
    for n, p in net.named_parameters():
        if p.requires_grad:
            out["fp32"][n] = p.full_tensor().clone()
            for k in KEYS:
                out[k][n] = opt.state[p][k].full_tensor().clone()
    out["weights"] = {n: p.full_tensor().clone() for n, p in net.named_parameters()}
    return out


def _fsdp2_steps(net, opt) -> dict:
    return {**_fsdp2_recorded(net, opt), "steps": sorted({float(s["step"]) for s in opt.state.values()})}


def _equal(ours: dict, theirs: dict, kinds=("fp32", *KEYS)) -> dict[str, bool]:
    """Per kind: every tensor of ``theirs`` bitwise equal in ``ours``."""
    return {
        k: ours[k].keys() == theirs[k].keys() and all(torch.equal(ours[k][n], theirs[k][n]) for n in theirs[k])
        for k in kinds
    }


def _weights_are_masters(rec: dict) -> bool:
    """The module's weights are the masters in the module's dtype (frozen ones as they are)."""
    return all(torch.equal(rec["weights"][n], m.to(rec["weights"][n].dtype)) for n, m in rec["fp32"].items())


def _steps_of(eng) -> list[float]:
    """The step count of every state of the optimizer DeepSpeed wraps (one per flat partition)."""
    inner = eng.optimizer.optimizer
    return sorted({float(s["step"]) for s in inner.state.values()})


def _dump(root, name, rank, value) -> None:
    if rank == 0:
        torch.save(value, os.path.join(root, f"{name}.pt"))
    torch.distributed.barrier()


def _kept(root, name) -> dict:
    return torch.load(os.path.join(root, f"{name}.pt"), weights_only=True)


# ---------------------------------------------------------------------------------------------- world 2


def _first(rank, world, root):
    from deepspeed.accelerator import get_accelerator

    from collgrad import load_training_state, save_training_state

    # DeepSpeed's CPU accelerator refuses fp16 only for want of oneDNN fp16 (see test_write.py)
    type(get_accelerator()).is_fp16_supported = lambda self: True

    out: dict = {}
    engines = {}
    for name, spec in ENGINES.items():
        eng = _engine(*spec)
        _train(eng, rank, 0)
        saved = save_training_state(eng, os.path.join(root, name))
        if name in CONVERTED:  # DeepSpeed's own checkpoint of the same state, for convert (the fixture)
            eng.save_checkpoint(os.path.join(root, "ds", name))
        before = _recorded(eng)
        _dump(root, name, rank, before)
        _train(eng, rank, 2)
        uninterrupted = _recorded(eng)
        loaded = load_training_state(eng, os.path.join(root, name))
        back = _recorded(eng)
        _train(eng, rank, 2)
        resumed = _recorded(eng)
        out[name] = {
            "saved": (saved.tensors, len(saved.files), saved.bytes_written > 0),
            "back": _equal(back, before, ("fp32", *KEYS, "weights")),
            "counters": (back["steps"], resumed["steps"]),
            "optimizer steps": (back["optimizer steps"], before["optimizer steps"], resumed["optimizer steps"]),
            "scaler": (back["scaler"] == before["scaler"], resumed["scaler"] == uninterrupted["scaler"]),
            "uninterrupted optimizer steps": uninterrupted["optimizer steps"],
            "resumed": _equal(resumed, uninterrupted, ("fp32", *KEYS, "weights")),
            "loaded": (loaded.tensors, loaded.states, loaded.created_states, loaded.missing_keys),
        }
        engines[name] = (eng, before)
    # across stages: ZeRO-2's checkpoint into the ZeRO-3 engine, ZeRO-3's into the ZeRO-1 engine, what the
    # ranks hold alike (ZeRO-1's weights) read once between them
    for source, target in (("zero2_offload", "zero3_bf16"), ("zero3_bf16", "zero1")):
        eng = engines[target][0]
        with _sharing():
            load_training_state(eng, os.path.join(root, source))
        got = _recorded(eng)
        out[f"{source} -> {target}"] = {**_equal(got, engines[source][1]), "weights": _weights_are_masters(got)}
    # ZeRO-1 -> FSDP2 -> ZeRO-2
    net, opt = _fsdp2(world)
    load_training_state(net, os.path.join(root, "zero1"), optimizer=opt)
    got = _fsdp2_recorded(net, opt)
    out["zero1 -> fsdp2"] = {
        **_equal(got, engines["zero1"][1]),
        "steps": sorted({float(s["step"]) for s in opt.state.values()}),
    }
    out["fsdp2 trains as plain pytorch"] = _trains_as_plain(
        lambda: _fsdp2_train(net, opt, rank, 2), lambda: _fsdp2_recorded(net, opt), engines["zero1"][1], world
    )
    save_training_state(net, os.path.join(root, "fsdp2"), optimizer=opt)
    fsdp2 = _fsdp2_recorded(net, opt)
    _dump(root, "fsdp2", rank, fsdp2)
    eng = engines["zero2_offload"][0]
    load_training_state(eng, os.path.join(root, "fsdp2"))
    out["fsdp2 -> zero2_offload"] = {**_equal(_recorded(eng), fsdp2), "steps": _steps_of(eng)}
    out["async"] = {
        name: _async_save(root, name, eng, lambda e=eng: _train(e, rank, 4), lambda e=eng: _recorded(e))
        for name in ("zero2_offload", "zero3_bf16")
        for eng in [engines[name][0]]
    }
    out["async"]["fsdp2"] = _async_save(
        root, "fsdp2", net, lambda: _fsdp2_train(net, opt, rank, 4, 2), lambda: _fsdp2_steps(net, opt), opt
    )
    out["plain"] = _plain(rank, root)
    out["failed save"] = _failed_save(engines["zero1"][0], rank, root, engines["zero1"][1])
    out["refusals"] = _refusals(engines["zero3_bf16"][0], rank, world, root)
    return out


@contextlib.contextmanager
def _sharing():
    """What the ranks hold alike read once between them (each its turn, then gathered) whatever its size."""
    os.environ["COLLGRAD_SHARED_READ_BYTES"] = os.environ["COLLGRAD_FILE_SYSTEM_BYTES_PER_SECOND"] = "0"
    try:
        yield
    finally:
        del os.environ["COLLGRAD_SHARED_READ_BYTES"], os.environ["COLLGRAD_FILE_SYSTEM_BYTES_PER_SECOND"]


def _async_save(root, name, model, train, record, optimizer=None) -> dict:
    """An async save with two steps run beside its write (the second of two calls in a row: it waits for
    the first), then loaded back: the state at the call, bitwise (masters, both moments, every module
    weight, frozen ones too, the step counts), and the same two steps from it bitwise the ones run beside
    the write."""
    from collgrad import async_save_training_state, load_training_state

    path = os.path.join(root, "async", name)
    async_save_training_state(model, path, optimizer=optimizer)  # never waited for: the next call waits
    before = record()
    pending = async_save_training_state(model, path, optimizer=optimizer)
    train()
    beside = record()
    saved = pending.wait()
    load_training_state(model, path, optimizer=optimizer)
    back = record()
    train()
    kinds = ("fp32", *KEYS, "weights")
    return {
        "at the call": _equal(back, before, kinds),
        "steps": [back.get(k) == before.get(k) for k in ("steps", "optimizer steps")],
        "stepped beside": not all(_equal(beside, before, kinds).values()),
        "training on": _equal(record(), beside, kinds),
        "saved": (saved.tensors, saved.bytes_written > 0, pending.done()),
    }


def _trains_as_plain(step, record, start: dict, world) -> dict[str, float]:
    """One step of the model from the state ``start`` (its masters and Adam states, 2 steps taken)
    against plain PyTorch's Adam from the same state with the mean gradient of every rank's batch:
    the largest difference of each master, in units of the learning rate (a wrong state moves an
    update by about one; the reduction's order by less than 1e-4)."""
    from tests.deepspeed import models

    def make():
        net = models.Net()
        with torch.no_grad():
            for n, p in net.named_parameters():
                if n in start["fp32"]:
                    p.copy_(start["fp32"][n])
        return net

    grads = models.reference_grads(
        world, make=make, batch=lambda r, m, dtype=torch.float32: models.batch(r, 2 + m, dtype)
    )
    plain = make()
    params = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=LR)
    named = {n: p for n, p in plain.named_parameters() if p.requires_grad}
    for n, p in named.items():
        opt.state[p] = {"step": torch.tensor(2.0), **{k: start[k][n].clone() for k in KEYS}}
        p.grad = grads[n].clone()
    opt.step()
    step()
    ours = record()
    return {n: float((ours["fp32"][n] - p.detach()).abs().max()) / LR for n, p in named.items()}


def _plain(rank, root) -> dict:
    """A plain module (replicated on every rank, as under DDP) with SGD's momentum and a scheduler."""
    from collgrad import load_full_model, load_training_state, save_full_model, save_training_state
    from tests.deepspeed import models

    def build():
        net = models.Net()
        net.register_buffer("seen", torch.arange(3.0))
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        return net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def train(net, opt, sched, first):
        for step in range(first, first + 2):
            x, y = models.batch(0, step)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    net, opt, sched = build()
    train(net, opt, sched, 0)
    path = os.path.join(root, "sgd")
    save_training_state(net, path, optimizer=opt, lr_scheduler=sched)
    net_at_save = {n: t.clone() for n, t in net.state_dict().items()}
    train(net, opt, sched, 2)
    fresh, fresh_opt, fresh_sched = build()
    loaded = load_training_state(fresh, path, optimizer=fresh_opt, lr_scheduler=fresh_sched)
    train(fresh, fresh_opt, fresh_sched, 2)
    weights_only = models.Net()
    weights_only.register_buffer("seen", torch.zeros(3))
    load_full_model(weights_only, path, strict=False)  # the weights, as from_pretrained reads the index
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {
        "resumed": all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values())),
        "lr": (fresh_opt.param_groups[0]["lr"], opt.param_groups[0]["lr"]),
        "states": loaded.states,
        "created": loaded.created_states,
        "index names": sorted(index["weight_map"]),
        "weights load": all(torch.equal(weights_only.state_dict()[n], t) for n, t in _saved_weights(path).items())
        and all(torch.equal(weights_only.state_dict()[n], t) for n, t in net_at_save.items()),
    }
    # a save_full_model into the same directory replaces what from_pretrained loads, not the training state
    save_full_model(net, path, max_shard_bytes=256)
    again, again_opt, again_sched = build()
    load_training_state(again, path, optimizer=again_opt, lr_scheduler=again_sched)
    out["resumes after save_full_model"] = all(torch.equal(again.state_dict()[n], t) for n, t in net_at_save.items())
    # save_full_model's shards (a training state's carry its generation in their names)
    shard = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
    sharded = sorted(n for n in os.listdir(path) if shard.match(n))
    save_full_model(net, path)  # one file now: its earlier shards go, the training state's stay
    torch.distributed.barrier()
    left = os.listdir(path)
    out["save_full_model's own shards replaced"] = (len(sharded) > 1, sorted(set(sharded) & set(left)))
    load_training_state(again, path, optimizer=again_opt, lr_scheduler=again_sched)
    return out


def _saved_weights(path) -> dict:
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for file in sorted(files):
        out.update(load_file(os.path.join(path, file)))
    return out


def _failed_save(eng, rank, root, recorded) -> dict:
    """A save over an existing checkpoint that fails on rank 1 (the disk full): every rank raises, and the
    previous checkpoint is untouched and loads."""
    from collgrad import load_training_state, save_training_state

    path = os.path.join(root, "zero1")
    before = sorted(os.listdir(path))
    torch.distributed.barrier()  # every rank has looked before any writes
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 1:
        os.pwrite = full
    try:
        seen = attempt(lambda: save_training_state(eng, path))
    finally:
        os.pwrite = real
    torch.distributed.barrier()
    after = sorted(os.listdir(path))
    load_training_state(eng, path)
    return {
        "seen": seen,
        "files unchanged": (sorted(set(before) - set(after)), sorted(set(after) - set(before))),
        "loads": _equal(_recorded(eng), recorded),
    }


def _refusals(eng, rank, world, root) -> dict:
    """Every malformed or foreign checkpoint refused on every rank, the engine's state unchanged."""
    from collgrad import load_training_state

    good = os.path.join(root, "zero3_bf16")
    cases = {}
    for case in (
        "missing file",
        "truncated",
        "manifest disagrees",
        "outside",
        "bad json",
        "another model",
        "other optimizer",
    ):
        path = os.path.join(root, f"bad-{case.replace(' ', '-')}")
        if case in ("another model", "other optimizer"):
            path = _foreign(rank, root, case)
        elif rank == 0:
            shutil.copytree(good, path)
            _spoil(path, case)
        torch.distributed.barrier()
        cases[case] = path
    before = _recorded(eng)
    seen = {case: attempt(lambda p=path: load_training_state(eng, p)) for case, path in cases.items()}
    return {"seen": seen, "unchanged": _equal(_recorded(eng), before, ("fp32", *KEYS, "weights"))}


def _spoil(path, case) -> None:
    with open(os.path.join(path, "training_state", "manifest.json")) as f:
        manifest = json.load(f)
    fp32 = manifest["tensors"]["fp32"]
    first = sorted(set(fp32.values()))[0]
    if case == "missing file":
        os.remove(os.path.join(path, first))
    elif case == "truncated":
        file = os.path.join(path, sorted(set(manifest["tensors"]["optimizer"]["exp_avg"].values()))[0])
        os.truncate(file, os.path.getsize(file) - 8)
    elif case == "manifest disagrees":  # a name the file's header does not hold
        fp32["inp.weightX"] = fp32.pop("inp.weight")
    elif case == "outside":
        fp32["inp.weight"] = "../" + first
    if case == "bad json":
        with open(os.path.join(path, "training_state", "manifest.json"), "w") as f:
            f.write("{not json")
    elif case in ("manifest disagrees", "outside"):  # signed again: what a check beyond the digest refuses
        import xxhash

        manifest.pop("digest")
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        manifest["digest"] = f"{xxhash.xxh3_64_intdigest(body):016x}"
        with open(os.path.join(path, "training_state", "manifest.json"), "w") as f:
            json.dump(manifest, f)


def _foreign(rank, root, case) -> str:
    """A checkpoint of another model (other names and shapes), or of the same model stepped by SGD."""
    from collgrad import save_training_state
    from tests.deepspeed import models

    path = os.path.join(root, f"bad-{case.replace(' ', '-')}")
    net = torch.nn.Sequential(torch.nn.Linear(3, 4)) if case == "another model" else models.Net()
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()
    save_training_state(net, path, optimizer=opt)
    return path


# ---------------------------------------------------------------------------------------------- world 3


def _second(rank, world, root):
    from collgrad import load_training_state, save_training_state

    out: dict = {}
    fresh = _engine(3, "fp32", False)  # never stepped; persistent (whole) parameters
    refused = attempt(lambda: load_training_state(fresh, os.path.join(root, "bad-other-optimizer")))
    out["refused fresh"] = (refused["error"], len(fresh.optimizer.optimizer.state))
    loaded = load_training_state(fresh, os.path.join(root, "zero2_offload"))
    got = _recorded(fresh)
    start = _kept(root, "zero2_offload")
    out["zero2_offload -> fresh zero3"] = {
        **_equal(got, start),
        "weights": _weights_are_masters(got),
        "created": loaded.created_states,
        "steps": (_steps_of(fresh), got["steps"]),
    }
    out["trains as plain pytorch"] = _trains_as_plain(
        lambda: _train(fresh, rank, 2, steps=1), lambda: _recorded(fresh), start, world
    )
    save_training_state(fresh, os.path.join(root, "world3"))
    fresh.save_checkpoint(os.path.join(root, "ds", "world3"))  # ZeRO-3 at 3 ranks: uneven partitions
    _dump(root, "world3", rank, _recorded(fresh))
    other = _engine(2, "bf16", False)
    with _sharing():  # ZeRO-2's weights, which every rank holds whole, read once between the ranks
        loaded = load_training_state(other, os.path.join(root, "zero3_bf16"))
    out["metadata read by"] = loaded.header_bytes > 0  # the manifest, headers and hash files: rank 0 alone
    got = _recorded(other)
    out["zero3_bf16 -> fresh zero2 bf16"] = {
        **_equal(got, _kept(root, "zero3_bf16")),
        "weights": _weights_are_masters(got),
    }
    other.save_checkpoint(os.path.join(root, "ds", "world3_zero2_bf16"))
    _dump(root, "world3_zero2_bf16", rank, got)
    net, opt = _fsdp2(world)
    load_training_state(net, os.path.join(root, "fsdp2"), optimizer=opt)
    out["fsdp2 world 2 -> fsdp2 world 3"] = _equal(_fsdp2_recorded(net, opt), _kept(root, "fsdp2"))
    # DeepSpeed's own world-2 checkpoints, converted offline (the fixture), resumed at world 3
    load_training_state(net, os.path.join(root, "converted", "zero1"), optimizer=opt)
    out["converted zero1 -> fsdp2 world 3"] = _equal(_fsdp2_recorded(net, opt), _kept(root, "zero1"))
    load_training_state(fresh, os.path.join(root, "converted", "zero2_offload"))
    got = _recorded(fresh)
    out["converted zero2_offload -> zero3 world 3"] = {
        **_equal(got, _kept(root, "zero2_offload")),
        "weights": _weights_are_masters(got),
        "counters": got["steps"],
    }
    return out


def _third(rank, world, root):
    from collgrad import load_training_state, save_training_state

    fresh = _engine(3, "fp32", False, 0)
    load_training_state(fresh, os.path.join(root, "world3"))
    got = _recorded(fresh)
    out = {"world3 -> fresh zero3": {**_equal(got, _kept(root, "world3")), "weights": _weights_are_masters(got)}}
    # a directory each rank has to itself: rank 1 sees its own empty file system at the same path
    private = os.path.join(root, "private")
    os.makedirs(private, exist_ok=True)
    torch.distributed.barrier()
    alone = _own_mount(private) if rank == 1 else True
    flags = [None] * world
    torch.distributed.all_gather_object(flags, alone)
    out["streamed"] = None
    if all(flags):
        saved = save_training_state(fresh, private)
        out["streamed"] = {"streamed": saved.streamed, "here": sorted(os.listdir(private))}
    # DeepSpeed's own world-3 ZeRO-2 bf16 checkpoint, converted offline, resumed by ZeRO-3 fp32 at world 2
    load_training_state(fresh, os.path.join(root, "converted", "world3_zero2_bf16"))
    got = _recorded(fresh)
    out["converted world3 zero2 bf16 -> zero3 world 2"] = {
        **_equal(got, _kept(root, "world3_zero2_bf16")),
        "weights": _weights_are_masters(got),
    }
    return out


def _own_mount(path) -> bool:
    """This process given a mount namespace of its own with an empty tmpfs over ``path`` (as a rank on
    another host sees its own disk there); False where the kernel or the container refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 16384, 1 << 18
    if libc.unshare(clone_newns) != 0:
        return False
    if libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0:
        return False
    return libc.mount(b"none", path.encode(), b"tmpfs", 0, None) == 0


def _convert_all(root) -> None:
    """Every DeepSpeed checkpoint written so far converted offline, here in one process."""
    from collgrad import convert_deepspeed_checkpoint

    for name in sorted(os.listdir(os.path.join(root, "ds"))):
        out = os.path.join(root, "converted", name)
        if not os.path.exists(out):
            convert_deepspeed_checkpoint(os.path.join(root, "ds", name), out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("training-state"))
    first = run_ranks(_first, 2, root, timeout=600)
    _convert_all(root)
    second = run_ranks(_second, 3, root, timeout=600)
    _convert_all(root)
    third = run_ranks(_third, 2, root, timeout=600)
    return first, second, third, root


def _all_true(found: dict) -> bool:
    return all(v is True for v in found.values() if isinstance(v, bool))


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_checkpoint_loaded_back_is_the_saved_state_and_training_goes_on_bitwise(results, name):
    for res in results[0]:
        entry = res[name]
        assert all(entry["back"].values()), entry["back"]
        assert all(entry["resumed"].values()), entry["resumed"]
        assert entry["counters"] == (2, 4)  # the engine's steps put back, then stepped twice
        back, before, resumed = entry["optimizer steps"]  # each partition's step count (fp16: less any skipped)
        assert back == before and resumed == entry["uninterrupted optimizer steps"]
        assert entry["scaler"] == (True, True)
        assert entry["loaded"][1] == KEYS and entry["loaded"][2] is False  # states existed: none created


@pytest.mark.parametrize("pair", ["zero2_offload -> zero3_bf16", "zero3_bf16 -> zero1"])
def test_a_checkpoint_resumes_at_another_stage_bitwise(results, pair):
    for res in results[0]:
        assert all(res[pair].values()), res[pair]


def test_zero_to_fsdp2_and_back_bitwise(results):
    for res in results[0]:
        to_fsdp2, back = res["zero1 -> fsdp2"], res["fsdp2 -> zero2_offload"]
        assert to_fsdp2.pop("steps") == [2.0] and all(to_fsdp2.values()), to_fsdp2
        assert back.pop("steps") == [3.0] and all(back.values()), back


def test_fsdp2_trains_on_from_a_zero_checkpoint_as_plain_pytorch(results):
    for res in results[0]:
        worst = max(res["fsdp2 trains as plain pytorch"].values())
        assert worst < 1e-3, res["fsdp2 trains as plain pytorch"]


@pytest.mark.parametrize("name", ["zero2_offload", "zero3_bf16", "fsdp2"])
def test_an_async_save_holds_the_state_at_the_call_and_training_on_from_it_is_bitwise(results, name):
    for res in results[0]:
        entry = res["async"][name]
        assert all(entry["at the call"].values()) and all(entry["steps"]), entry
        assert entry["stepped beside"] and all(entry["training on"].values()), entry
        assert entry["saved"][0] > 0 and entry["saved"][1:] == (True, True), entry


def test_a_plain_module_resumes_bitwise_and_its_weights_load_as_from_pretrained_reads_them(results):
    for res in results[0]:
        plain = res["plain"]
        assert plain["resumed"] and plain["weights load"] and plain["resumes after save_full_model"]
        assert plain["save_full_model's own shards replaced"] == (True, [])
        assert plain["lr"][0] == plain["lr"][1] == 0.1 * 0.5**4
        assert plain["states"] == ("momentum_buffer",) and plain["created"]
        assert "tied_out.weight" not in plain["index names"] and "seen" in plain["index names"]


def test_a_save_that_fails_on_one_rank_raises_everywhere_and_leaves_the_previous_checkpoint(results):
    seen = [res["failed save"]["seen"] for res in results[0]]
    assert "No space left" in seen[1]["message"] and seen[1]["error"] == "CollgradError"
    assert seen[0]["error"] == "RankFailedError" and "rank 1" in seen[0]["message"]
    for res in results[0]:
        assert res["failed save"]["files unchanged"] == ([], []) and all(res["failed save"]["loads"].values())


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing file", "is not there"),
        ("truncated", "data section"),
        ("manifest disagrees", "does not hold it"),
        ("outside", "not a plain .safetensors name"),
        ("bad json", "not valid JSON"),
        ("another model", "does not match the model"),
        ("other optimizer", "momentum_buffer"),
    ],
)
def test_a_bad_checkpoint_is_refused_on_every_rank(results, case, words):
    for res in results[0]:
        seen = res["refusals"]["seen"][case]
        assert seen["error"] == "CheckpointError" and words in seen["message"], seen


def test_the_model_and_optimizer_are_unchanged_by_every_refusal(results):
    for res in results[0]:
        assert all(res["refusals"]["unchanged"].values()), res["refusals"]["unchanged"]


def test_a_refused_load_into_an_optimizer_that_never_stepped_leaves_it_without_states(results):
    for res in results[1]:
        assert res["refused fresh"] == ("CheckpointError", 0)


def test_world_2_resumes_at_world_3_into_fresh_engines_bitwise(results):
    for res in results[1]:
        entry = dict(res["zero2_offload -> fresh zero3"])
        assert entry.pop("created") is True and entry.pop("steps") == ([2.0], 2)
        assert all(entry.values()), entry
        assert all(res["zero3_bf16 -> fresh zero2 bf16"].values()), res["zero3_bf16 -> fresh zero2 bf16"]
        assert all(res["fsdp2 world 2 -> fsdp2 world 3"].values())
    # where sharing pays, the manifest, the headers and the hash files (a verified load) are read by the
    # first rank alone and broadcast: the others read none of them
    assert [res["metadata read by"] for res in results[1]] == [True, False, False]


def test_training_at_world_3_goes_on_as_plain_pytorch_from_the_saved_state(results):
    for res in results[1]:
        assert max(res["trains as plain pytorch"].values()) < 1e-3, res["trains as plain pytorch"]


def test_world_3_resumes_at_world_2(results):
    for res in results[2]:
        assert all(res["world3 -> fresh zero3"].values()), res["world3 -> fresh zero3"]


def test_ranks_that_do_not_share_the_directory_stream_to_rank_0_which_writes_it_all(results, tmp_path_factory):
    """Rank 1 sees its own file system at the path: rank 0 writes the whole checkpoint, streamed to it,
    and it resumes (here in one process, a plain module with Adam) to the saved state bitwise."""
    from collgrad import load_training_state
    from tests.deepspeed import models

    first, second = (res["streamed"] for res in results[2])
    if first is None:
        pytest.skip("no mount namespace here (unshare(CLONE_NEWNS) needs CAP_SYS_ADMIN): no unshared directory")
    assert first["streamed"] and second["streamed"] and second["here"] == []
    assert "training_state" in first["here"] and "model.safetensors.index.json" in first["here"]
    root = str(results[3])
    net = models.Net()
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=LR)
    loaded = load_training_state(net, os.path.join(root, "private"), optimizer=opt)
    kept = _kept(root, "world3")
    named = {n: p for n, p in net.named_parameters() if p.requires_grad}
    assert loaded.created_states and all(torch.equal(p, kept["fp32"][n]) for n, p in named.items())
    assert all(torch.equal(opt.state[p][k], kept[k][n]) for n, p in named.items() for k in KEYS)


# ------------------------------------------------------------------------------------------------ convert

#: DeepSpeed's own checkpoints (``save_checkpoint``) the launches wrote: name -> (layout, world size)
DS_CHECKPOINTS = {
    "zero1": ("zero1", 2),
    "zero2_offload": ("zero2", 2),
    "zero3_bf16": ("zero3", 2),
    "bf16_optimizer": ("bf16-optimizer", 2),
    "world3": ("zero3", 3),
    "world3_zero2_bf16": ("zero2", 3),
}


def _converted(path) -> tuple[dict, object]:
    """A converted checkpoint's tensors by kind ("weights", "fp32", each optimizer state key), read with
    safetensors' own reader, and its manifest."""
    from safetensors.torch import load_file

    from collgrad.checkpoint.manifest import read_manifest

    manifest = read_manifest(path)
    out: dict = {}
    for kind, mapped in (("weights", manifest.weights), ("fp32", manifest.fp32), *manifest.optimizer.items()):
        out[kind] = {}
        for file in sorted(set(mapped.values())):
            out[kind].update(load_file(os.path.join(path, file)))
    return out, manifest


@pytest.mark.parametrize("name", list(DS_CHECKPOINTS))
def test_convert_gives_zero_to_fp32s_masters_and_deepspeeds_own_states_bitwise(results, name):
    """The masters bitwise what DeepSpeed's zero_to_fp32 reconstructs (it refuses BF16_Optimizer's
    checkpoints), masters, Adam's states and module weights bitwise what DeepSpeed's accessors and
    GatheredParameters gave at the save; the counters and the layout it came from."""
    root = results[3]
    ours, manifest = _converted(os.path.join(root, "converted", name))
    kept = _kept(root, name)
    assert all(_equal(ours, kept, ("fp32", *KEYS, "weights")).values()), _equal(ours, kept, ("fp32", *KEYS, "weights"))
    layout, world = DS_CHECKPOINTS[name]
    assert manifest.saved_by["layout"] == f"deepspeed-checkpoint:{layout}" and manifest.saved_by["world_size"] == world
    assert manifest.counters["global_steps"] == kept["steps"]
    assert {float(s["step"]) for s in manifest.param_states.values()} == set(kept["optimizer steps"])
    if layout != "bf16-optimizer":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        theirs = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "ds", name))
        assert all(torch.equal(theirs[n], t) for n, t in ours["fp32"].items())


def test_a_converted_deepspeed_checkpoint_resumes_at_another_world_size_stage_and_under_fsdp2(results):
    for res in results[1]:
        assert all(res["converted zero1 -> fsdp2 world 3"].values()), res["converted zero1 -> fsdp2 world 3"]
        entry = dict(res["converted zero2_offload -> zero3 world 3"])
        assert entry.pop("counters") == 2 and all(entry.values()), entry
    for res in results[2]:
        entry = res["converted world3 zero2 bf16 -> zero3 world 2"]
        assert all(entry.values()), entry


def _spoiled(root, tmp_path, case) -> str:
    """A copy of the world-2 ZeRO-3 bf16 checkpoint DeepSpeed wrote (ZeRO-1's for a case that says so),
    spoiled as ``case`` says."""
    good = os.path.join(root, "ds", "zero1" if case.startswith("zero1") else "zero3_bf16")
    path = str(tmp_path / "ds")
    shutil.copytree(good, path, symlinks=True)
    step = os.path.join(path, "global_step2")
    optim = os.path.join(step, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    if "layout larger" in case:  # the model-state file says its largest parameter is twice its size
        model = os.path.join(
            step,
            "mp_rank_00_model_states.pt" if case.startswith("zero1") else "zero_pp_rank_0_mp_rank_00_model_states.pt",
        )
        found = torch.load(model, weights_only=True)
        name, shape = max(found["param_shapes"][0].items(), key=lambda item: item[1].numel())
        found["param_shapes"][0][name] = torch.Size([2 * shape[0], *shape[1:]])
        torch.save(found, model)
    if case == "latest leaves the directory":
        with open(os.path.join(path, "latest"), "w") as f:
            f.write("../zero1/global_step2")
    elif case == "a rank's file missing":
        os.remove(optim)
    elif case == "truncated":
        os.truncate(optim, os.path.getsize(optim) // 2)
    elif case == "a link out of the directory":
        outside = str(tmp_path / "elsewhere.pt")
        shutil.move(optim, outside)
        os.symlink(outside, optim)
    elif case == "another world size":  # rank 1's file of the world-3 ZeRO-3 checkpoint
        with open(os.path.join(root, "ds", "world3", "latest")) as f:
            tag = f.read().strip()
        shutil.copy(os.path.join(root, "ds", "world3", tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), optim)
    elif case == "an object that runs code":
        torch.save({"optimizer_state_dict": _Runs(str(tmp_path / "sentinel"))}, optim)
    elif case == "latest names no directory":
        with open(os.path.join(path, "latest"), "w") as f:
            f.write("global_step9")
    elif case == "a model file that is not DeepSpeed's":
        torch.save([1, 2, 3], os.path.join(step, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    elif case == "no optimizer files":
        for r in range(2):
            os.remove(os.path.join(step, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    return path


class _Runs:
    """Unpickled by anything but a weights-only loader, it removes the file it names."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "w") as f:
            f.write("still here")

    def __reduce__(self):
        return (os.remove, (self.path,))


@pytest.mark.parametrize(
    "case, words",
    [
        ("latest leaves the directory", "is not a plain directory name"),
        ("a rank's file missing", "is not there"),
        ("truncated", "cannot be loaded"),
        ("a link out of the directory", "resolves outside"),
        ("another world size", "partition"),
        ("an object that runs code", "cannot be loaded"),
        ("latest names no directory", "is not a directory inside it"),
        ("a model file that is not DeepSpeed's", "holds a list, not DeepSpeed's dict"),
        ("no optimizer files", "stage-0"),
        ("a layout larger than the partitions", "where its layout has"),
        ("zero1: a layout larger than the partitions", "cannot hold its parameters"),
    ],
)
def test_convert_refuses_a_bad_deepspeed_checkpoint_before_writing_anything(results, tmp_path, case, words):
    from collgrad import CheckpointError, convert_deepspeed_checkpoint

    path = _spoiled(results[3], tmp_path, case)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=words):
        convert_deepspeed_checkpoint(path, out)
    assert not out.exists()
    if case == "an object that runs code":
        assert (tmp_path / "sentinel").read_text() == "still here"


def test_a_convert_that_fails_while_writing_leaves_the_previous_checkpoint(results, tmp_path, monkeypatch):
    from collgrad import CollgradError, convert_deepspeed_checkpoint
    from collgrad.cli import main

    root, out = results[3], str(tmp_path / "out")
    assert main(["convert", os.path.join(root, "ds", "world3"), out, "--max-shard-bytes", "4096"]) == 0
    before, tensors = sorted(os.listdir(out)), _converted(out)[0]
    written = []

    def full(fd, data, offset):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(data))
        return len(data)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(CollgradError, match="No space left"):
        convert_deepspeed_checkpoint(os.path.join(root, "ds", "zero1"), out)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == before
    again = _converted(out)[0]
    assert all(torch.equal(again[k][n], t) for k in tensors for n, t in tensors[k].items())
    assert main(["convert", os.path.join(root, "ds"), out]) == 2  # no 'latest' there: said, not raised
