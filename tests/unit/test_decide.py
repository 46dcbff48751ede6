"""The registry's decision as a pure function of every rank's findings: no process group needed."""

from __future__ import annotations

import pytest
import torch

from collgrad.backends import gloo
from collgrad.backends.base import DTYPES, INT32_MAX, UNLIMITED, LocalFinding, Reason
from collgrad.backends.decide import FORMAT, HEADER, KEYS, code, decide, encode
from collgrad.backends.mpi import torch_mpi_finding
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.policy import Policy
from collgrad.errors import AgreementError, PolicyError


def row(
    rank,
    backend="gloo",
    device="cpu",
    policy=Policy(),  # noqa: B008 - Policy is frozen
    mpi=None,
    finder=gloo.finding,
    size=2,
    policy_ok=1,
    strided=1,
):
    """One rank's agreement row, built the way Registry._local builds it."""
    mpi_reason, mpi_rank, mpi_size, token = mpi or (Reason.NOT_LAUNCHED, -1, -1, 0)
    findings = {}
    for op, prim, dtype in KEYS:
        if prim is Primitive.MPI4PY:
            found = LocalFinding(Reason(mpi_reason)) if mpi_reason else LocalFinding(Reason.OK)
        else:
            found = finder(device, op, prim, dtype)
        if found.ok and policy.check(prim, backend) is not Reason.OK:
            found = LocalFinding(policy.check(prim, backend))
        findings[(op, prim, dtype)] = found
    header = dict(
        format=FORMAT,
        device=code(device),
        backend=code(backend),
        size=size,
        rank=rank,
        policy_ok=policy_ok,
        mpi_reason=int(mpi_reason),
        mpi_rank=mpi_rank,
        mpi_size=mpi_size,
        mpi_token=token,
        strided_gather=strided,
    )
    return encode(header, findings)


def test_plain_gloo_group_uses_flat_buffers_for_every_dtype():
    caps = decide([row(0), row(1)], "cpu", "gloo", [0, 1])
    for op in Op:
        for dtype in DTYPES:
            choice = caps.choice(op, dtype)
            assert (choice.primitive, choice.wire_dtype, choice.max_elements) == (Primitive.FLAT, dtype, UNLIMITED)


def test_one_rank_forbidding_flat_moves_the_whole_group_and_says_why():
    caps = decide([row(0), row(1, policy=Policy(forbid="flat"))], "cpu", "gloo", [0, 1])
    choice = caps.choice(Op.ALL_REDUCE, torch.float32)
    assert choice.primitive is Primitive.COALESCED
    assert "flat: forbidden by the override" in choice.why() and "(rank 1)" in choice.why()


def test_mpi4py_preferred_on_cpu_when_mapped_but_not_for_bf16():
    mpi_rows = [row(r, mpi=(Reason.OK, r, 2, 77)) for r in range(2)]
    # bf16: MPICH 5 has no MPI bf16 type; the MPI link reports it as DTYPE_UNSUPPORTED
    for k, (_op, prim, dtype) in enumerate(KEYS):
        if prim is Primitive.MPI4PY and dtype == torch.bfloat16:
            for r in mpi_rows:
                r[len(HEADER) + 2 * k] = int(Reason.DTYPE_UNSUPPORTED)
    caps = decide(mpi_rows, "cpu", "gloo", [0, 1])
    assert caps.choice(Op.ALL_REDUCE, torch.float32).primitive is Primitive.MPI4PY
    bf16 = caps.choice(Op.ALL_REDUCE, torch.bfloat16)
    assert bf16.primitive is Primitive.FLAT and "cannot reduce/gather this dtype" in bf16.why()


@pytest.mark.parametrize(
    "mpi_states",
    [
        [(Reason.OK, 0, 2, 77), (Reason.OK, 0, 2, 77)],  # two processes claim MPI rank 0
        [(Reason.OK, 0, 2, 77), (Reason.OK, 1, 2, 78)],  # two different MPI jobs
        [(Reason.OK, 0, 2, 0), (Reason.OK, 1, 2, 0)],  # job never verified
        [(Reason.OK, 0, 2, 77), (Reason.NOT_INSTALLED, -1, -1, 0)],
    ],
)
def test_mpi4py_only_when_torch_ranks_map_onto_one_mpi_job(mpi_states):
    caps = decide([row(r, mpi=m) for r, m in enumerate(mpi_states)], "cpu", "gloo", [0, 1])
    choice = caps.choice(Op.ALL_REDUCE, torch.float32)
    assert choice.primitive is Primitive.FLAT
    assert "mpi4py" in choice.why()


