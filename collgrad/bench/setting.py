"""The types the table of methods (``collgrad.bench.methods``) is built from: a method (``Method``), the
raw collective it is held against (``Floor``), what a rank's bound calls share (``Setting``, built by
``make_setting``) and what a call sent (``Reading``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import collgrad
from collgrad.bench.config import SOURCES, BenchConfig, deepspeed_config
from collgrad.bench.models import Subject

__all__ = [
    "Call",
    "DS",
    "FSDP2",
    "Floor",
    "Method",
    "Reading",
    "Setting",
    "make_setting",
    "loop_reading",
    "local_reading",
    "setter_loop",
    "of_result",
]

Call = Callable[[], Any]
DS, FSDP2 = ("deepspeed",), ("fsdp2",)  # a method run for one source only


@dataclass(frozen=True)
class Floor:
    """The raw collective a method is compared with (the same collective on the same bytes into a fresh
    output), and the goal for the ratio; ``goal_stage3`` where ZeRO-3 also reorders."""

    method: str
    goal: float
    goal_stage3: float | None = None

    def goal_at(self, stage: int) -> float:
        """The goal for a run of ZeRO ``stage`` (FSDP2 runs report the configured ``--stage``)."""
        return self.goal_stage3 if stage == 3 and self.goal_stage3 is not None else self.goal


@dataclass(frozen=True)
class Reading:
    """A method's collectives and bytes this rank sent, as its record tells them (collgrad's calls) or as
    counted from the framework's per-parameter calls and the raw buffers."""

    collectives: int | None  # None: not counted (a framework's own consolidation)
    bytes: int | None
    plans: tuple[str, ...] | None = None
    plan_cached: bool | None = None
    #: the loads: checkpoint bytes each rank read, by rank, and the checkpoint's data bytes
    read_bytes: tuple[int, ...] | None = None
    checkpoint_bytes: int | None = None

    def row(self) -> dict[str, Any]:
        """The report row's fields: ``plans`` only where a record told them, ``plan_cached`` likewise,
        collectives and bytes only where counted."""
        out: dict[str, Any] = {}
        if self.collectives is not None:
            out.update(collectives=self.collectives, bytes=self.bytes)
        if self.plans is not None:
            out["plans"] = list(self.plans)
        if self.plan_cached is not None:
            out["plan_cached"] = self.plan_cached
        if self.read_bytes is not None:
            out["read_mb"] = [b / 2**20 for b in self.read_bytes]
        if self.checkpoint_bytes is not None:
            out["checkpoint_mb"] = self.checkpoint_bytes / 2**20
        return out


@dataclass
class Setting:
    """What a rank's bound calls share. Build with ``make_setting`` on every rank."""

    subject: Subject
    bucket: int  # bytes per bucket of collgrad's calls (--bucket-mb)
    small_bucket: int  # 1/stream_fraction of the gradient bytes: update and the streaming check
    full: Mapping[str, torch.Tensor]  # the gradients, written back by the set methods
    element_size: int  # of the gradients collgrad returns: the bytes of a floor's element
    share: torch.Tensor  # this rank's share of a raw all-gather of the gradient bytes
    fp32: Mapping[str, torch.Tensor]  # the fp32 master weights, written back by the fp32 set methods
    exp_avg: Mapping[str, torch.Tensor]  # Adam's first moment, written back by the state set methods
    save_dir: str  # where the save methods write (rank 0), removed by ``close``
    shard: int  # save_full_model's max_shard_bytes
    #: the DeepSpeed config the engine was built with (None for FSDP2): Transformers' loader reads it
    ds_config: Mapping[str, Any] | None = None
    #: the checkpoint the load methods read, once written (``checkpoint()``)
    written: str | None = None

    #: the resumable checkpoints the training-state load methods read, by writer, once written
    resumables: dict[str, str] = field(default_factory=dict)
    #: what to undo when the run ends (the drop-in installed by its row)
    cleanups: list[Callable[[], Any]] = field(default_factory=list)

    def resumable(self, writer: str, save: Callable[[str], Any]) -> str:
        """The resumable checkpoint ``writer`` ("collgrad", "deepspeed", "dcp") wrote of the model as it is,
        next to the save methods' directory: ``save(path)`` the first time (a collective: the methods
        are bound on every rank in the same order)."""
        if writer not in self.resumables:
            self.resumables[writer] = f"{self.save_dir}-resume-{writer}"
            save(self.resumables[writer])
        return self.resumables[writer]

    def checkpoint(self) -> str:
        """The checkpoint the load methods read: the model as ``save_full_model`` writes it (its dtype,
        shards of ``shard`` bytes), next to the save methods' directory; written the first time (a
        collective: the methods are bound on every rank in the same order)."""
        if self.written is None:
            self.written = f"{self.save_dir}-load"
            collgrad.save_full_model(self.subject.engine, self.written, max_shard_bytes=self.shard)
        return self.written

    def close(self) -> None:
        """Remove what the save and load methods wrote, undo what they left installed. Local."""
        shutil.rmtree(self.save_dir, ignore_errors=True)
        if self.written is not None:
            shutil.rmtree(self.written, ignore_errors=True)
        for path in self.resumables.values():
            shutil.rmtree(path, ignore_errors=True)
        for undo in self.cleanups:
            undo()
        self.cleanups.clear()

    @property
    def grad_bytes(self) -> int:
        return self.subject.numel * self.element_size


