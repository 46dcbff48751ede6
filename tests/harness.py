"""Real ranks for tests: spawn N processes, rendezvous through a FileStore, run a function on each.

Each rank's result is returned to the parent in rank order; an exception on any rank is re-raised in
the parent with that rank's traceback. A rank that does not finish within ``timeout`` fails the test
(and every rank is killed), so a hang is a failure, never a stuck suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "RankError"]


class RankError(AssertionError):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def _entry(fn, rank, world, store_path, backend, env, args, queue) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (a module-level function). ``rank_env`` sets variables on some ranks
    only (e.g. an override on one rank).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = []
        for rank in range(world_size):
            renv = dict(env or {})
            renv.update((rank_env or {}).get(rank, {}))
            p = ctx.Process(target=_entry, args=(fn, rank, world_size, store_path, backend, renv, args, queue))
            p.start()
            procs.append(p)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            import queue as queue_mod

            for _ in range(world_size):
                try:
                    rank, ok, value = queue.get(timeout=timeout)
                except queue_mod.Empty:
                    missing = sorted(set(range(world_size)) - set(results) - set(failures))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout} s (hang?)") from None
                (results if ok else failures)[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            rank = min(failures)
            raise RankError(rank, failures[rank])
        return [results[r] for r in range(world_size)]
