"""The MPI path for real: ``mpiexec -n N`` ranks with mpi4py beside a Gloo group (tox -e cpu; alone: tox -e cpu-mpi).

Skipped where mpi4py or mpiexec is missing, unless COLLGRAD_REQUIRE_MPI=1 (set by the cpu and cpu-mpi tox
envs, so that leg cannot pass by skipping).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_worker.py")


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


def _missing():
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'collgrad[mpich]')"
    if _mpiexec() is None:
        return "no mpiexec on PATH or beside the interpreter"
    return None


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"mpiexec-n{n}")
def mpi_run(request, tmp_path_factory):
    reason = _missing()
    if reason:
        if os.environ.get("COLLGRAD_REQUIRE_MPI") == "1":
            pytest.fail(f"COLLGRAD_REQUIRE_MPI=1 but {reason}")
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("mpi")
    env = dict(os.environ, OMP_NUM_THREADS="1", COLLGRAD_TEST_OUT=str(out))
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run(
        [_mpiexec(), "-n", str(request.param), sys.executable, WORKER],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


def _all(run, key):
    return [r["results"][key] for r in run if key in r["results"]]


@pytest.mark.parametrize("key", ["fp32", "mixed", "large", "noncontiguous", "gloo_forbidden", "gather"])
def test_results_equal_to_per_tensor_gloo(mpi_run, key):
    for res in _all(mpi_run, key):
        assert res["equal"], res


def test_mpi4py_is_chosen_when_allowed(mpi_run):
    for res in _all(mpi_run, "fp32"):
        assert {b[1] for b in res["buckets"]} == {"mpi4py"}
        assert all(b[3] == 1 for b in res["buckets"])
    for res in _all(mpi_run, "gather"):
        assert "mpi4py" in {b[1] for b in res["buckets"]}


def test_bf16_is_not_sent_through_mpi(mpi_run):
    for res in _all(mpi_run, "mixed"):
        by_dtype = {b[0]: b[1] for b in res["buckets"]}
        assert by_dtype["torch.float32"] == by_dtype["torch.float64"] == "mpi4py"
        assert by_dtype["torch.bfloat16"] == "flat"  # over Gloo: the MPI library has no bf16 type
        bf16_why = [d[2] for d in res["decisions"] if d[0] == "torch.bfloat16"][0]
        assert "mpi4py: it cannot reduce/gather this dtype" in bf16_why


def test_without_gloo_bf16_is_upcast_for_mpi(mpi_run):
    for res in _all(mpi_run, "gloo_forbidden"):
        bf16 = [b for b in res["buckets"] if b[0] == "torch.bfloat16"]
        assert bf16 and all(b[1] == "mpi4py" and b[2] == "torch.float32" for b in bf16)


def test_large_tensor_split_into_mpi_buckets(mpi_run):
    for res in _all(mpi_run, "large"):
        assert len(res["buckets"]) > 3 and all(b[3] == 1 for b in res["buckets"])


def test_subgroup_gets_its_own_communicator(mpi_run):
    subs = _all(mpi_run, "subgroup")
    if len(mpi_run) < 3:
        assert subs == []
        return
    assert len(subs) == 2
    for res in subs:
        assert res["equal"] and "mpi4py" in {b[1] for b in res["buckets"]}