def make_setting(subject: Subject, cfg: BenchConfig) -> Setting:
    """The shared state of the calls. Collective (one full-gradient call): every rank, same order."""
    full = collgrad.safe_get_full_model_grads(subject.engine)
    first = next(iter(full.values()))
    size = first.element_size()
    share = torch.ones(-(-subject.numel // subject.world), dtype=first.dtype, device=subject.device)
    small = max(1, size * subject.numel // cfg.stream_fraction)
    fp32 = collgrad.safe_get_full_model_fp32_params(subject.engine, bucket_bytes=cfg.bucket_bytes)
    exp_avg = collgrad.safe_get_full_model_optimizer_states(
        subject.engine, "exp_avg", optimizer=subject.optimizer_obj, bucket_bytes=cfg.bucket_bytes
    )
    where = [os.path.join(tempfile.gettempdir(), f"collgrad-bench-save-{os.getpid()}")]
    dist.broadcast_object_list(where, src=0)  # rank 0's: the save methods write where it says
    ds_config = deepspeed_config(cfg) if cfg.source == "deepspeed" else None
    return Setting(
        subject, cfg.bucket_bytes, small, full, size, share, fp32, exp_avg, where[0], cfg.shard_bytes, ds_config
    )


def loop_reading(s: Setting, element_size: int) -> Reading:
    """A framework's per-parameter loop: one collective per parameter, of ``element_size``-byte elements.
    An all-reduce (ZeRO-1/2) sends the whole tensor; an all-gather (ZeRO-3, FSDP2) this rank's share of
    each parameter (every rank's share padded to the largest, ``ceil(elements / world)``)."""
    sub = s.subject
    elements = sum(-(-n // sub.world) for n in sub.sizes) if sub.loop_gathers else sub.numel
    return Reading(len(sub.params), elements * element_size)


def of_result(s: Setting, call: Call) -> Reading:
    """One more call; its result's record (set and update return their record itself)."""
    result: Any = call()
    rec: Any = getattr(result, "record", result)
    return Reading(rec.collectives, rec.bytes, tuple(str(g.plan) for g in rec.groups), rec.plan_cached)


def setter_loop(s: Setting, values: Mapping[str, torch.Tensor], put: Callable[..., Any] | None) -> Call:
    """``put(p, values[name])`` per parameter, in ``named_parameters()`` order: a setter loop as users
    write it (``put`` is None where the framework has no such setter: the table runs it only where it has)."""
    assert put is not None
    by_param = [(p, values[n]) for n, p in s.subject.engine.module.named_parameters() if n in values]
    return lambda: [put(p, v) for p, v in by_param]


def local_reading(s: Setting, call: Call) -> Reading:
    """Local writes: nothing sent."""
    return Reading(0, 0)


@dataclass(frozen=True)
class Method:
    """One method of the table. ``make(setting)`` builds the call on a rank; ``read(setting, call)`` says
    what it sent (it may call once more); ``floor``: the raw collective it is paired with;
    ``versus``: for a per-parameter loop, the collgrad method (or methods) it is paired with (ratio loop /
    that)."""

    name: str
    make: Callable[[Setting], Call]
    read: Callable[[Setting, Call], Reading]
    floor: Floor | None = None
    versus: str | tuple[str, ...] | None = None
    sources: tuple[str, ...] = SOURCES
    #: the ZeRO stages a DeepSpeed run has it for (FSDP2 runs: every method of their source)
    stages: tuple[int, ...] = (0, 1, 2, 3)
    #: the modules the method needs (the row is left out where one is not installed)
    needs: tuple[str, ...] = ()

    def bind(self, setting: Setting) -> Call:
        """The call on this rank's engine."""
        return self.make(setting)
