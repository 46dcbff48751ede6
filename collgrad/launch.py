"""Joining a process group the way the job was started, and ``--local N`` for trying things on one host.

collgrad has no launcher of its own for real jobs: under torchrun or the deepspeed launcher the
usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` are read; under mpiexec/mpirun/srun the
MPI launcher's rank variables are read and, if no ``MASTER_ADDR`` is set, MPI rank 0 publishes an
address over MPI. ``run_local`` starts N ranks over Gloo on this host (the probe's and benchmark's
``--local N``, and the test suite's harness).
"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Tuple, TypedDict, TypeVar

import torch
import torch.distributed as dist

from collgrad import _compat
from collgrad.backends import mpi as mpi_launcher  # launcher facts only: mpi4py is imported lazily there
from collgrad.errors import NotInitializedError

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

__all__ = ["init_from_environment", "run_local", "RankError", "default_backend"]

_T = TypeVar("_T")
#: What a rank puts on the results queue: (rank, ok, ``fn``'s result if ok else the traceback text).
#: The result is whatever ``fn`` returned, unpickled from the rank's process: of no type known here.
_Report = Tuple[int, bool, Any]


def default_backend() -> str:
    """Gloo for CPU tensors, plus NCCL (or XCCL) for the accelerator when there is one."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    if _compat.xccl_available() and _compat.xpu_available():
        return "cpu:gloo,xpu:xccl"
    return "gloo"


def init_from_environment(backend: str | None = None) -> bool:
    """Initialize the default process group from the launcher's environment, if not done already.

    Returns True if it initialized the group (the caller should destroy it). Call on every rank.
    """
    if dist.is_initialized():
        return False
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        found = mpi_launcher.rank_and_size(env)
        if found is not None:
            env["RANK"], env["WORLD_SIZE"] = found
            env.setdefault("LOCAL_RANK", mpi_launcher.local_rank(env))
    if "RANK" not in env:
        raise NotInitializedError(
            "no launcher environment found (RANK/WORLD_SIZE from torchrun or the deepspeed launcher, or "
            "an MPI launcher's rank variables): start under a launcher, or use --local N on one host"
        )
    if "MASTER_ADDR" not in env:
        from collgrad.backends.mpi import publish_address  # only under an MPI launcher

        env["MASTER_ADDR"], env["MASTER_PORT"] = publish_address()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend or default_backend())
    return True


class RankError(RuntimeError):
    """Ranks of ``run_local`` failed; ``text`` holds the first failed rank's traceback, ``failures``
    every failed rank's, and ``missing`` the ranks that had not finished by the deadline."""

    def __init__(
        self, rank: int, text: str, failures: dict[int, str] | None = None, missing: list[int] | None = None
    ) -> None:
        self.rank = rank
        self.text = text
        self.failures = dict(failures or {rank: text})
        self.missing = list(missing or [])
        parts = [f"rank {r} failed:\n{t}" for r, t in sorted(self.failures.items())]
        if self.missing:
            parts.append(f"ranks {self.missing} did not finish by the deadline (killed)")
        super().__init__("\n".join(parts))


# Ranks of a CPU run (Gloo only) are forked from a forkserver that imported what ranks import, once
# for this process, instead of importing it again in a fresh interpreter per rank (seconds each, more
# on a loaded machine): torch, torch._dynamo (imported by the first optimizer torch.optim builds),
# collgrad and, on DeepSpeed's CPU accelerator, collgrad's DeepSpeed adapter, which imports deepspeed
# with the modules its first engine imports (see collgrad/state/adapters/deepspeed.py).
# Importing them starts no thread and initializes no device or process group, so a fork of the server
# is as clean as a fresh interpreter. What the server cannot give a rank is what was read at import:
# deepspeed fixes its accelerator (DS_ACCELERATOR) when imported, so the server imports it only where
# the first run asks for DS_ACCELERATOR=cpu, and a later run that asks for another accelerator, or for
# a device backend, starts fresh interpreters (spawn) as before; so does every run if the server could
# not start. Environment variables read later are the parent's current ones: every rank gets the
# parent's os.environ as it is at the call (the server's own is as it was when the server started). A
# module missing from an installed release is skipped (the forkserver ignores an ImportError), and the
# rank imports what it needs itself.
# COLLGRAD_PRELOAD (comma-separated module names) adds modules the ranks would each import (the tests set
# Transformers' Trainer and models: ~8 s a rank, ~4 s once in the server); they must start no thread.
_SERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "collgrad")
# collgrad's DeepSpeed adapter: it imports deepspeed and what a first engine imports (the adapters are
# the only modules of collgrad that import deepspeed, the server's preload included); then what the
# server's ranks skip of DeepSpeed's per-process work (adapters/deepspeed_local.py).
_DEEPSPEED_PRELOAD = ("collgrad.state.adapters.deepspeed", "collgrad.state.adapters.deepspeed_local")


