"""``python -m collgrad``: look at what the registry decides on a cluster.

    python -m collgrad bench                       # DeepSpeed ZeRO-2 on 2 local ranks: collgrad vs the rest
    python -m collgrad probe --local 2             # 2 ranks over Gloo on this host
    python -m collgrad convert CKPT_DIR OUT_DIR    # a DeepSpeed checkpoint into a training state, offline
    python -m collgrad verify DIR                  # a checkpoint's bytes against its save's hashes
    python -m collgrad simulate --world 4096       # one rank's plans in a simulated world, no ranks
    torchrun --nproc-per-node 8 -m collgrad probe  # under torchrun / the deepspeed launcher
    mpiexec -n 4 python -m collgrad probe          # under an MPI launcher (mpi4py optional)

Under a launcher every rank must run the same command; rank 0 prints.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from collgrad import _compat
from collgrad.backends.base import DTYPES, UNLIMITED
from collgrad.backends.decide import Capabilities
from collgrad.backends.ops import Op, Primitive
from collgrad.backends.registry import Registry, installed
from collgrad.launch import init_from_environment, run_local

_SHORT = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _limit(n: int) -> str:
    return "unlimited" if n >= UNLIMITED else f"{n:,}"


def render(caps: Capabilities, name: str) -> str:
    """The probe table of one group and device type."""
    lines = [f"  {caps.device_type} tensors -> backend {caps.backend}"]
    lines.append(f"    {'op':<11} {'primitive':<11} {'max elements':<14} dtypes")
    for op in Op:
        for prim in Primitive:
            statuses = [caps.status(op, prim, d) for d in DTYPES]
            ok = [_SHORT[s.dtype] for s in statuses if s.ok]
            limit = _limit(min(s.max_elements for s in statuses if s.ok)) if ok else "-"
            text = " ".join(ok) if ok else "none"
            lines.append(f"    {op.value:<11} {prim.value:<11} {limit:<14} {text}")
            reasons: dict[str, list[str]] = {}
            for s in statuses:
                if not s.ok:
                    reasons.setdefault(s.why_not(), []).append(_SHORT[s.dtype])
            for why, dts in reasons.items():
                lines.append(f"    {'':<11} {'':<11} {'':<14} not {' '.join(dts)}: {why}")
    for op in Op:
        picks = []
        for dtype in DTYPES:
            c = caps.choice(op, dtype)
            chosen = c.primitive.value if c.primitive else "NONE"
            wire = f" as {_SHORT[c.wire_dtype]}" if c.wire_dtype != dtype else ""
            picks.append(f"{_SHORT[dtype]}:{chosen}{wire}")
        lines.append(f"    choice {op.value:<10}: {' '.join(picks)}")
    return "\n".join(lines)


def _groups(extra: Sequence[Sequence[int]]) -> list[tuple[str, dist.ProcessGroup, list[int]]]:
    """WORLD, one group per host if there are several, and the groups asked for with --group.
    ``new_group`` is collective over WORLD, so every rank creates every group, in the same order."""
    world = dist.get_world_size()
    groups: list[tuple[str, dist.ProcessGroup, list[int]]] = [("world", _compat.default_group(), list(range(world)))]
    # Host identity as a number, so that no object collective (and no numpy) is needed.
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    hosts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(hosts, mine)
    by_host: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(int(host), []).append(rank)
    if len(by_host) > 1:
        for ranks in by_host.values():
            groups.append((f"host of rank {ranks[0]}", dist.new_group(ranks), ranks))
    for asked in extra:
        groups.append(("--group", dist.new_group(list(asked)), list(asked)))
    return groups


def probe_rank(rank: int, world: int, extra_groups: Sequence[Sequence[int]] = ()) -> str:
    """Probe every group on this rank; returns the report (meaningful on rank 0)."""
    registry = Registry()
    out = [
        f"collgrad probe: {world} rank(s), torch {torch.__version__}, "
        f"process group {dist.get_backend()!r}, this rank on {socket.gethostname()}",
        "installed on rank 0: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in installed().items()),
    ]
    for name, group, ranks in _groups(extra_groups):
        if dist.get_rank() not in ranks:
            continue
        out.append(f"\ngroup {name}: ranks {ranks}")
        for device_type in ("cpu", "cuda", "xpu"):
            if _compat.backend_name(group, device_type) is None:
                continue
            if device_type != "cpu" and not getattr(torch, device_type).is_available():
                continue
            out.append(render(registry.capabilities(device_type, group), name))
    return "\n".join(out)


def _parse_group(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r.strip()]


class _Bar:
    """A progress bar on the terminal (standard error), redrawn at most every tenth of a second."""

    def __init__(self, what: str) -> None:
        self.what, self.shown, self.start = what, -1.0, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.shown < 0.1:
            return
        self.shown = now
        share = done / total if total else 1.0
        filled = int(30 * share)
        rate = done / max(now - self.start, 1e-9) / 2**20
        sys.stderr.write(
            f"\r{self.what} [{'#' * filled}{'.' * (30 - filled)}] {share:6.1%} "
            f"{done / 2**20:,.1f}/{total / 2**20:,.1f} MiB {rate:,.0f} MiB/s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _convert(args: argparse.Namespace) -> int:
    from collgrad.checkpoint.convert import convert_deepspeed_checkpoint
    from collgrad.checkpoint.save import DEFAULT_MAX_SHARD_BYTES
    from collgrad.errors import CollgradError

    try:
        done = convert_deepspeed_checkpoint(
            args.checkpoint_dir,
            args.out_dir,
            tag=args.tag,
            max_shard_bytes=args.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
            progress=_Bar("convert") if sys.stderr.isatty() else None,
        )
    except CollgradError as error:
        print(f"collgrad convert: {error}", file=sys.stderr)
        return 2
    print(
        f"{done.directory}: {done.tensors} tensors, {done.bytes / 2**20:,.1f} MiB, from the {done.layout} checkpoint "
        f"{done.tag!r} of {done.world_size} ranks, in {done.seconds:.2f} s"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from collgrad.checkpoint.verify import verify_directory

    found = verify_directory(args.directory, threads=args.threads)
    for problem in found.problems:
        print(f"collgrad verify: {problem}", file=sys.stderr)
    if found.intact:
        print(f"{found.directory}: intact ({len(found.files)} files, {found.bytes / 2**20:,.1f} MiB hashed)")
    return 0 if found.intact else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collgrad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="print, per process group, what each backend can do and what is chosen")
    probe.add_argument("--local", type=int, metavar="N", help="spawn N ranks over Gloo on this host")
    probe.add_argument("--backend", help="process-group backend under a launcher (default: gloo, plus nccl/xccl)")
    probe.add_argument(
        "--group",
        type=_parse_group,
        action="append",
        default=[],
        metavar="R,R,...",
        help="also probe a sub-group of these global ranks (repeatable)",
    )
    bench = sub.add_parser(
        "bench", help="time full-model gradient access against DeepSpeed's accessor and the raw collective"
    )
    from collgrad import bench as bench_mod

    bench_mod.add_arguments(bench)
    convert = sub.add_parser(
        "convert",
        help="turn a DeepSpeed checkpoint (engine.save_checkpoint, ZeRO-1/2/3, any world size) into a training "
        "state that load_training_state resumes anywhere and from_pretrained loads the weights of; offline",
    )
    convert.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote into (holding 'latest')")
    convert.add_argument("out_dir", help="where the training state goes (made if missing)")
    convert.add_argument("--tag", help="the checkpoint's tag (default: the one 'latest' names)")
    convert.add_argument(
        "--max-shard-bytes", type=int, default=None, metavar="N", help="cut each kind's files at N bytes (default 5 GB)"
    )
    verify = sub.add_parser(
        "verify",
        help="check a checkpoint: every file there in full, every byte hashing to what its save recorded",
    )
    verify.add_argument(
        "directory", help="a directory save_training_state (async too), convert or save_full_model wrote"
    )
    verify.add_argument("--threads", type=int, default=4, metavar="N", help="files hashed at a time (default 4)")
    simulate = sub.add_parser(
        "simulate",
        help="every job's plan for one rank of a simulated world of a synthetic transformer: planning time, "
        "peak memory, I/O calls, bytes read, written and sent; no process group, no model",
    )
    from collgrad.bench import simulate as simulate_mod

    simulate_mod.add_arguments(simulate)
    args = parser.parse_args(argv)

    if args.command == "bench":
        return bench_mod.main(args)
    if args.command == "convert":
        return _convert(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "simulate":
        return simulate_mod.main(args)
    if args.local:
        report = run_local(probe_rank, args.local, args.group)[0]
        print(report)
        return 0
    created = init_from_environment(args.backend)
    try:
        report = probe_rank(dist.get_rank(), dist.get_world_size(), args.group)
        if dist.get_rank() == 0:
            print(report, flush=True)
    finally:
        if created:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
