"""``--sweep``: the run repeated at points along four axes (tensors at fixed bytes, bytes at fixed tensors,
ranks, bucket size), the per-tensor cost fitted from the first, and a chart of each plan's ratio to its
floor. Pure except ``plot_sweep`` (writes a file; needs matplotlib, ``pip install 'collgrad[plot]'``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from collgrad.bench.config import BenchConfig
from collgrad.bench.methods import floors

__all__ = ["SWEEP_METHODS", "SWEEP_AXES", "sweep_configs", "summarize_sweep", "plot_sweep"]

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
_LOOPS = ("deepspeed_loop", "full_tensor_loop")  # slow: left out of the world and bucket axes


def sweep_configs(cfg: BenchConfig) -> list[tuple[str, BenchConfig]]:
    """Time against the number of tensors at fixed bytes, against bytes at fixed tensors, against the
    world size (local runs) and against the bucket size: (axis, configuration) per point."""
    reps = max(3, cfg.reps // 2)
    base = {**asdict(cfg), "reps": reps, "pairs": max(5, cfg.pairs // 3), "methods": SWEEP_METHODS}
    fast = {**base, "methods": tuple(m for m in SWEEP_METHODS if m not in _LOOPS)}
    points = [("tensors", BenchConfig(**{**base, "tensors": n})) for n in (50, 100, 200, 400, 800, 1600)]
    points += [("bytes", BenchConfig(**{**base, "elements": int(cfg.elements * f)})) for f in (0.25, 0.5, 1, 2)]
    points += [("world", BenchConfig(**{**fast, "world": w})) for w in (2, 3, 4)]
    points += [("bucket", BenchConfig(**{**fast, "bucket_mb": mb})) for mb in (1.0, 4.0, 25.0, 100.0)]
    return points


def _x(axis: str, report: dict[str, Any]) -> float:
    """Where a point lies on its axis."""
    x: float
    if axis == "tensors":
        x = report["params"]
    elif axis == "bytes":
        x = report["numel"] * report["element_size"]
    elif axis == "world":
        x = report["world"]
    else:
        x = report["config"]["bucket_mb"]
    return x


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def summarize_sweep(results: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per axis, a row per point (its x, each method's median, each plan's ratio to its floor), and
    ``per_tensor_us``: the slope of (collgrad - its floor) against tensors at fixed bytes."""
    points: dict[str, Any] = {axis: [] for axis in SWEEP_AXES}
    for axis, report in results:
        row = {axis: _x(axis, report), **{k: v["median_ms"] for k, v in report["methods"].items()}}
        row["ratios"] = {k: f["time_ratio"] for k, f in report["ratios"]["floors"].items()}
        points[axis].append(row)
    xs = [p["tensors"] for p in points["tensors"]]
    ys = [
        min(p["collgrad_all_gather"] - p["raw_all_gather"], p["collgrad_all_reduce"] - p["raw_all_reduce"])
        for p in points["tensors"]
    ]
    points["per_tensor_us"] = 1e3 * _slope(xs, ys)
    return points


_LABELS = {
    "tensors": "parameter tensors (fixed bytes)",
    "bytes": "gradient bytes (fixed tensors)",
    "world": "ranks",
    "bucket": "bucket MiB",
}


def plot_sweep(sweep: dict[str, Any], path: str, title: str = "") -> None:
    """Each plan's time over its floor against each axis, with the goals as lines; a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4), sharey=True)
    for ax, axis in zip(axes, SWEEP_AXES):
        rows = sweep[axis]
        if not rows:
            continue
        xs = [r[axis] for r in rows]
        for method, floor in floors().items():
            ys = [r["ratios"].get(method, float("nan")) for r in rows]
            ax.plot(xs, ys, marker="o", label=f"{method} / {floor.method}")
        ax.axhline(1.10, color="grey", linestyle="--", linewidth=1)
        ax.axhline(1.25, color="grey", linestyle=":", linewidth=1)
        if axis != "world":
            ax.set_xscale("log")
        ax.set_xlabel(_LABELS[axis])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time / its floor (same collective, same bytes)")
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