class _Server(TypedDict, total=False):
    accelerator: str | None
    usable: bool


#: The forkserver of this process, once started: "accelerator" is the DS_ACCELERATOR it imported
#: deepspeed with (None: it did not), "usable" False if it could not start (then every run spawns).
_server: _Server = {}


def _context(backend: str, envs: list[dict[str, str]]) -> SpawnContext | ForkServerContext:
    """The start method for one run: the preloaded forkserver for CPU runs, spawn otherwise."""
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _server:  # the first run of this process: start the server, importing what it may
        wanted = envs[0].get("DS_ACCELERATOR")
        deepspeed = wanted == "cpu" and importlib.util.find_spec("deepspeed") is not None
        extra = [m for m in os.environ.get("COLLGRAD_PRELOAD", "").split(",") if m.strip()]
        preload = list(_SERVER_PRELOAD) + (list(_DEEPSPEED_PRELOAD) if deepspeed else []) + extra
        ctx.set_forkserver_preload(preload)
        _server.update({"accelerator": wanted if deepspeed else None, "usable": _start_server(ctx, wanted)})
    if not _server["usable"]:
        return mp.get_context("spawn")
    preloaded = _server["accelerator"]
    if preloaded is not None and any(env.get("DS_ACCELERATOR") != preloaded for env in envs):
        return mp.get_context("spawn")
    return ctx


def _start_server(ctx: ForkServerContext, accelerator: str | None) -> bool:
    """Start the forkserver and fork one empty process from it; False (use spawn) if either fails (a
    preloaded module that raises something other than ImportError ends the server)."""
    # The server imports with this process's module search path (Python < 3.12 ignores the one
    # multiprocessing hands it), so that it imports the very collgrad (and torch) this process does,
    # and with the runs' DS_ACCELERATOR, which deepspeed reads when imported.
    wanted = {"PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path)}
    if accelerator is not None:
        wanted["DS_ACCELERATOR"] = accelerator
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
        probe = ctx.Process(target=_noop)
        probe.start()
        probe.join(timeout=120)
        if probe.is_alive():
            probe.kill()
            probe.join()
        return probe.exitcode == 0
    except (OSError, EOFError, ValueError):  # the server died while starting, or cannot be reached
        return False
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _noop() -> None:
    pass


def _entry(
    fn: Callable[..., object],
    rank: int,
    world: int,
    store_path: str,
    backend: str,
    env: dict[str, str],
    args: tuple[object, ...],
    results: Queue[_Report],
) -> None:
    # What the rank starts with (the imported modules: thousands of objects once torch._dynamo is in)
    # lives as long as the rank: out of the collector's sight, a gc.collect() (ZeRO-3 calls one per
    # engine) walks only what the rank made since, not every module of torch again.
    gc.freeze()
    # A forked rank starts with the server's environment: take the parent's (``env`` is all of it).
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    # What torchrun sets, so that libraries that read it (DeepSpeed asserts LOCAL_RANK) work here too.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # torch.distributed imports FileStore from torch._C without re-exporting it (no "as", no __all__), so
        # mypy's strict no-implicit-reexport rejects the public spelling; torch._C is _compat's alone.
        store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
        _rendezvous(
            store,
            rank,
            world,
            lambda prefixed: dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world),
        )
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


#: How many times the ranks of one run try to form their group before the run fails.
_RENDEZVOUS_ATTEMPTS = 3


