"""The methods measured, one typed object each: its name, how its call is built on a rank, the raw
collective it is held against (its floor, with the goal for the ratio), and how its record is read.

``METHODS`` is the whole table, in report order; ``methods_for(source)`` the ones a source runs. A
method is bound to an engine on a rank (``Method.bind(setting)``), where ``Setting`` holds what the
calls share: the engine, the bucket sizes, the gradients written back, the raw all-gather's share.
Bytes are counted from the dtype of what is moved (``element_size()``), never as 4 per element.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import collgrad
from collgrad import _compat
from collgrad.bench.config import SOURCES, BenchConfig
from collgrad.bench.models import Subject
from collgrad.grads.shards import write_safetensors

__all__ = ["Floor", "Reading", "Setting", "Method", "METHODS", "methods_for", "floors", "versus", "make_setting"]

Call = Callable[[], Any]


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
    save_dir: str  # where the save methods write (rank 0), removed by ``close``
    shard: int  # save_full_model's max_shard_bytes

    #: what to undo when the run ends (the drop-in installed by its row)
    cleanups: list[Callable[[], Any]] = field(default_factory=list)

    def close(self) -> None:
        """Remove what the save methods wrote, undo what they left installed. Local."""
        shutil.rmtree(self.save_dir, ignore_errors=True)
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
    where = [os.path.join(tempfile.gettempdir(), f"collgrad-bench-save-{os.getpid()}")]
    dist.broadcast_object_list(where, src=0)  # rank 0's: the save methods write where it says
    return Setting(subject, cfg.bucket_bytes, small, full, size, share, fp32, where[0], cfg.shard_bytes)


@dataclass(frozen=True)
class Method:
    """One method of the table. ``make(setting)`` builds the call on a rank; ``read(setting, call)`` says
    what it sent (it may call once more); ``floor``: the raw collective it is paired with;
    ``versus``: for a per-parameter loop, the collgrad method it is paired with (ratio loop / that)."""

    name: str
    make: Callable[[Setting], Call]
    read: Callable[[Setting, Call], Reading]
    floor: Floor | None = None
    versus: str | None = None
    sources: tuple[str, ...] = SOURCES

    def bind(self, setting: Setting) -> Call:
        """The call on this rank's engine."""
        return self.make(setting)


# How records are read.


def _of_result(s: Setting, call: Call) -> Reading:
    """One more call; its result's record (set and update return their record itself)."""
    result: Any = call()
    rec: Any = getattr(result, "record", result)
    return Reading(rec.collectives, rec.bytes, tuple(str(g.plan) for g in rec.groups), rec.plan_cached)


def _of_stream(s: Setting, call: Call) -> Reading:
    """A stream of the same bucket consumed to the end; the stream's record."""
    stream = collgrad.iter_full_model_grads(s.subject.engine, bucket_bytes=s.bucket)
    deque(stream, maxlen=0)
    rec = stream.record()
    return Reading(rec.collectives, rec.bytes, tuple(str(g.plan) for g in rec.groups))


