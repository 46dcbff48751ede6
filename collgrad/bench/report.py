"""The report: ratios to each method's floor and to the per-parameter loops, and the printed table.

Pure functions of the report (a JSON-able dict built by ``collgrad.bench.run``) and the method table:
call anywhere, also on a report read back from ``--json``.
"""

from __future__ import annotations

from typing import Any

from collgrad.bench.config import BenchConfig
from collgrad.bench.methods import floors, versus

__all__ = [
    "ratios",
    "format_report",
    "describe",
    "GET_LOOPS",
    "PLANS",
    "SAVE_ANCHORS",
    "LOAD_ANCHORS",
    "RESUME_ANCHORS",
    "NOT_COUNTED",
]

#: The frameworks' consolidations a save is compared with (rank 0 holds the whole model).
SAVE_ANCHORS = ("deepspeed_consolidated_save", "fsdp2_state_dict_save")
#: The frameworks' loads a load is compared with (rank 0 reads the whole checkpoint).
LOAD_ANCHORS = ("transformers_zero3_load", "deepspeed_gathered_load", "fsdp2_broadcast_load")
#: The frameworks' own resumable checkpoints a training state is compared with (per-rank files).
RESUME_ANCHORS = (
    "deepspeed_checkpoint_save",
    "deepspeed_synced_save",
    "dcp_save",
    "deepspeed_checkpoint_load",
    "dcp_load",
    "deepspeed_zero_to_fp32",
)
#: Rows of the frameworks' own whose collectives and bytes are not counted ("-" in the table)
NOT_COUNTED = (*SAVE_ANCHORS, *LOAD_ANCHORS, *RESUME_ANCHORS, "deepspeed_fp32_weights_set_loop")
#: The frameworks' per-parameter getters, and collgrad's plans the best of which they are compared with.
GET_LOOPS = ("deepspeed_loop", "full_tensor_loop")
PLANS = ("collgrad_all_gather", "collgrad_all_reduce")


def _to_floors(report: dict[str, Any], stage: int) -> dict[str, Any]:
    m = report["methods"]
    out: dict[str, Any] = {}
    for method, floor in floors().items():
        if method in m and floor.method in m:
            paired = report.get("paired", {}).get(method)
            out[method] = {
                "floor": floor.method,
                # paired (alternating) where measured; else the ratio of the two medians
                "time_ratio": paired["ratio"] if paired else m[method]["median_ms"] / m[floor.method]["median_ms"],
                "spread": (paired["min"], paired["max"]) if paired else None,
                "goal": floor.goal_at(stage),
                "memory_mb": max(m[method]["peak_host_mb"], m[method]["peak_device_mb"]),
            }
    return out


