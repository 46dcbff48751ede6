"""Bad input gets a clear error on every rank, quickly: never a hang or a wrong value."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'collgrad[deepspeed]')")


import pytest
import torch

from tests.harness import attempt, run_ranks

pytestmark = pytest.mark.guarantees  # the README's Guarantees section


def _cases(rank, world):
    import deepspeed

    import collgrad
    from collgrad import Policy
    from tests.deepspeed import models

    eng = models.engine(models.config(2))
    models.run_backward(eng, rank)
    names = [n for n, p in eng.module.named_parameters() if p.requires_grad]
    other = models.Net()
    bare, *_ = deepspeed.initialize(model=models.Net(), config=models.config(0))  # no optimizer
    fast = collgrad.Dispatcher(timeout=5)
    reference = collgrad.safe_get_full_model_grads(eng)
    get = collgrad.safe_get_full_model_grads
    out = {
        "not_a_model": attempt(lambda: get(42)),
        "engine_without_optimizer": attempt(lambda: get(bare)),
        "parameters_of_another_model": attempt(lambda: get(eng, params=[other.inp.weight])),
        "empty_subset": attempt(lambda: get(eng, params=[])),
        "empty_model": attempt(lambda: get(torch.nn.Sequential())),
        "invalid_bucket_size": attempt(lambda: get(eng, bucket_bytes=0)),
        "unknown_forced_backend": attempt(lambda: get(eng, policy=Policy(force="glooo"))),
        "unavailable_forced_backend": attempt(lambda: get(eng, policy=Policy(force="nccl"))),
        "unknown_plan": attempt(lambda: get(eng, plan="scatter")),
        # one rank alone with bad arguments: the others learn it in the readiness check
        "bad_bucket_on_one_rank": attempt(lambda: get(eng, bucket_bytes=-1 if rank == 0 else None, dispatcher=fast)),
        "different_bucket_bytes": attempt(lambda: get(eng, bucket_bytes=1 << 20 if rank == 0 else None)),
        "different_plans": attempt(lambda: get(eng, plan="all_gather" if rank == 0 else "all_reduce")),
        "reordered_subset": attempt(
            lambda: list(get(eng, params=names[::-1] if rank == 0 else names).items()), keep=True
        ),
    }
    out["reordered_subset"]["equal"] = out["reordered_subset"]["error"] is None and all(
        torch.equal(t, reference[n]) for n, t in out["reordered_subset"].pop("value")
    )
    out["valid_after_all_that"] = attempt(lambda: len(get(eng)))
    out["module"] = _through_the_module(eng, reference, world)
    return out


def _through_the_module(eng, reference, world):
    """The module an engine wraps, passed instead of the engine: the same values, the engine looked up
    once per call (from the module's own hooks), and no scan of the garbage collector's objects."""
    import gc
    import os
    import shutil
    import tempfile

    import collgrad
    from collgrad.state.adapters import deepspeed as ds_adapter

    lookups, scans = [], []
    real_find, real_referrers, real_objects = ds_adapter.find_engine, gc.get_referrers, gc.get_objects
    ds_adapter.find_engine = lambda m: lookups.append(m) or real_find(m)
    gc.get_referrers = lambda *a: scans.append("get_referrers") or real_referrers(*a)
    gc.get_objects = lambda *a, **k: scans.append("get_objects") or real_objects(*a, **k)
    directory = os.path.join(tempfile.gettempdir(), f"collgrad-through-module-{world}-{os.getppid()}")
    try:
        grads = collgrad.safe_get_full_model_grads(eng.module)
        after_grads = len(lookups)
        collgrad.save_full_model(eng.module, directory)
        after_save = len(lookups)
    finally:
        ds_adapter.find_engine, gc.get_referrers, gc.get_objects = real_find, real_referrers, real_objects
        shutil.rmtree(directory, ignore_errors=True)
    equal = list(grads) == list(reference) and all(torch.equal(grads[n], reference[n]) for n in reference)
    return {"equal": equal, "lookups": (after_grads, after_save - after_grads), "scans": scans}


# (the typed error, the builtin type it also is for code that catches those, text in the message)
EXPECTED = {
    "not_a_model": ("InvalidArgumentError", "TypeError", "expected a DeepSpeed engine or a torch.nn.Module"),
    "engine_without_optimizer": ("InvalidArgumentError", "ValueError", "has no optimizer"),
    "parameters_of_another_model": ("UnknownParameterError", "KeyError", "not a trainable parameter of this model"),
    "empty_subset": ("InvalidArgumentError", "ValueError", "no trainable parameter is selected"),
    "empty_model": ("InvalidArgumentError", "ValueError", "no trainable parameter is selected"),
    "invalid_bucket_size": ("InvalidArgumentError", "ValueError", "bucket_bytes must be positive"),
    "unknown_forced_backend": ("PolicyError", "ValueError", "glooo"),
    "unavailable_forced_backend": ("NoPrimitiveError", "CollgradError", "another backend/primitive is forced"),
    "unknown_plan": ("InvalidArgumentError", "ValueError", "plan must be one of"),
    "different_bucket_bytes": ("ArgumentMismatchError", "CollgradError", "bucket_bytes: rank(s) [0] passed 1048576"),
    "different_plans": ("ArgumentMismatchError", "CollgradError", "plan= differ, ranks grouped by what they passed"),
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_ranks(_cases, request.param, timeout=300)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_raises_the_same_clear_error_on_every_rank(results, case):
    kind, builtin, text = EXPECTED[case]
    for rank, res in enumerate(results):
        assert res[case]["error"] == kind, (rank, res[case])
        assert builtin in res[case]["is_a"] and "CollgradError" in res[case]["is_a"]
        assert text in res[case]["message"]
        assert res[case]["seconds"] < 10


def test_bad_arguments_on_one_rank_make_every_rank_raise(results):
    assert results[0]["bad_bucket_on_one_rank"]["error"] == "InvalidArgumentError"
    assert "ValueError" in results[0]["bad_bucket_on_one_rank"]["is_a"]
    for res in results[1:]:
        assert res["bad_bucket_on_one_rank"]["error"] == "ArgumentMismatchError"
        assert "rank(s) [0] passed invalid arguments" in res["bad_bucket_on_one_rank"]["message"]
        assert res["bad_bucket_on_one_rank"]["seconds"] < 5


def test_parameter_order_does_not_matter(results):
    assert all(res["reordered_subset"]["equal"] for res in results)  # results keep named_parameters() order


def test_the_engine_still_works_after_bad_calls(results):
    assert all(res["valid_after_all_that"]["error"] is None for res in results)


def test_the_module_an_engine_wraps_is_resolved_once_per_call_without_scanning_memory(results):
    for res in results:
        assert res["module"]["equal"]
        assert res["module"]["lookups"] == (1, 1)  # safe_get_full_model_grads, save_full_model
        assert res["module"]["scans"] == []