def _loop_reading(s: Setting, call: Call) -> Reading:
    """The framework's per-parameter full gradients: one collective per parameter. An all-reduce
    (ZeRO-1/2) sends the whole gradient; an all-gather (ZeRO-3, FSDP2) this rank's share of each
    parameter (every rank's share padded to the largest, ``ceil(elements / world)``)."""
    sub = s.subject
    if sub.loop_gathers:
        elements = sum(-(-n // sub.world) for n in sub.sizes)
    else:
        elements = sub.numel
    return Reading(len(sub.params), elements * sub.loop_element_size)


def _state_loop_reading(s: Setting, call: Call) -> Reading:
    """The framework's per-parameter fp32 weights or states: one collective per parameter, fp32, as
    ``_loop_reading`` counts them."""
    sub = s.subject
    elements = sum(-(-n // sub.world) for n in sub.sizes) if sub.loop_gathers else sub.numel
    return Reading(len(sub.params), elements * 4)


def _of_saved(s: Setting, call: Call) -> Reading:
    """One more save; its streams' records."""
    saved: Any = call()
    records = saved.records
    return Reading(sum(r.collectives for r in records), sum(r.bytes for r in records))


def _consolidated_reading(s: Setting, call: Call) -> Reading:
    """The frameworks' consolidation: not counted. What it sends depends on their internals (ZeRO-3
    gathers a module's parameters at a time, but not those it keeps whole, below its persistence
    threshold; FSDP2 each parameter); its time and memory are what the row is for."""
    return Reading(None, None)


def _local(s: Setting, call: Call) -> Reading:
    """Local writes: nothing sent."""
    return Reading(0, 0)


def _raw_all_reduce_reading(s: Setting, call: Call) -> Reading:
    return Reading(1, s.grad_bytes)


def _raw_all_gather_reading(s: Setting, call: Call) -> Reading:
    return Reading(1, s.share.numel() * s.share.element_size())


# How calls are built.


def _grads(plan: str) -> Callable[[Setting], Call]:
    def make(s: Setting) -> Call:
        return lambda: collgrad.safe_get_full_model_grads(s.subject.engine, plan=plan, bucket_bytes=s.bucket)

    return make


def _loop(norm: bool) -> Callable[[Setting], Call]:
    def make(s: Setting) -> Call:
        get, params = s.subject.full_grad, s.subject.params
        if norm:
            return lambda: [float(get(p).norm()) for p in params]
        return lambda: [get(p) for p in params]

    return make


def _set_loop(s: Setting) -> Call:
    put = s.subject.set_grad
    assert put is not None  # the table runs this method for DeepSpeed only
    by_param = [(p, s.full[n]) for n, p in s.subject.engine.module.named_parameters() if n in s.full]
    return lambda: [put(p, g) for p, g in by_param]


def _per_tensor(s: Setting) -> Call:
    policy = collgrad.Policy(force="per_tensor")
    return lambda: collgrad.safe_get_full_model_grads(s.subject.engine, policy=policy, bucket_bytes=s.bucket)


def _no_copy(s: Setting) -> Call:
    return lambda: collgrad.safe_get_full_model_grads(s.subject.engine, bucket_bytes=s.bucket, copy=False)


def _iter(s: Setting) -> Call:
    # deque(maxlen=0) consumes without keeping a reference: what is measured is what collgrad holds.
    return lambda: deque(collgrad.iter_full_model_grads(s.subject.engine, bucket_bytes=s.bucket), maxlen=0)


def _set(check: bool) -> Callable[[Setting], Call]:
    def make(s: Setting) -> Call:
        return lambda: collgrad.safe_set_full_model_grads(s.subject.engine, s.full, check=check)

    return make


def _update(s: Setting) -> Call:
    return lambda: collgrad.update_full_model_grads(s.subject.engine, lambda n, g: None, bucket_bytes=s.small_bucket)


def _stats(s: Setting) -> Call:
    return lambda: collgrad.model_grad_stats(s.subject.engine)


def _state(key: str | None) -> Callable[[Setting], Call]:
    """collgrad's read of the fp32 weights (``key`` None) or of the optimizer state ``key``."""

    def make(s: Setting) -> Call:
        engine, bucket, opt = s.subject.engine, s.bucket, s.subject.optimizer_obj
        if key is None:
            return lambda: collgrad.safe_get_full_model_fp32_params(engine, bucket_bytes=bucket)
        return lambda: collgrad.safe_get_full_model_optimizer_states(engine, key, optimizer=opt, bucket_bytes=bucket)

    return make


def _state_loop(key: str | None) -> Callable[[Setting], Call]:
    """The framework's per-parameter loop over the fp32 weights or the optimizer state ``key``."""

    def make(s: Setting) -> Call:
        params, weight, state = s.subject.params, s.subject.full_fp32, s.subject.full_state
        if key is None:
            return lambda: [weight(p) for p in params]
        return lambda: [state(p, key) for p in params]

    return make


def _fp32_set(s: Setting) -> Call:
    return lambda: collgrad.safe_set_full_model_fp32_params(s.subject.engine, s.fp32)


def _fp32_set_loop(s: Setting) -> Call:
    put = s.subject.set_fp32
    assert put is not None  # the table runs this method for DeepSpeed only
    by_param = [(p, s.fp32[n]) for n, p in s.subject.engine.module.named_parameters() if n in s.fp32]
    return lambda: [put(p, v) for p, v in by_param]


def _save(s: Setting) -> Call:
    return lambda: collgrad.save_full_model(
        s.subject.engine, s.save_dir, max_shard_bytes=s.shard, bucket_bytes=s.bucket
    )


def _consolidated_save(s: Setting) -> Call:
    """The framework's consolidated state dict (the whole model on rank 0), written by rank 0 as one
    safetensors file with the same writer."""
    consolidate, path = s.subject.consolidate, os.path.join(s.save_dir, "consolidated.safetensors")

    def call() -> Any:
        state = consolidate()
        if state:
            os.makedirs(s.save_dir, exist_ok=True)
            write_safetensors(path, [(n, t.detach().cpu()) for n, t in state.items()], {"format": "pt"})
        return state

    return call


def _getters(s: Setting, functions: Mapping[str, Callable[..., Any]] | None) -> list[Any]:
    """The documented loop: DeepSpeed's three full getters over every parameter (``functions``: the
    ones installed in their place)."""
    sub = s.subject
    grad, fp32, state = (
        (sub.full_grad, sub.full_fp32, sub.full_state)
        if functions is None
        else (
            functions["safe_get_full_grad"],
            functions["safe_get_full_fp32_param"],
            functions["safe_get_full_optimizer_state"],
        )
    )
    return [(grad(p), fp32(p), state(p, "exp_avg")) for p in sub.params]


def _getters_loop(s: Setting) -> Call:
    return lambda: _getters(s, None)


def _dropin_loop(s: Setting) -> Call:
    """The same loop with ``collgrad.integrations.deepspeed`` installed (once, at the first call, as a
    user installs it; ``Setting.close`` uninstalls it); returns the collectives and bytes it sent."""
    from collgrad.integrations import deepspeed as dropin

    def call() -> Any:
        served = dropin.install(window_bytes=s.bucket)
        s.cleanups.append(dropin.uninstall)
        before = list(served.sent)
        _getters(s, served.functions)
        return served.sent[0] - before[0], served.sent[1] - before[1]

    return call


def _getters_reading(s: Setting, call: Call) -> Reading:
    """DeepSpeed's three getters per parameter: its gradient loop and two fp32 loops."""
    grads, states = _loop_reading(s, call), _state_loop_reading(s, call)
    collectives = (grads.collectives or 0) + 2 * (states.collectives or 0)
    return Reading(collectives, (grads.bytes or 0) + 2 * (states.bytes or 0))


def _of_dropin(s: Setting, call: Call) -> Reading:
    """One more loop; what the drop-in sent (its windows, DeepSpeed's originals where it fell back)."""
    collectives, sent = call()
    return Reading(collectives, sent)


def _raw_all_reduce(s: Setting) -> Call:
    """The all-reduce floor: a zero-filled flat buffer of the gradient bytes (collgrad's all-reduce plan
    zero-fills its bucket too), reduced in one call."""
    numel, dtype, device = s.subject.numel, s.share.dtype, s.subject.device

    def call() -> torch.Tensor:
        out = torch.zeros(numel, dtype=dtype, device=device)
        dist.all_reduce(out)
        return out

    return call


def _raw_all_gather(s: Setting) -> Call:
    """The all-gather floor: every rank's share gathered into a fresh flat buffer, in one call."""
    share, world = s.share, s.subject.world

    def call() -> torch.Tensor:
        out = torch.empty(share.numel() * world, dtype=share.dtype, device=share.device)
        _compat.all_gather_flat(out, share, _compat.default_group()).wait()
        return out

    return call


_GATHER = Floor("raw_all_gather", 1.10, goal_stage3=1.20)  # ZeRO-3's all-gather plan also reorders
_REDUCE = Floor("raw_all_reduce", 1.10)
_STREAM = Floor("raw_all_reduce", 1.25)
DS, FSDP2 = ("deepspeed",), ("fsdp2",)

#: Every method, in report order. Writing and statistics run against the frameworks' own loops; the values
#: written are the gradients themselves, so every repetition sees the same gradients.
METHODS: tuple[Method, ...] = (
    Method("deepspeed_loop", _loop(norm=False), _loop_reading, sources=DS),
    Method("full_tensor_loop", _loop(norm=False), _loop_reading, sources=FSDP2),
    Method("collgrad_all_gather", _grads("all_gather"), _of_result, floor=_GATHER),
    Method("collgrad_all_reduce", _grads("all_reduce"), _of_result, floor=_REDUCE),
    Method("collgrad_per_tensor", _per_tensor, _of_result),  # the fallback, forced through the registry
    # Where ranks hold gradients whole (BF16_Optimizer, stage 0): the optimizer's tensors, no copy.
    Method("collgrad_no_copy", _no_copy, _of_result),
    Method("collgrad_iter", _iter, _of_stream, floor=_STREAM),
    # DeepSpeed's setter writes this rank's fragment (ZeRO-1/2) or partition (ZeRO-3) locally.
    Method("deepspeed_set_loop", _set_loop, _local, versus="collgrad_set", sources=DS),
    Method("collgrad_set", _set(check=True), _of_result),
    Method("collgrad_set_unchecked", _set(check=False), _of_result),
    Method("collgrad_update", _update, _of_result),
    Method("deepspeed_norm_loop", _loop(norm=True), _loop_reading, versus="collgrad_stats", sources=DS),
    Method("full_tensor_norm_loop", _loop(norm=True), _loop_reading, versus="collgrad_stats", sources=FSDP2),
    Method("collgrad_stats", _stats, _of_result),
    # The rest of the training state: fp32 master weights and Adam's moments, read and written, against
    # the per-parameter loops; a consolidated checkpoint, against the frameworks' consolidation.
    Method("deepspeed_fp32_loop", _state_loop(None), _state_loop_reading, versus="collgrad_fp32", sources=DS),
    Method("full_tensor_fp32_loop", _state_loop(None), _state_loop_reading, versus="collgrad_fp32", sources=FSDP2),
    Method("collgrad_fp32", _state(None), _of_result),
    *(
        Method(f"{loop}_{key}_loop", _state_loop(key), _state_loop_reading, versus=f"collgrad_{key}", sources=where)
        for key in ("exp_avg", "exp_avg_sq")
        for loop, where in (("deepspeed", DS), ("full_tensor", FSDP2))
    ),
    Method("collgrad_exp_avg", _state("exp_avg"), _of_result),
    Method("collgrad_exp_avg_sq", _state("exp_avg_sq"), _of_result),
    Method("deepspeed_fp32_set_loop", _fp32_set_loop, _local, versus="collgrad_fp32_set", sources=DS),
    Method("collgrad_fp32_set", _fp32_set, _of_result),
    Method(
        "deepspeed_consolidated_save", _consolidated_save, _consolidated_reading, versus="collgrad_save", sources=DS
    ),
    Method("fsdp2_state_dict_save", _consolidated_save, _consolidated_reading, versus="collgrad_save", sources=FSDP2),
    Method("collgrad_save", _save, _of_saved),
    # The documented loop of DeepSpeed's three getters, as it is and with collgrad installed in their place.
    Method("deepspeed_getters_loop", _getters_loop, _getters_reading, versus="dropin_getters_loop", sources=DS),
    Method("dropin_getters_loop", _dropin_loop, _of_dropin, sources=DS),
    Method("raw_all_reduce", _raw_all_reduce, _raw_all_reduce_reading),
    Method("raw_all_gather", _raw_all_gather, _raw_all_gather_reading),
)


def methods_for(source: str, only: tuple[str, ...] = ()) -> list[Method]:
    """The methods ``source`` runs, in report order; ``only``: just these (empty: all). Pure."""
    return [m for m in METHODS if source in m.sources and (not only or m.name in only)]


def floors() -> dict[str, Floor]:
    """Each method that has a floor, by name, in report order. Pure."""
    return {m.name: m.floor for m in METHODS if m.floor is not None}


def versus() -> list[tuple[str, str]]:
    """(loop, collgrad method) pairs, in report order. Pure."""
    return [(m.name, m.versus) for m in METHODS if m.versus is not None]
