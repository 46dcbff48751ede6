"""``python -m collgrad bench``: full-model gradient access measured side by side, on one engine.

Methods, each timed barrier to barrier over ``--reps`` repetitions after warm-up:

  deepspeed_loop   ``deepspeed.utils.safe_get_full_grad`` for every parameter (the status quo)
  collgrad_<plan>  ``safe_get_full_model_grads`` for each plan the group allows (all_gather,
                   all_reduce, and the per-tensor fallback forced through the registry)
  collgrad_iter    ``iter_full_model_grads`` consumed to the end
  raw_all_reduce   one all_reduce of a flat buffer holding the model's gradient bytes (the floor)
  raw_all_gather   one all_gather of each rank's share of those bytes into the full buffer

Reported per method: median, min and max (ms, rank 0's clock), bytes this rank sent into
collectives, collectives issued, peak extra memory (host bytes in use, sampled every ms; device peak
allocation on CUDA/XPU), and ratios against the floor and the DeepSpeed loop.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from collgrad import _compat
from collgrad.backends import mpi as mpi_launcher  # launcher facts only: mpi4py is imported lazily there

__all__ = ["BenchConfig", "run_bench", "main"]


@dataclass
class BenchConfig:
    stage: int = 2
    dtype: str = "fp32"  # fp32 | bf16 (with fp32 gradient accumulation) | fp16
    offload: bool = False
    tensors: int = 400
    elements: int = 6_553_600
    bucket_mb: float = 25.0
    reps: int = 7
    #: pairs for each plan against its floor (cheap: tens of ms each); the loops use ``reps``
    pairs: int = 21
    warmup: int = 2
    stream_fraction: int = 8  # the streaming check uses a bucket of 1/8 of the model's gradient
    methods: tuple[str, ...] = ()  # empty: all
    world: int = 0  # local runs: ranks to spawn (0: --local, or 2)
    source: str = "deepspeed"  # deepspeed (ZeRO --stage) | fsdp2 (fully_shard)


class VectorModel(nn.Module):
    """``tensors`` parameters of ``elements / tensors`` elements each; every one gets a gradient."""

    def __init__(self, tensors: int, elements: int) -> None:
        super().__init__()
        self.width = max(1, elements // tensors)
        gen = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.rand(self.width, generator=gen) * 0.1 + 0.95) for _ in range(tensors)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in self.weights:
            h = h * w
        return h.float().pow(2).mean()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _host_bytes_in_use() -> Callable[[], int]:
    """Bytes the C allocator has handed out and not taken back (glibc ``mallinfo2``: all arenas plus
    mmapped blocks), where torch's CPU tensors live. Unlike RSS it falls when memory is freed, so a
    peak above the level at start is the memory a call really held. Falls back to RSS elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2

        def in_use() -> int:
            info = libc.mallinfo2()
            return info.uordblks + info.hblkhd

        in_use()
        return in_use
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        return rss


#: Calls measured for peak memory, after the timed ones.
_MEMORY_REPS = 2


class _PeakHost:
    """Peak host memory in use above the level at start, sampled every millisecond by a thread."""

    _measure = staticmethod(_host_bytes_in_use())

    def __enter__(self) -> "_PeakHost":
        self.base = self.peak = self._measure()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._measure())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._measure())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


def _ds_config(cfg: BenchConfig) -> dict:
    zero: dict[str, Any] = {"stage": cfg.stage}
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if cfg.dtype == "bf16":
        out["bf16"] = {"enabled": True}
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    elif cfg.dtype == "fp16":
        out["fp16"] = {"enabled": True}
    return out


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _once(fn: Callable[[], Any], device: torch.device, inside: list[float] | None = None) -> float:
    """Seconds of one call on every rank (between barriers; the device synchronized). The output is
    freed before the next call: it counts in that call only. ``inside``: gets this rank's seconds in
    the call itself, without the barriers."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if inside is not None:
        inside.append(time.perf_counter() - start)
    dist.barrier()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def _minor_faults() -> int:
    """This process's minor page faults so far (POSIX ``getrusage``; 0 where there is none). A call
    whose fresh buffers get pages the C allocator had given back to the system pays one fault per
    4 KiB page on first touch (~1.5 us each here: 10 ms for a 25 MB result), and whether it does
    depends on what the allocator did before, not on the method: the faults column tells those
    calls apart."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _progress(label: str, rep: int, reps: int) -> None:
    """One line per method on stderr, rewritten in place."""
    print(f"\r[bench] {label}: {rep + 1}/{reps}", end="\n" if rep + 1 == reps else "", file=sys.stderr, flush=True)


