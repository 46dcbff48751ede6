"""run_local's start method: ranks forked from a preloaded server get the caller's environment at the
call, a server that cannot start (a preloaded module raising on import) leaves every run to spawn, a
rank that dies without a word fails the run at once, and a group that could not form on one rank is
formed again by every rank together."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist

from collgrad import launch
from tests.harness import run_ranks


def _env(rank, world, name):
    return os.environ.get(name), os.environ["RANK"], os.environ["WORLD_SIZE"]


def test_ranks_see_the_callers_environment_as_it_is_at_the_call(monkeypatch):
    monkeypatch.setenv("COLLGRAD_TEST_VALUE", "first")
    assert run_ranks(_env, 2, "COLLGRAD_TEST_VALUE") == [("first", "0", "2"), ("first", "1", "2")]
    monkeypatch.setenv("COLLGRAD_TEST_VALUE", "second")  # after the server started
    assert [r[0] for r in run_ranks(_env, 3, "COLLGRAD_TEST_VALUE")] == ["second"] * 3


def test_a_server_that_cannot_start_leaves_runs_to_spawn(tmp_path):
    (tmp_path / "explodes_on_import.py").write_text("raise RuntimeError('broken on import')\n")
    code = (
        "import operator, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import collgrad.launch as launch\n"
        "launch._SERVER_PRELOAD = launch._SERVER_PRELOAD + ('explodes_on_import',)\n"
        "print(launch.run_local(operator.add, 2, timeout=120), launch._server['usable'])\n"
    )
    # without DS_ACCELERATOR or COLLGRAD_PRELOAD: the server (which fails) would import deepspeed or
    # Transformers first, for nothing here
    skipped = ("DS_ACCELERATOR", "COLLGRAD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k not in skipped} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[2, 3] False", out.stdout


def _crash(rank, world):
    import signal

    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no result: as a crash in native code ends
    dist.barrier()  # rank 0 waits on it in a collective


def test_a_rank_that_dies_without_a_word_fails_the_run_in_seconds_not_at_the_deadline():
    import time

    import pytest

    from collgrad.launch import RankError

    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(_crash, 2, timeout=300)
    assert time.monotonic() - start < 60
    assert "rank 1 killed by signal 9" in str(err.value)


def _rendezvous_failing_on_rank_1(rank, world, path, failing):
    """The run's group is left and a new one formed through ``launch._rendezvous``, whose first ``failing``
    attempts fail on rank 1 after the others' succeeded (as Gloo's connectFullMesh fails on one rank)."""
    dist.destroy_process_group()
    store = dist.FileStore(path, world)
    tried = []

    def init(prefixed):
        tried.append(prefixed)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
        if rank == 1 and len(tried) <= failing:
            dist.destroy_process_group()
            raise RuntimeError("Gloo connectFullMesh failed (made to fail here)")

    try:
        launch._rendezvous(store, rank, world, init)
    except RuntimeError as exc:
        dist.init_process_group("gloo", store=dist.PrefixStore("after", store), rank=rank, world_size=world)
        return len(tried), str(exc)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the group formed at the second attempt works
    return len(tried), total.item()


def test_a_group_that_failed_to_form_on_one_rank_is_formed_again_by_every_rank(tmp_path):
    assert run_ranks(_rendezvous_failing_on_rank_1, 3, str(tmp_path / "again"), 1) == [(2, 6.0)] * 3
    attempts = launch._RENDEZVOUS_ATTEMPTS
    failed = run_ranks(_rendezvous_failing_on_rank_1, 3, str(tmp_path / "never"), attempts)
    assert [tried for tried, _ in failed] == [attempts] * 3
    assert failed[1][1] == "Gloo connectFullMesh failed (made to fail here)"
    assert all(f"rank {r}: the ranks could not form" in failed[r][1] and "rank(s) [1]" in failed[r][1] for r in (0, 2))