def _rendezvous(store: _compat.Store, rank: int, world: int, init: Callable[[_compat.Store], None]) -> None:
    """Form the default group with ``init`` through ``store``; where any rank's attempt failed, every rank
    tries again together, under a fresh prefix of the store. Called by every rank of a run, once.

    Gloo's connectFullMesh over loopback has failed here, rarely, with every rank alive ("Connection
    closed by peer" while two test workers' runs were forming groups at once): a setup failure of the
    host's sockets, not of the job, so it is retried rather than failing the run. Each rank records its
    attempt's outcome in the store and waits for every rank's, so that all of them retry or none does:
    a rank whose group formed while another's did not destroys its own before the next attempt.
    """
    failed: list[int] = []
    error: RuntimeError | None = None
    for attempt in range(_RENDEZVOUS_ATTEMPTS):
        error = None
        try:
            init(_compat.PrefixStore(f"attempt{attempt}", store))
        except RuntimeError as exc:  # DistBackendError and Gloo's own errors are RuntimeErrors
            error = exc
        keys = [f"outcome{attempt}/{r}" for r in range(world)]
        store.set(keys[rank], "failed" if error else "ok")
        store.wait(keys)
        failed = [r for r, key in enumerate(keys) if store.get(key) != b"ok"]
        if not failed:
            return
        if error is None:
            dist.destroy_process_group()
    if error is not None:
        raise error
    raise RuntimeError(
        f"rank {rank}: the ranks could not form their process group in {_RENDEZVOUS_ATTEMPTS} attempts; "
        f"rank(s) {failed} failed the last (their tracebacks say why)"
    )


#: After a rank died without a word, how long the others get to finish (or report) before they are killed.
_GRACE_S = 10.0


def _exited_silently(
    procs: list[BaseProcess], results: Queue[_Report], done: dict[int, Any], failed: dict[int, str]
) -> bool:
    """Record, as failed, every rank whose process ended without reporting (killed by a signal, a crash in
    native code, ``os._exit``): it never will, and waiting for it would hold the caller to the deadline.
    What an exited rank put on the queue before it ended is read first."""
    gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done and r not in failed]
    if not gone:
        return False
    while True:  # a rank flushes its result before it exits: read what is there
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue_mod.Empty:
            break
        (done if ok else failed)[rank] = value
    silent = [r for r in gone if r not in done and r not in failed]
    for r in silent:
        code = procs[r].exitcode
        assert code is not None  # r is gone: its process has exited
        why = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        failed[r] = f"rank {r} {why} without reporting a result or an error"
    return bool(silent)


def run_local(
    fn: Callable[..., _T],
    world_size: int,
    *args: object,
    backend: str = "gloo",
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> list[_T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local rank processes; results by rank.

    Ranks rendezvous through a FileStore in a temporary folder. ``fn`` must be importable (defined at
    module level). Each rank's environment is this process's ``os.environ`` at the call, with ``env``
    set on every rank and ``rank_env[r]`` on rank r only. Gloo-only ranks are forked from a server
    that imported torch (and deepspeed on its CPU accelerator) once per process; other backends
    start a fresh interpreter per rank. Ranks that raise make this raise RankError with every failed
    rank's traceback; a rank whose process ends without a word (a crash in native code, a signal)
    fails too, and the others get a few seconds before they are killed; ranks not done within
    ``timeout`` seconds of the start (one deadline for the whole run) are killed, and a RankError
    naming them (or a TimeoutError, if no rank failed) is raised, so a hang never outlives the call.
    """
    base_env = dict(os.environ)
    base_env.setdefault("OMP_NUM_THREADS", "1")
    base_env.update(env or {})
    envs = [dict(base_env, **(rank_env or {}).get(rank, {})) for rank in range(world_size)]
    ctx = _context(backend, envs)
    results: Queue[_Report] = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="collgrad-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs: list[BaseProcess] = []
        for rank in range(world_size):
            proc: BaseProcess = ctx.Process(
                target=_entry, args=(fn, rank, world_size, store_path, backend, envs[rank], args, results)
            )
            proc.start()
            procs.append(proc)
        done: dict[int, Any] = {}  # fn's results, unpickled (see _Report)
        failed: dict[int, str] = {}
        deadline = time.monotonic() + timeout  # one deadline for the whole run, not one per rank
        try:
            while len(done) + len(failed) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                except queue_mod.Empty:
                    if _exited_silently(procs, results, done, failed):
                        # the others may wait on it in a collective: a short grace, then they are killed
                        deadline = min(deadline, time.monotonic() + _GRACE_S)
                    continue
                (done if ok else failed)[rank] = value
        finally:
            for proc in procs:
                proc.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    missing = sorted(set(range(world_size)) - set(done) - set(failed))
    if failed:  # every failed rank's traceback, and who never finished
        rank = min(failed)
        raise RankError(rank, failed[rank], failed, missing)
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
    return [done[r] for r in range(world_size)]
