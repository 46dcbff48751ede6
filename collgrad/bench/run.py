"""One benchmark run on the ranks of the default group: build the engine, time every method, read its
record, measure streaming memory, pair each method with its floor and each loop with collgrad.

``run_bench`` issues collectives (the engine's, collgrad's, the timing barriers): call it on every rank
of an initialized default group, with the same configuration.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

import collgrad
from collgrad.bench.config import BenchConfig
from collgrad.bench.methods import Method, Setting, floors, make_setting, methods_for, versus
from collgrad.bench.models import build_subject
from collgrad.bench.report import ratios
from collgrad.bench.timing import Clock

__all__ = ["run_bench"]

Bound = list[tuple[Method, Any]]


def _header(cfg: BenchConfig, setting: Setting) -> dict[str, Any]:
    sub = setting.subject
    return {
        "config": asdict(cfg),
        "world": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "torch": torch.__version__,
        "optimizer": sub.optimizer,
        "deepspeed": sub.deepspeed,
        "source": cfg.source,
        "params": len(sub.params),
        "numel": sub.numel,
        "grad_dtype": str(setting.share.dtype).removeprefix("torch."),
        "element_size": setting.element_size,
        "result_mb": setting.grad_bytes / 2**20,
        "methods": {},
    }


def _stream_memory(setting: Setting, clock: Clock) -> dict[str, float]:
    """Streaming memory: a bucket of 1/stream_fraction of the model's gradient bytes."""
    engine, small = setting.subject.engine, setting.small_bucket

    def stream_small() -> None:  # consumed without keeping a reference: what collgrad holds is measured
        deque(collgrad.iter_full_model_grads(engine, bucket_bytes=small), maxlen=0)

    row = clock.timed(stream_small, reps=3, warmup=1, label="stream_memory")
    return {
        "bucket_mb": small / 2**20,
        "peak_extra_mb": row["peak_host_mb"],
        "peak_device_mb": row["peak_device_mb"],
        "buckets": row["peak_host_mb"] * 2**20 / small,
    }


def _pairs(bound: Bound, cfg: BenchConfig, clock: Clock) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each method against its floor (``cfg.pairs`` pairs), then each loop against its collgrad method
    (``cfg.reps`` pairs, ratio loop / collgrad). Paired, the two alternate, so both see the same machine
    (on a shared machine the medians of separate series drift apart by more than the difference)."""
    calls = {m.name: call for m, call in bound}
    paired = {
        name: clock.paired(calls[name], calls[f.method], cfg.pairs, f"{name} vs {f.method}")
        for name, f in floors().items()
        if name in calls and f.method in calls
    }
    against = {
        f"{slow}_over_{ours}": clock.paired(calls[slow], calls[ours], cfg.reps, f"{slow} vs {ours}")
        for slow, ours in versus()
        if slow in calls and ours in calls
    }
    return paired, against


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run on every rank of the default group (already initialized). Returns the report (rank 0's
    clock; every rank returns one, rank 0's is the one printed)."""
    subject = build_subject(cfg)
    setting = make_setting(subject, cfg)
    clock = Clock(subject.device, progress=progress and dist.get_rank() == 0)
    bound = [(m, m.bind(setting)) for m in methods_for(cfg.source, cfg.methods, cfg.stage)]
    report = _header(cfg, setting)
    for method, call in bound:
        row = clock.timed(call, cfg.reps, cfg.warmup, method.name)
        row.update(method.read(setting, call).row())
        report["methods"][method.name] = row
    report["stream_memory"] = _stream_memory(setting, clock)
    report["paired"], report["paired_versus"] = _pairs(bound, cfg, clock)
    report["ratios"] = ratios(report, cfg)
    dist.barrier()  # every rank done with the save methods' directory
    if dist.get_rank() == 0:
        setting.close()
    return report
