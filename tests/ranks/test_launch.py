"""run_local's start method: ranks forked from a preloaded server get the caller's environment at the
call, a server that cannot start (a preloaded module raising on import) leaves every run to spawn, and a
rank that dies without a word fails the run at once."""

from __future__ import annotations

import os
import subprocess
import sys

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
    env = dict(os.environ, OMP_NUM_THREADS="1")
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
