"""Timing calls on every rank: one call between barriers, a series with its memory, pairs in ABBA order.

Every method here issues barriers (and ``timed`` one all-reduce) on the default group: call it on every
rank of that group, in the same order, with the same counts.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from collgrad.bench.memory import DeviceMemory, PeakHost, host_bytes_in_use, minor_faults

__all__ = ["Clock", "MEMORY_REPS"]

#: Calls measured for peak memory, after the timed ones.
MEMORY_REPS = 2


class Clock:
    """Times calls on ``device``; prints progress on stderr when ``progress`` (rank 0's clock)."""

    def __init__(self, device: torch.device, progress: bool = False) -> None:
        self.device = device
        self.progress = progress
        self.memory = DeviceMemory(device)
        self._host = host_bytes_in_use()

    def _show(self, label: str, rep: int, reps: int) -> None:
        """One line per method on stderr, rewritten in place."""
        if self.progress:
            end = "\n" if rep + 1 == reps else ""
            print(f"\r[bench] {label}: {rep + 1}/{reps}", end=end, file=sys.stderr, flush=True)

    def once(self, fn: Callable[[], Any], inside: list[float] | None = None) -> float:
        """Seconds of one call on every rank (between barriers; the device synchronized). The output is
        freed before the next call: it counts in that call only. ``inside``: gets this rank's seconds in
        the call itself, without the barriers."""
        self.memory.synchronize()
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        self.memory.synchronize()
        if inside is not None:
            inside.append(time.perf_counter() - start)
        dist.barrier()
        elapsed = time.perf_counter() - start
        del result
        return elapsed

    def _peaks(self, fn: Callable[[], Any]) -> tuple[int, int]:
        """Peak extra host and device bytes over ``MEMORY_REPS`` calls, measured apart from the timed
        ones: the host sampler is a thread that takes the GIL every millisecond, so it would slow the
        Python it measures."""
        peak_host = peak_dev = 0
        for _ in range(MEMORY_REPS):
            self.memory.start()
            dist.barrier()
            with PeakHost(self._host) as host:
                result = fn()
                self.memory.synchronize()
                dist.barrier()
                del result
            peak_host = max(peak_host, host.extra)
            peak_dev = max(peak_dev, self.memory.extra())
        return peak_host, peak_dev

    def timed(self, fn: Callable[[], Any], reps: int, warmup: int, label: str) -> dict[str, float]:
        """Median, min and max of ``reps`` calls after ``warmup``, the slowest rank's time inside the
        call, minor page faults per call, then the peak memory of separate calls."""
        for _ in range(warmup):
            fn()
        times: list[float] = []
        faults: list[int] = []
        inside: list[float] = []
        for rep in range(reps):
            before = minor_faults()
            times.append(self.once(fn, inside))
            faults.append(minor_faults() - before)
            self._show(label, rep, reps)
        # Per call, the slowest rank's time inside it: what a caller waits for, less the harness's
        # barriers and the skew they leave between ranks (most of a sub-millisecond call's wall time).
        slowest = torch.tensor(inside, dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        peak_host, peak_dev = self._peaks(fn)
        ms = [t * 1e3 for t in times]
        return {
            "median_ms": statistics.median(ms),
            "min_ms": min(ms),
            "max_ms": max(ms),
            "call_ms": statistics.median(slowest.tolist()) * 1e3,
            "page_faults": statistics.median(faults),
            "peak_host_mb": peak_host / 2**20,
            "peak_device_mb": peak_dev / 2**20,
        }

    def paired(self, fn: Callable[[], Any], floor: Callable[[], Any], pairs: int, label: str) -> dict[str, float]:
        """``fn`` and ``floor`` timed alternately, ``pairs`` pairs, in ABBA order (every other pair runs
        ``fn`` first, so neither always runs right after the other's frees and barriers): the median of
        the per-pair ratios ``fn / floor`` and their spread."""
        ratios = []
        for rep in range(pairs):
            if rep % 2:
                mine = self.once(fn)
                below = self.once(floor)
            else:
                below = self.once(floor)
                mine = self.once(fn)
            ratios.append(mine / below)
            self._show(label, rep, pairs)
        return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