def _timed(fn: Callable[[], Any], cfg: BenchConfig, label: str, progress: bool) -> dict[str, Any]:
    """Median time of ``cfg.reps`` calls, then the peak memory of separate calls: the host sampler is a
    thread that takes the GIL every millisecond, so it would slow the Python it measures."""
    device = _device()
    for _ in range(cfg.warmup):
        fn()
    times, faults, inside = [], [], []
    for rep in range(cfg.reps):
        before = _minor_faults()
        times.append(_once(fn, device, inside))
        faults.append(_minor_faults() - before)
        if progress:
            _progress(label, rep, cfg.reps)
    # Per call, the slowest rank's time inside it: what a caller waits for, less the harness's
    # barriers and the skew they leave between ranks (most of a sub-millisecond call's wall time here).
    slowest = torch.tensor(inside, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak_host = peak_dev = 0
    for _ in range(_MEMORY_REPS):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        dist.barrier()
        with _PeakHost() as rss:
            result = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            del result
        peak_host = max(peak_host, rss.extra)
        if device.type == "cuda":
            peak_dev = max(peak_dev, torch.cuda.max_memory_allocated() - before)
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


def _paired(
    fn: Callable[[], Any], floor: Callable[[], Any], pairs: int, label: str, progress: bool
) -> dict[str, float]:
    """``fn`` and ``floor`` timed alternately, ``pairs`` pairs, in ABBA order (every other pair runs
    ``fn`` first, so neither always runs right after the other's frees and barriers): the median of the
    per-pair ratios and their spread."""
    device = _device()
    ratios = []
    for rep in range(pairs):
        if rep % 2:
            mine = _once(fn, device)
            below = _once(floor, device)
        else:
            below = _once(floor, device)
            mine = _once(fn, device)
        ratios.append(mine / below)
        if progress:
            _progress(label, rep, pairs)
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _raw_all_reduce(numel: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float32, device=device)
    dist.all_reduce(out)
    return out


def _raw_all_gather(share: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(share.numel() * world, dtype=share.dtype, device=share.device)
    _compat.all_gather_flat(out, share, _compat.default_group()).wait()
    return out


def _deepspeed_model(cfg: BenchConfig, rank: int, device: torch.device) -> tuple[Any, list, int, dict[str, Any]]:
    """A DeepSpeed engine after one backward, its parameters, their elements, and DeepSpeed's own
    per-parameter loops (get, set, norm) to compare with."""
    from collgrad.grads.sources import deepspeed as ds  # the adapter: collgrad's one door to DeepSpeed

    model = VectorModel(cfg.tensors, cfg.elements)
    engine = ds.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-4), _ds_config(cfg))
    dtype = next(engine.module.parameters()).dtype
    x = torch.rand(2, model.width, generator=torch.Generator().manual_seed(rank)).to(device=engine.device, dtype=dtype)
    engine.backward(engine(x))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    numel = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)

    def set_loop(full: dict[str, torch.Tensor]) -> Callable[[], Any]:
        by_param = [(p, full[n]) for n, p in engine.module.named_parameters() if n in full]
        return lambda: [ds.safe_set_full_grad(p, g) for p, g in by_param]

    loops = {
        "version": ds.VERSION,
        "get": lambda: [ds.safe_get_full_grad(p) for p in params],
        "set": set_loop,
        "norm": lambda: [float(ds.safe_get_full_grad(p).norm()) for p in params],
    }
    return engine, params, numel, loops


