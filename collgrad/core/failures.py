"""What happens when a primitive raises on a rank before a bucket's data moves.

The ranks learn of it out of band, through the process group's key-value store (which needs no
collective, so it cannot be confused with the bucket's own collective)::

    rank that raised                         ranks that did not
    ----------------                         ------------------
    set  r<rank> = "failed: ..."             wait on the bucket's collective, in slices; after each
    add  failed += 1, responded += 1         slice look at "failed": if > 0, set r<rank> = "ok",
    poll responded until == group size       add responded += 1 and raise RankFailedError
    failed == size: every rank raised        (the collective can never complete)
      -> the bucket falls back, on every rank alike, to one collective per tensor
    otherwise -> raise CollgradError (with this rank's reason; CollgradTimeoutError if some rank never answered)

Either every rank falls back together and the results are those of the per-tensor path, or every
rank raises within seconds (each bounded by the collgrad timeout). Keys are namespaced by group and
by a per-group call counter that advances identically on every rank.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from collgrad import _compat
from collgrad.errors import CollgradError, CollgradTimeoutError

__all__ = ["BucketFailures", "FaultPoint", "next_call"]

# Calls per process group, counted for the whole process (not per Dispatcher): store keys are shared
# by the whole job, so two dispatchers must never reuse a call number. Every rank makes its calls on a
# group in the same order, so the numbers agree. Weak: forgotten with the group.
_CALLS: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def next_call(group: dist.ProcessGroup) -> int:
    _CALLS[group] = call = _CALLS.get(group, 0) + 1
    return call


@dataclass(frozen=True)
class FaultPoint:
    """Where a test hook may inject a failure: just before a bucket's collective is issued."""

    op: str
    bucket: int
    primitive: str
    rank: int


class BucketFailures:
    def __init__(self, group: dist.ProcessGroup, call: int) -> None:
        self.group = group
        self.ranks = _compat.group_ranks(group)
        self.prefix = f"collgrad/{_compat.group_key(group)}/call{call}"
        self._store: _compat.Store | None = None

    @property
    def store(self) -> _compat.Store:
        if self._store is None:
            self._store = _compat.default_store()
        return self._store

    def _key(self, bucket: int, name: str) -> str:
        return f"{self.prefix}/b{bucket}/{name}"

    def failed_elsewhere(self, bucket: int) -> bool:
        """Called by a rank waiting on ``bucket``: has any rank reported that it could not send it?"""
        return int(self.store.add(self._key(bucket, "failed"), 0)) > 0

    def acknowledge(self, bucket: int) -> str:
        """This rank did not fail but learned that others did: answer them, and describe who failed."""
        me = dist.get_rank()
        self.store.set(self._key(bucket, f"r{me}"), "ok")
        self.store.add(self._key(bucket, "responded"), 1)
        return self._who_failed(bucket)

    def report(self, bucket: int, reason: str, timeout_s: float) -> bool:
        """This rank raised before sending ``bucket``. Returns True when every rank did (fall back
        together); raises CollgradError when some did not, or did not answer within ``timeout_s``."""
        me = dist.get_rank()
        self.store.set(self._key(bucket, f"r{me}"), f"failed: {reason}")
        self.store.add(self._key(bucket, "failed"), 1)
        self.store.add(self._key(bucket, "responded"), 1)
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while self.store.add(self._key(bucket, "responded"), 0) < len(self.ranks):
            if time.monotonic() > deadline:
                raise CollgradTimeoutError(
                    f"rank {me}: bucket {bucket} could not be sent ({reason}) and not every rank of group "
                    f"{self.ranks} answered within {timeout_s:g} s; the group is no longer usable: stop the job"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        failed = self.store.add(self._key(bucket, "failed"), 0)
        if failed == len(self.ranks):
            return True
        raise CollgradError(
            f"rank {me}: bucket {bucket} could not be sent ({reason}); other ranks had already sent theirs "
            f"({self._who_failed(bucket)}), so the group cannot fall back together and is no longer usable. "
            "No output buffer of this call was written. Stop the job and look at the failing rank's error."
        )

    def _who_failed(self, bucket: int) -> str:
        failed = []
        for rank in self.ranks:
            key = self._key(bucket, f"r{rank}")
            if self.store.check([key]) and self.store.get(key).decode().startswith("failed"):
                failed.append(rank)
        return f"it failed on rank(s) {failed} of group {self.ranks}"
