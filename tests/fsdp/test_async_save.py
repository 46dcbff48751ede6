"""``async_save_training_state`` when things go wrong, on real ranks (FSDP2 over Gloo, 2 ranks):

- every rank SIGKILLed during the background write of a ~50M-parameter model (a plain module, which
  every rank holds whole, the ranks taking turns at writing it), right after the call returned: the
  directory loads, as exactly the previous state or exactly the new one (a launch per kill; more
  moments: ``COLLGRAD_KILL_AFTER=0,0.5,1,2``, seconds after the call);
- a background write that fills the disk (a tmpfs of its own, mounted here: root only): ``wait()``
  raises on every rank, the failure of a save nobody waited for raises at the next call, and the
  previous state loads. The same launch loads the killed saves' directories.

The state at the call against the state loaded, bitwise, and training on beside the write: ZeRO-2,
ZeRO-3 and FSDP2 in tests/deepspeed/test_training_state.py (its first launch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
import torch

from collgrad.checkpoint.commit import TEMPORARY
from tests.harness import RankError, attempt, run_ranks

#: ~50M parameters: 12 layers of 2048 x 2048 (and their biases)
BIG = (12, 2048)
#: a small model for the full disk (its checkpoint ~4 MB)
SMALL = (2, 256)
#: seconds after the async call returned that every rank kills itself
KILL_AFTER = tuple(float(s) for s in os.environ.get("COLLGRAD_KILL_AFTER", "0").split(","))


def _model(shape, world):
    """A stack of linear layers and Adam: under FSDP2 when small, a plain module (every rank the same
    batch: the replicas stay equal) when big (no collective in a step: the launch stays short)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers, width = shape
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    if shape != BIG:
        fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def _step(net, opt, rank, step):
    width = net[0].in_features
    seed = 100 * step + (rank if width != BIG[1] else 0)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(seed))
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _digest(net, opt) -> str:
    """This rank's part of the training state (weights, both moments, step counts), hashed."""
    import xxhash

    h = xxhash.xxh3_128()
    for p in net.parameters():
        h.update((p.to_local() if hasattr(p, "to_local") else p).detach().numpy().tobytes())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            value = opt.state[p][key]
            h.update((value.to_local() if hasattr(value, "to_local") else value).numpy().tobytes())
    return h.hexdigest()


def _killed(rank, world, path, after):
    """A save (the previous state), a step, an async save of the new state, then this rank killed
    ``after`` seconds after the call returned. Writes what each state hashes to."""
    from collgrad import async_save_training_state, save_training_state

    net, opt = _model(BIG, world)
    _step(net, opt, rank, 0)
    save_training_state(net, path, optimizer=opt)
    with open(os.path.join(path, f"previous-{rank}"), "w") as f:
        f.write(_digest(net, opt))
    _step(net, opt, rank, 1)
    with open(os.path.join(path, f"new-{rank}"), "w") as f:
        f.write(_digest(net, opt))
    pending = async_save_training_state(net, path, optimizer=opt)
    time.sleep(after)
    done = pending.done()
    with open(os.path.join(path, f"done-{rank}"), "w") as f:
        f.write(str(done))
    os.kill(os.getpid(), signal.SIGKILL)


def _load_each(rank, world, paths) -> dict:
    """Each killed save's directory loaded: which state it holds on this rank."""
    from collgrad import load_training_state

    out = {}
    for path in paths:
        net, opt = _model(BIG, world)
        _step(net, opt, rank, 0)  # Adam's states exist; load replaces them
        loaded = attempt(lambda net=net, path=path, opt=opt: load_training_state(net, path, optimizer=opt))
        digest = _digest(net, opt)
        with open(os.path.join(path, f"previous-{rank}")) as f:
            previous = f.read()
        with open(os.path.join(path, f"new-{rank}")) as f:
            new = f.read()
        out[path] = {"error": loaded["error"], "state": {previous: "previous", new: "new"}.get(digest, "neither")}
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> list[str]:
    """A directory per kill, each holding a finished save and a killed async one."""
    paths = []
    for after in KILL_AFTER:
        path = str(tmp_path_factory.mktemp(f"killed-{after}"))
        with pytest.raises(RankError, match="killed by signal 9"):
            run_ranks(_killed, 2, path, after, timeout=300)
        paths.append(path)
    return paths


@contextlib.contextmanager
def _small_disk(path, size):
    """A tmpfs of ``size`` at ``path`` (root only, else the test skips), unmounted after."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def _full_disk(rank, world, path, killed):
    from collgrad import async_save_training_state, load_training_state, save_training_state

    out = {"killed": _load_each(rank, world, killed)}

    net, opt = _model(SMALL, world)
    _step(net, opt, rank, 0)
    save_training_state(net, path, optimizer=opt)
    previous = _digest(net, opt)
    # fill the disk but for a little less than the checkpoint takes
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    if rank == 0:
        with open(os.path.join(path, "filler"), "wb") as f:
            f.write(b"\0" * max(0, free - 600_000))
    torch.distributed.barrier()
    _step(net, opt, rank, 1)
    pending = async_save_training_state(net, path, optimizer=opt)
    _step(net, opt, rank, 2)  # training goes on beside the failing write
    out["wait"] = attempt(pending.wait)
    async_save_training_state(net, path, optimizer=opt)  # fails too, never waited for
    out["next call"] = attempt(lambda: async_save_training_state(net, path, optimizer=opt))
    torch.distributed.barrier()  # every rank's failed saves waited for: each removed what it wrote
    out["files"] = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, names in os.walk(path) for f in names)
    net, opt = _model(SMALL, world)
    _step(net, opt, rank, 0)
    out["load"] = attempt(lambda: load_training_state(net, path, optimizer=opt))
    out["previous"] = _digest(net, opt) == previous
    return out


@pytest.fixture(scope="module")
def found(killed, tmp_path_factory) -> list[dict]:
    with _small_disk(str(tmp_path_factory.mktemp("small")), "12m") as path:
        return run_ranks(_full_disk, 2, path, killed, timeout=300)


def test_ranks_killed_during_the_background_write_leave_the_previous_or_the_new_checkpoint(killed, found):
    for rank, out in enumerate(found):
        for after, path in zip(KILL_AFTER, killed):
            entry = out["killed"][path]
            assert entry["error"] is None and entry["state"] in ("previous", "new"), (rank, after, entry)
    for after, path in zip(KILL_AFTER, killed):  # every rank the same state: the directory is one checkpoint
        assert len({out["killed"][path]["state"] for out in found}) == 1
        print(f"killed {after} s after the call: the {found[0]['killed'][path]['state']} state loads")
    # killed at once, the previous state unless the write was already done (a plain module's ~800 MB:
    # seconds here)
    at_once = open(os.path.join(killed[0], "done-0")).read() == "True"
    assert found[0]["killed"][killed[0]]["state"] == ("new" if at_once else "previous")


def test_a_background_write_that_fills_the_disk_raises_on_every_rank_and_the_previous_state_loads(found):
    for rank, out in enumerate(found):
        for call in ("wait", "next call"):
            error = out[call]
            assert error["error"] is not None and "CollgradError" in error["is_a"], (rank, call, error)
            assert "No space left on device" in error["message"], (rank, call, error)
            assert "CollgradTimeoutError" not in error["is_a"], (rank, call, error)
        assert out["load"]["error"] is None and out["previous"], (rank, out)
        assert not [f for f in out["files"] if f.endswith(TEMPORARY)], out["files"]  # the failed saves' files gone