def _fsdp2_model(cfg: BenchConfig, rank: int, world: int, device: torch.device) -> tuple[Any, list, int]:
    """The same synthetic model sharded with ``fully_shard`` over every rank, after one backward."""
    from collgrad.grads.sources import fsdp2  # collgrad's one door to FSDP2

    model = fsdp2.shard_whole(VectorModel(cfg.tensors, cfg.elements).to(device), device.type, world)
    x = torch.rand(2, model.width, generator=torch.Generator().manual_seed(rank)).to(device)
    model(x).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, sum(p.numel() for p in params)


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run on every rank of the default group (already initialized). Returns rank 0's report."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import collgrad
    from collgrad import Policy

    rank, world = dist.get_rank(), dist.get_world_size()
    bucket = int(cfg.bucket_mb * 2**20)
    device = _device()
    methods: dict[str, Callable[[], Any]] = {}
    meta: dict[str, dict[str, Any]] = {}
    if cfg.source == "fsdp2":
        engine, params, numel = _fsdp2_model(cfg, rank, world, device)
        methods["full_tensor_loop"] = lambda: [p.grad.full_tensor() for p in params]
        meta["full_tensor_loop"] = {"collectives": len(params), "bytes": 4 * numel * (world - 1) // world}
        origin = {"optimizer": "torch.optim.SGD (fully_shard)", "deepspeed": None}
    else:
        engine, params, numel, loops = _deepspeed_model(cfg, rank, device)
        origin = {"optimizer": type(engine.optimizer).__name__, "deepspeed": loops.pop("version")}
        methods["deepspeed_loop"] = loops["get"]
        meta["deepspeed_loop"] = {"collectives": len(params), "bytes": 4 * numel}
    share = torch.ones(-(-numel // world), dtype=torch.float32, device=device)
    for plan in ("all_gather", "all_reduce"):
        methods[f"collgrad_{plan}"] = lambda plan=plan: collgrad.safe_get_full_model_grads(
            engine, plan=plan, bucket_bytes=bucket
        )
    per_tensor = Policy(force="per_tensor")
    methods["collgrad_per_tensor"] = lambda: collgrad.safe_get_full_model_grads(
        engine, policy=per_tensor, bucket_bytes=bucket
    )
    # Where ranks hold gradients whole (BF16_Optimizer, stage 0): the optimizer's tensors, no copy.
    methods["collgrad_no_copy"] = lambda: collgrad.safe_get_full_model_grads(engine, bucket_bytes=bucket, copy=False)
    # deque(maxlen=0) consumes without keeping a reference: what is measured is what collgrad holds.
    methods["collgrad_iter"] = lambda: deque(collgrad.iter_full_model_grads(engine, bucket_bytes=bucket), maxlen=0)
    # Writing and statistics, against DeepSpeed's own per-parameter loops. The values written are the
    # gradients themselves, so every repetition sees the same gradients.
    full = collgrad.safe_get_full_model_grads(engine)
    if cfg.source != "fsdp2":
        methods["deepspeed_set_loop"] = loops["set"](full)
        # ZeRO-1/2: DeepSpeed's setter copies this rank's fragment locally (tensor_fragment.set_full_hp_grad);
        # ZeRO-3: it too writes the local partition only.
        meta["deepspeed_set_loop"] = {"collectives": 0, "bytes": 0}
    methods["collgrad_set"] = lambda: collgrad.safe_set_full_model_grads(engine, full)
    methods["collgrad_set_unchecked"] = lambda: collgrad.safe_set_full_model_grads(engine, full, check=False)
    methods["collgrad_update"] = lambda: collgrad.update_full_model_grads(
        engine, lambda n, g: None, bucket_bytes=max(1, 4 * numel // cfg.stream_fraction)
    )
    if cfg.source != "fsdp2":
        methods["deepspeed_norm_loop"] = loops["norm"]
        meta["deepspeed_norm_loop"] = {"collectives": len(params), "bytes": 4 * numel}
    else:
        methods["full_tensor_norm_loop"] = lambda: [float(p.grad.full_tensor().norm()) for p in params]
        meta["full_tensor_norm_loop"] = meta["full_tensor_loop"]
    methods["collgrad_stats"] = lambda: collgrad.model_grad_stats(engine)
    # The floors: the same collective on the same bytes into a fresh output (collgrad's plans allocate
    # theirs too; the all_reduce plan zero-fills its bucket, so does this).
    methods["raw_all_reduce"] = lambda: _raw_all_reduce(numel, device)
    meta["raw_all_reduce"] = {"collectives": 1, "bytes": numel * 4}
    methods["raw_all_gather"] = lambda: _raw_all_gather(share, world)
    meta["raw_all_gather"] = {"collectives": 1, "bytes": share.numel() * 4}
    if cfg.methods:
        methods = {k: v for k, v in methods.items() if k in cfg.methods}

    report: dict[str, Any] = {
        "config": asdict(cfg),
        "world": world,
        "backend": str(dist.get_backend()),
        "torch": torch.__version__,
        **origin,
        "source": cfg.source,
        "params": len(params),
        "numel": numel,
        "result_mb": numel * 4 / 2**20,
        "methods": {},
    }
    for name, fn in methods.items():
        row = _timed(fn, cfg, name, progress and rank == 0)
        if name.startswith("collgrad") and name != "collgrad_iter":
            result = fn()
            rec = getattr(result, "record", result)  # set and update return their record itself
            row.update(
                collectives=rec.collectives,
                bytes=rec.bytes,
                plans=[g.plan for g in rec.groups],
                plan_cached=getattr(rec, "plan_cached", None),
            )
        elif name == "collgrad_iter":
            stream = collgrad.iter_full_model_grads(engine, bucket_bytes=bucket)
            for _ in stream:
                pass
            rec = stream.record()
            row.update(collectives=rec.collectives, bytes=rec.bytes, plans=[g.plan for g in rec.groups])
        else:
            row.update(meta.get(name, {}))
        report["methods"][name] = row

    # Streaming memory: a bucket of 1/stream_fraction of the model's gradient.
    small = max(1, 4 * numel // cfg.stream_fraction)

    def stream_small():
        deque(collgrad.iter_full_model_grads(engine, bucket_bytes=small), maxlen=0)

    stream_row = _timed(stream_small, BenchConfig(reps=3, warmup=1), "stream_memory", progress and rank == 0)
    report["stream_memory"] = {
        "bucket_mb": small / 2**20,
        "peak_extra_mb": stream_row["peak_host_mb"],
        "peak_device_mb": stream_row["peak_device_mb"],
        "buckets": stream_row["peak_host_mb"] * 2**20 / small,
    }
    # Each plan against its floor, paired: the two alternate, so both see the same machine (on a shared
    # machine the medians of separate series drift apart by more than the difference measured).
    report["paired"] = {
        method: _paired(methods[method], methods[floor], cfg.pairs, f"{method} vs {floor}", progress and rank == 0)
        for method, floor in FLOORS.items()
        if method in methods and floor in methods
    }
    # The per-parameter loops against collgrad, paired the same way (ratio = loop / collgrad).
    report["paired_versus"] = {
        f"{loop}_over_{ours}": _paired(
            methods[loop], methods[ours], cfg.reps, f"{loop} vs {ours}", progress and rank == 0
        )
        for loop, ours in _VERSUS
        if loop in methods and ours in methods
    }
    _ratios(report, cfg)
    return report


_VERSUS = (
    ("deepspeed_set_loop", "collgrad_set"),
    ("deepspeed_norm_loop", "collgrad_stats"),
    ("full_tensor_norm_loop", "collgrad_stats"),
)


#: Each plan against its own floor (the same collective on the same bytes into a fresh output), and the
#: goal for the ratio (issue "to the floor"); ZeRO-3's all-gather plan also reorders, hence its 1.20.
FLOORS = {
    "collgrad_all_gather": "raw_all_gather",
    "collgrad_all_reduce": "raw_all_reduce",
    "collgrad_iter": "raw_all_reduce",
}


def _goal(method: str, stage: int) -> float:
    if method == "collgrad_iter":
        return 1.25
    return 1.20 if method == "collgrad_all_gather" and stage == 3 else 1.10


def _ratios(report: dict[str, Any], cfg: BenchConfig) -> None:
    m = report["methods"]
    out: dict[str, Any] = {"floors": {}}
    for method, floor in FLOORS.items():
        if method in m and floor in m:
            paired = report.get("paired", {}).get(method)
            out["floors"][method] = {
                "floor": floor,
                # paired (alternating) where measured; else the ratio of the two medians
                "time_ratio": paired["ratio"] if paired else m[method]["median_ms"] / m[floor]["median_ms"],
                "spread": (paired["min"], paired["max"]) if paired else None,
                "goal": _goal(method, cfg.stage),
                "memory_mb": max(m[method]["peak_host_mb"], m[method]["peak_device_mb"]),
            }
    best = (
        min((m[k]["median_ms"], k) for k in ("collgrad_all_gather", "collgrad_all_reduce") if k in m)
        if any(k in m for k in ("collgrad_all_gather", "collgrad_all_reduce"))
        else None
    )
    loop = "deepspeed_loop" if "deepspeed_loop" in m else "full_tensor_loop"
    if best and loop in m:
        out["collgrad_best"] = best[1]
        out["loop"] = loop
        out["loop_over_collgrad"] = m[loop]["median_ms"] / best[0]
    for loop, ours in _VERSUS:
        paired = report.get("paired_versus", {}).get(f"{loop}_over_{ours}")
        if paired:
            out[f"{loop}_over_{ours}"] = paired["ratio"]
            out[f"{loop}_over_{ours}_spread"] = (paired["min"], paired["max"])
        elif loop in m and ours in m:
            out[f"{loop}_over_{ours}"] = m[loop]["median_ms"] / m[ours]["median_ms"]
    if "collgrad_update" in m:
        bucket = 4 * report["numel"] // cfg.stream_fraction
        out["update_peak_buckets"] = m["collgrad_update"]["peak_host_mb"] * 2**20 / max(1, bucket)
    report["ratios"] = out


def _what(report: dict[str, Any]) -> str:
    cfg = report["config"]
    if cfg.get("source") == "fsdp2":
        return "FSDP2 fully_shard fp32"
    return f"ZeRO-{cfg['stage']} {cfg['dtype']}{' offload' if cfg['offload'] else ''}"


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"collgrad bench: {_what(report)}, "
        f"{report['params']} tensors / {report['numel']:,} elements, {report['world']} ranks over "
        f"{report['backend']}, {report['optimizer']}, torch {report['torch']}, deepspeed {report['deepspeed']}, "
        f"bucket {cfg['bucket_mb']} MiB, median of {cfg['reps']}",
        f"{'method':<22}{'median ms':>11}{'min':>9}{'max':>9}{'in call':>9}{'MB sent':>10}{'colls':>7}"
        f"{'peak MB':>9}{'faults':>8}  plan",
    ]
    for name, row in report["methods"].items():
        plan = ",".join(row.get("plans", []) or [])
        if row.get("plan_cached") is not None:
            plan += " (plan from cache)" if row["plan_cached"] else " (plan built)"
        lines.append(
            f"{name:<22}{row['median_ms']:>11.1f}{row['min_ms']:>9.1f}{row['max_ms']:>9.1f}{row['call_ms']:>9.1f}"
            f"{row.get('bytes', 0) / 2**20:>10.1f}{row.get('collectives', 0):>7}"
            f"{max(row['peak_host_mb'], row['peak_device_mb']):>9.1f}{row['page_faults']:>8.0f}  {plan}"
        )
    r = report.get("ratios", {})
    if r.get("floors"):
        result = report["result_mb"]
        lines.append(
            f"to the floor, paired (median of {cfg['pairs']} alternating pairs [min-max]; result {result:.1f} MB; "
            "memory goal: result + one bucket, streaming 2 buckets):"
        )
        for method, f in r["floors"].items():
            ok = "ok" if f["time_ratio"] <= f["goal"] else "over the goal"
            spread = f" [{f['spread'][0]:.2f}-{f['spread'][1]:.2f}]" if f.get("spread") else ""
            lines.append(
                f"  {method:<21} / {f['floor']:<15} time {f['time_ratio']:.2f}x{spread} (goal {f['goal']:.2f}x, {ok}); "
                f"peak {f['memory_mb']:.1f} MB = {f['memory_mb'] / max(result, 1e-9):.2f}x the result"
            )
    if "loop_over_collgrad" in r:
        lines.append(f"{r['loop']} / {r['collgrad_best']} = {r['loop_over_collgrad']:.1f}x")
    for loop, ours in _VERSUS:
        if f"{loop}_over_{ours}" in r:
            spread = r.get(f"{loop}_over_{ours}_spread")
            paired = f" [{spread[0]:.1f}-{spread[1]:.1f}], paired" if spread else ""
            lines.append(f"{loop} / {ours} = {r[f'{loop}_over_{ours}']:.1f}x{paired}")
    if "update_peak_buckets" in r:
        lines.append(
            f"update: peak extra {r['update_peak_buckets']:.2f} buckets "
            f"(bucket = 1/{cfg['stream_fraction']} of the model)"
        )
    s = report.get("stream_memory")
    if s:
        lines.append(
            f"streaming: bucket {s['bucket_mb']:.2f} MiB, peak extra {s['peak_extra_mb']:.2f} MiB "
            f"= {s['buckets']:.2f} buckets"
        )
    if "per_tensor_us" in report:
        lines.append(f"cost per parameter tensor at fixed bytes: {report['per_tensor_us']:.2f} us (slope of the sweep)")
    return "\n".join(lines)


SWEEP_METHODS = (
    "collgrad_all_gather",
    "collgrad_all_reduce",
    "collgrad_iter",
    "raw_all_reduce",
    "raw_all_gather",
    "deepspeed_loop",
    "full_tensor_loop",
)
#: The axes of the sweep and what each point varies.
SWEEP_AXES = ("tensors", "bytes", "world", "bucket")


def _bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any] | None:
    report = run_bench(cfg, progress=not cfg.methods)
    return report if rank == 0 else None


def sweep_configs(cfg: BenchConfig) -> list[tuple[str, BenchConfig]]:
    """Time against the number of tensors at fixed bytes, against bytes at fixed tensors, against the
    world size (local runs) and against the bucket size."""
    reps = max(3, cfg.reps // 2)
    base = {**asdict(cfg), "reps": reps, "pairs": max(5, cfg.pairs // 3), "methods": SWEEP_METHODS}
    fast = {**base, "methods": tuple(m for m in SWEEP_METHODS if not m.endswith("_loop"))}
    points = [("tensors", BenchConfig(**{**base, "tensors": n})) for n in (50, 100, 200, 400, 800, 1600)]
    points += [("bytes", BenchConfig(**{**base, "elements": int(cfg.elements * f)})) for f in (0.25, 0.5, 1, 2)]
    points += [("world", BenchConfig(**{**fast, "world": w})) for w in (2, 3, 4)]
    points += [("bucket", BenchConfig(**{**fast, "bucket_mb": mb})) for mb in (1.0, 4.0, 25.0, 100.0)]
    return points


def _x(axis: str, report: dict[str, Any]) -> float:
    if axis == "tensors":
        return report["params"]
    if axis == "bytes":
        return report["numel"] * 4
    if axis == "world":
        return report["world"]
    return report["config"]["bucket_mb"]


def summarize_sweep(results: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    points: dict[str, Any] = {axis: [] for axis in SWEEP_AXES}
    for axis, report in results:
        row = {axis: _x(axis, report), **{k: v["median_ms"] for k, v in report["methods"].items()}}
        row["ratios"] = {k: f["time_ratio"] for k, f in report["ratios"]["floors"].items()}
        points[axis].append(row)
    # Host-side cost per parameter tensor: slope of (collgrad - its floor) against tensors.
    xs = [p["tensors"] for p in points["tensors"]]
    ys = [
        min(p["collgrad_all_gather"] - p["raw_all_gather"], p["collgrad_all_reduce"] - p["raw_all_reduce"])
        for p in points["tensors"]
    ]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    points["per_tensor_us"] = 1e3 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return points


def plot_sweep(sweep: dict[str, Any], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4), sharey=True)
    labels = {
        "tensors": "parameter tensors (fixed bytes)",
        "bytes": "gradient bytes (fixed tensors)",
        "world": "ranks",
        "bucket": "bucket MiB",
    }
    for ax, axis in zip(axes, SWEEP_AXES):
        rows = sweep[axis]
        if not rows:
            continue
        xs = [r[axis] for r in rows]
        for method, floor in FLOORS.items():
            ax.plot(xs, [r["ratios"].get(method, float("nan")) for r in rows], marker="o", label=f"{method} / {floor}")
        ax.axhline(1.10, color="grey", linestyle="--", linewidth=1)
        ax.axhline(1.25, color="grey", linestyle=":", linewidth=1)
        if axis != "world":
            ax.set_xscale("log")
        ax.set_xlabel(labels[axis])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time / its floor (same collective, same bytes)")
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument(
        "--local",
        type=int,
        default=None,
        metavar="N",
        help="spawn N ranks over Gloo here (default 2 without a launcher)",
    )
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=d.stage)
    parser.add_argument(
        "--source",
        choices=("deepspeed", "fsdp2"),
        default=d.source,
        help="fsdp2: the model sharded with fully_shard, against per-parameter full_tensor()",
    )
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), default=d.dtype, help="bf16: with fp32 gradient accumulation"
    )
    parser.add_argument("--offload", action="store_true", help="CPU optimizer offload")
    parser.add_argument("--tensors", type=int, default=d.tensors)
    parser.add_argument("--elements", type=int, default=d.elements)
    parser.add_argument("--bucket-mb", type=float, default=d.bucket_mb)
    parser.add_argument("--reps", type=int, default=d.reps)
    parser.add_argument("--pairs", type=int, default=d.pairs, help="pairs timed against each plan's floor")
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--sweep", action="store_true", help="also sweep tensors and bytes (slow)")
    parser.add_argument("--png", metavar="PATH", help="with --sweep: write a chart (pip install 'collgrad[plot]')")


def main(args: argparse.Namespace) -> int:
    from collgrad.launch import init_from_environment, run_local

    cfg = BenchConfig(
        stage=args.stage,
        source=args.source,
        dtype=args.dtype,
        offload=args.offload,
        tensors=args.tensors,
        elements=args.elements,
        bucket_mb=args.bucket_mb,
        reps=args.reps,
        pairs=args.pairs,
    )
    launched = "RANK" in os.environ or mpi_launcher.rank_and_size(os.environ) is not None
    configs = [("main", cfg)] + (sweep_configs(cfg) if args.sweep else [])
    if launched and not args.local:  # the launcher fixed the world size
        configs = [(axis, c) for axis, c in configs if axis != "world"]
    results = []
    if args.local or not launched:
        for i, (axis, c) in enumerate(configs):  # fresh ranks per point: no engine left over from the last
            if i:
                print(f"[bench] sweep point {i}/{len(configs) - 1}: {axis}", file=sys.stderr, flush=True)
            results.append((axis, run_local(_bench_rank, c.world or args.local or 2, c, timeout=3600)[0]))
    else:
        created = init_from_environment()
        try:
            results = [(axis, _bench_rank(dist.get_rank(), dist.get_world_size(), c)) for axis, c in configs]
        finally:
            if created:
                dist.destroy_process_group()
        if results[0][1] is None:  # not rank 0
            return 0
    report = results[0][1]
    if args.sweep:
        report["sweep"] = summarize_sweep(results[1:])
        report["per_tensor_us"] = report["sweep"]["per_tensor_us"]
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png and "sweep" in report:
        cfg0 = report["config"]
        plot_sweep(
            report["sweep"],
            args.png,
            f"{_what(report)}, {report['optimizer']}, {report['backend']}, "
            f"torch {report['torch']}, deepspeed {report['deepspeed']}, {os.cpu_count()} CPUs, "
            f"medians of {max(3, cfg0['reps'] // 2)}",
        )
        print(f"chart written to {args.png}")
    return 0