def ratios(report: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    """Each method with a floor against it (and its goal); the per-parameter getter against collgrad's
    best plan; each loop against its collgrad method (paired where measured); ``update``'s peak in
    buckets of 1/``cfg.stream_fraction`` of the gradient bytes."""
    m = report["methods"]
    out: dict[str, Any] = {"floors": _to_floors(report, cfg.stage)}
    timed = [(m[k]["median_ms"], k) for k in PLANS if k in m]
    loop = next((k for k in GET_LOOPS if k in m), None)
    if timed and loop:
        best = min(timed)
        out["collgrad_best"] = best[1]
        out["loop"] = loop
        out["loop_over_collgrad"] = m[loop]["median_ms"] / best[0]
    for slow, ours in versus():
        key = f"{slow}_over_{ours}"
        paired = report.get("paired_versus", {}).get(key)
        if paired:
            out[key] = paired["ratio"]
            out[f"{key}_spread"] = (paired["min"], paired["max"])
        elif slow in m and ours in m:
            out[key] = m[slow]["median_ms"] / m[ours]["median_ms"]
    if "collgrad_update" in m:
        bucket = report["element_size"] * report["numel"] // cfg.stream_fraction
        out["update_peak_buckets"] = m["collgrad_update"]["peak_host_mb"] * 2**20 / max(1, bucket)
    if "collgrad_save" in m:
        anchor = next((k for k in SAVE_ANCHORS if k in m), None)
        out["save"] = {
            "peak_mb": m["collgrad_save"]["peak_host_mb"],
            "goal_mb": cfg.shard_mb + cfg.bucket_mb,
            "anchor": anchor,
            "anchor_peak_mb": m[anchor]["peak_host_mb"] if anchor else None,
        }
    if "collgrad_load" in m and "read_mb" in m["collgrad_load"]:
        out["load"] = {
            "read_mb": m["collgrad_load"]["read_mb"],
            "checkpoint_mb": m["collgrad_load"]["checkpoint_mb"],
            "peak_mb": m["collgrad_load"]["peak_host_mb"],
            "anchors": {k: m[k]["peak_host_mb"] for k in LOAD_ANCHORS if k in m},
        }
    return out


def describe(report: dict[str, Any]) -> str:
    """What ran, in a few words: ``ZeRO-2 fp32``, ``FSDP2 fully_shard fp32``."""
    cfg = report["config"]
    if cfg.get("source") == "fsdp2":
        return "FSDP2 fully_shard fp32"
    return f"ZeRO-{cfg['stage']} {cfg['dtype']}{' offload' if cfg['offload'] else ''}"


_HEADER = (
    f"{'method':<22}{'median ms':>11}{'min':>9}{'max':>9}{'in call':>9}{'MB sent':>10}{'colls':>7}"
    f"{'peak MB':>9}{'faults':>8}  plan"
)


def _row(name: str, row: dict[str, Any]) -> str:
    plan = ",".join(row.get("plans", []) or [])
    if row.get("plan_cached") is not None:
        plan += " (plan from cache)" if row["plan_cached"] else " (plan built)"
    counted = f"{row['bytes'] / 2**20:>10.1f}{row['collectives']:>7}" if "collectives" in row else f"{'-':>10}{'-':>7}"
    return (
        f"{name:<22}{row['median_ms']:>11.1f}{row['min_ms']:>9.1f}{row['max_ms']:>9.1f}{row['call_ms']:>9.1f}"
        f"{counted}{max(row['peak_host_mb'], row['peak_device_mb']):>9.1f}{row['page_faults']:>8.0f}  {plan}"
    )


def _floor_lines(report: dict[str, Any]) -> list[str]:
    cfg, r = report["config"], report.get("ratios", {})
    if not r.get("floors"):
        return []
    result = report["result_mb"]
    lines = [
        f"to the floor, paired (median of {cfg['pairs']} alternating pairs [min-max]; result {result:.1f} MB; "
        "memory goal: result + one bucket, streaming 2 buckets):"
    ]
    for method, f in r["floors"].items():
        ok = "ok" if f["time_ratio"] <= f["goal"] else "over the goal"
        spread = f" [{f['spread'][0]:.2f}-{f['spread'][1]:.2f}]" if f.get("spread") else ""
        lines.append(
            f"  {method:<21} / {f['floor']:<15} time {f['time_ratio']:.2f}x{spread} (goal {f['goal']:.2f}x, {ok}); "
            f"peak {f['memory_mb']:.1f} MB = {f['memory_mb'] / max(result, 1e-9):.2f}x the result"
        )
    return lines


def _ratio_lines(report: dict[str, Any]) -> list[str]:
    cfg, r = report["config"], report.get("ratios", {})
    lines = []
    if "loop_over_collgrad" in r:
        lines.append(f"{r['loop']} / {r['collgrad_best']} = {r['loop_over_collgrad']:.1f}x")
    for slow, ours in versus():
        if f"{slow}_over_{ours}" in r:
            spread = r.get(f"{slow}_over_{ours}_spread")
            paired = f" [{spread[0]:.1f}-{spread[1]:.1f}], paired" if spread else ""
            lines.append(f"{slow} / {ours} = {r[f'{slow}_over_{ours}']:.1f}x{paired}")
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
    save = r.get("save")
    if save:
        ok = "ok" if save["peak_mb"] <= save["goal_mb"] else "over the goal"
        anchor = f"; {save['anchor']}: {save['anchor_peak_mb']:.1f} MB" if save["anchor"] else ""
        lines.append(
            f"save: rank 0's peak {save['peak_mb']:.1f} MB (goal: a shard + a bucket = {save['goal_mb']:.1f} MB, "
            f"{ok}){anchor}"
        )
    load = r.get("load")
    if load:
        read = ", ".join(f"{mb:.1f}" for mb in load["read_mb"])
        anchors = "".join(f"; {k}: {mb:.1f} MB" for k, mb in load["anchors"].items())
        lines.append(
            f"load: MB read per rank [{read}] of the checkpoint's {load['checkpoint_mb']:.1f} MB; rank 0's peak: "
            f"collgrad {load['peak_mb']:.1f} MB{anchors}"
        )
    if "per_tensor_us" in report:
        lines.append(f"cost per parameter tensor at fixed bytes: {report['per_tensor_us']:.2f} us (slope of the sweep)")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The printed report: a header line, one row per method, the ratios."""
    cfg = report["config"]
    lines = [
        f"collgrad bench: {describe(report)}, "
        f"{report['params']} tensors / {report['numel']:,} elements, {report['world']} ranks over "
        f"{report['backend']}, {report['optimizer']}, torch {report['torch']}, deepspeed {report['deepspeed']}, "
        f"bucket {cfg['bucket_mb']} MiB, median of {cfg['reps']}",
        _HEADER,
    ]
    lines += [_row(name, row) for name, row in report["methods"].items()]
    return "\n".join(lines + _floor_lines(report) + _ratio_lines(report))