def test_torch_mpi_backend_upcasts_bf16_and_caps_counts_at_int32():
    rows = [row(r, backend="mpi", finder=torch_mpi_finding) for r in range(2)]
    caps = decide(rows, "cpu", "mpi", [0, 1])
    fp32 = caps.choice(Op.ALL_REDUCE, torch.float32)
    assert (fp32.primitive, fp32.max_elements) == (Primitive.FLAT, INT32_MAX)
    bf16 = caps.choice(Op.ALL_REDUCE, torch.bfloat16)
    assert (bf16.primitive, bf16.wire_dtype) == (Primitive.FLAT, torch.float32)
    assert caps.choice(Op.ALL_GATHER, torch.float32).primitive is Primitive.PER_TENSOR


def test_nothing_common_gives_no_primitive_on_every_rank():
    rows = [row(0, policy=Policy(force="coalesced")), row(1, policy=Policy(force="per_tensor"))]
    choice = decide(rows, "cpu", "gloo", [0, 1]).choice(Op.ALL_REDUCE, torch.float32)
    assert choice.primitive is None


def test_disagreeing_backends_raise():
    with pytest.raises(AgreementError, match="disagree on backend"):
        decide([row(0), row(1, backend="mpi")], "cpu", "gloo", [0, 1])


def test_invalid_policy_on_one_rank_raises_with_its_rank():
    with pytest.raises(PolicyError, match=r"rank\(s\) \[1\] of group"):
        decide([row(0), row(1, policy_ok=0)], "cpu", "gloo", [0, 1])


def test_policy_parsing_and_axes():
    p = Policy(force="gloo, flat")
    assert p.check(Primitive.FLAT, "gloo") is Reason.OK
    assert p.check(Primitive.COALESCED, "gloo") is Reason.NOT_FORCED
    assert p.check(Primitive.FLAT, "nccl") is Reason.NOT_FORCED
    assert Policy(force="mpi4py").check(Primitive.MPI4PY, "gloo") is Reason.OK
    assert Policy(forbid="gloo").check(Primitive.PER_TENSOR, "gloo") is Reason.FORBIDDEN
    assert Policy(forbid="gloo").check(Primitive.MPI4PY, "gloo") is Reason.OK
    assert Policy.from_env({"COLLGRAD_FORBID": "mpi4py"}).forbid == {"mpi4py"}
    assert Policy(forbid="flat").merged(Policy(force="coalesced")) == Policy(force="coalesced", forbid="flat")
    with pytest.raises(PolicyError, match="glo"):
        Policy(forbid="glo").validate()
    with pytest.raises(PolicyError, match="both forced and forbidden"):
        Policy(force="flat", forbid="flat").validate()


def test_gloo_table():
    assert gloo.finding("cuda", Op.ALL_REDUCE, Primitive.COALESCED, torch.float32).reason is Reason.BACKEND_LACKS
    assert gloo.finding("xpu", Op.ALL_REDUCE, Primitive.FLAT, torch.float32).reason is Reason.DEVICE_UNSUPPORTED
    assert gloo.finding("cpu", Op.ALL_GATHER, Primitive.COALESCED, torch.bfloat16).ok


def test_strided_gathers_only_where_every_rank_lays_them_out_and_coalesced_is_allowed():
    ranks = [0, 1]
    both = decide([row(0), row(1)], "cpu", "gloo", ranks)
    assert both.strided_gather(torch.float32)
    one = decide([row(0), row(1, strided=0)], "cpu", "gloo", ranks)
    assert not one.strided_gather(torch.float32)
    no_coalesced = Policy(forbid=frozenset({"coalesced"}))
    forbidden = decide([row(0, policy=no_coalesced), row(1, policy=no_coalesced)], "cpu", "gloo", ranks)
    assert forbidden.lays_out_strided and not forbidden.strided_gather(torch.float32)
