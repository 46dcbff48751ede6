"""The argument check's verdict, without a process group: the same rows give every rank the same
error, naming the ranks and what differs."""

from __future__ import annotations

import os
import subprocess
import sys

from collgrad.backends.agreement import INVALID, Field, call_verdict, stable_hash
from collgrad.errors import ArgumentMismatchError

FIELDS = [Field("bucket_bytes", 0), Field("shapes", 0, shown=False)]


def test_equal_rows_pass():
    assert call_verdict([[0, 5, 7], [0, 5, 7], [0, 5, 7]], FIELDS, [0, 1, 2], call="f", rank=0) is None


def test_a_shown_field_names_ranks_and_values_and_a_hashed_one_names_ranks():
    error = call_verdict([[0, 5, 7], [0, 5, 8], [0, 6, 7]], FIELDS, [4, 5, 6], call="f", rank=5)
    assert isinstance(error, ArgumentMismatchError)
    text = str(error)
    assert "bucket_bytes: rank(s) [4, 5] passed 5, rank(s) [6] passed 6" in text
    assert "shapes differ, ranks grouped by what they passed: [[4, 6], [5]]" in text
    assert text.endswith("pass the same arguments on every rank of the group") or "[seen by rank 5]" in text


def test_an_invalid_rank_is_named_before_any_difference():
    error = call_verdict([[0, 5, 7], [INVALID, 0, 0]], FIELDS, [0, 1], call="f", rank=0)
    assert "rank(s) [1] passed invalid arguments to f" in str(error)


def test_the_verdict_does_not_depend_on_the_rank_that_reaches_it():
    rows = [[0, 5, 7], [0, 5, 8]]
    texts = {str(call_verdict(rows, FIELDS, [0, 1], call="f", rank=r)).split(" [seen by")[0] for r in (0, 1)}
    assert len(texts) == 1


def test_stable_hash_is_the_same_in_every_process():
    # hash() of a str is salted per process; the check's hashes must not be.
    code = "from collgrad.backends.agreement import stable_hash; print(stable_hash([('float32', 'cpu'), (3, 4)]))"
    runs = [  # two interpreters at once (each imports torch: seconds)
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    seen = {run.communicate(timeout=120)[0].strip() for run in runs}
    assert all(run.returncode == 0 for run in runs)
    assert seen == {str(stable_hash([("float32", "cpu"), (3, 4)]))}
    assert 0 <= stable_hash("x") < 2**63
