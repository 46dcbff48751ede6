"""The methods measured, one typed object each: its name, how its call is built on a rank, the raw
collective it is held against (its floor, with the goal for the ratio), and how its record is read.

``METHODS`` is the whole table, in report order; ``methods_for(source)`` the ones a source runs. A
method is bound to an engine on a rank (``Method.bind(setting)``), where ``Setting`` holds what the
calls share: the engine, the bucket sizes, the gradients written back, the raw all-gather's share.
Bytes are counted from the dtype of what is moved (``element_size()``), never as 4 per element. The
gradients' rows and the raw floors are built here, the rest of the training state's in
``collgrad.bench.state_calls``, from the types in ``collgrad.bench.setting``.
"""

from __future__ import annotations

import importlib.util
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

import collgrad
from collgrad import _compat
from collgrad.backends import agreement
from collgrad.backends.waits import timeout_from_env
from collgrad.bench.setting import (
    DS,
    FSDP2,
    Call,
    Floor,
    Method,
    Reading,
    Setting,
    local_reading,
    loop_reading,
    make_setting,
    of_result,
    setter_loop,
)
from collgrad.bench.state_calls import STATE_METHODS
from collgrad.core.dispatch import default_dispatcher
from collgrad.state.adapters.base import copy_all
from collgrad.state.call import FIELDS, OpenCall, source_of

__all__ = ["Floor", "Reading", "Setting", "Method", "METHODS", "methods_for", "floors", "versus", "make_setting"]


# How records are read.


def _of_stream(s: Setting, call: Call) -> Reading:
    """A stream of the same bucket consumed to the end; the stream's record."""
    stream = collgrad.iter_full_model_grads(s.subject.engine, bucket_bytes=s.bucket)
    deque(stream, maxlen=0)
    rec = stream.record()
    return Reading(rec.collectives, rec.bytes, tuple(str(g.plan) for g in rec.groups))


def _loop_reading(s: Setting, call: Call) -> Reading:
    """The framework's per-parameter full gradients, in the dtype its accessor returned."""
    return loop_reading(s, s.subject.loop_element_size)


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
    return setter_loop(s, s.full, s.subject.set_grad)


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
    return lambda: collgrad.safe_update_full_model_grads(
        s.subject.engine, lambda n, g: None, bucket_bytes=s.small_bucket
    )


def _stats(s: Setting) -> Call:
    return lambda: collgrad.safe_get_full_model_grad_stats(s.subject.engine)


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


def _raw_write(s: Setting) -> Call:
    """The floor of a write: the readiness check's exchange alone (a row of int64 of its size, through
    ``agreement.exchange``: the device and form every backend takes), then the copies into this rank's
    partitioned buffers that ``safe_set_full_model_grads`` makes of the same values, made ready once
    before the calls (under fp16 scaled once there). Not done: the argument check, the checksum, the plan,
    the views made per call, the writes of groups every rank holds whole and what a source refreshes after
    a write (offload's norms). What a write that agrees before it copies cannot go below."""
    source, _ = source_of(s.subject.engine, dispatcher=default_dispatcher())
    local = source.read()
    with torch.no_grad():
        targets, sources = source.prepare_write(local, s.full, local.loss_scale)
    group = source.control_group if source.control_group is not None else _compat.default_group()
    row = [0] * (1 + len(FIELDS) + OpenCall.EXTRA)

    def call() -> None:
        agreement.exchange(group, row, timeout_s=timeout_from_env(), what="raw_write's exchange")
        with torch.no_grad():
            copy_all(targets, sources)

    return call


def _raw_write_reading(s: Setting, call: Call) -> Reading:
    """Nothing sent that counts: the exchange is the readiness check's, which no record counts as data
    (collgrad's writes report none either)."""
    return Reading(0, 0)


_GATHER = Floor("raw_all_gather", 1.10, goal_stage3=1.20)  # ZeRO-3's all-gather plan also reorders
_REDUCE = Floor("raw_all_reduce", 1.10)
_STREAM = Floor("raw_all_reduce", 1.25)
#: A write's floor copies the same bytes; what collgrad adds is per value (the values checked, joined
#: into runs, the buffers located), which should stay within a quarter of the copy and the agreement.
_WRITE = Floor("raw_write", 1.25)

#: Every method, in report order. Writing and statistics run against the frameworks' own loops; the values
#: written are the gradients themselves, so every repetition sees the same gradients.
METHODS: tuple[Method, ...] = (
    Method("deepspeed_loop", _loop(norm=False), _loop_reading, sources=DS),
    Method("full_tensor_loop", _loop(norm=False), _loop_reading, sources=FSDP2),
    Method("collgrad_all_gather", _grads("all_gather"), of_result, floor=_GATHER),
    Method("collgrad_all_reduce", _grads("all_reduce"), of_result, floor=_REDUCE),
    Method("collgrad_per_tensor", _per_tensor, of_result),  # the fallback, forced through the registry
    # Where ranks hold gradients whole (BF16_Optimizer, stage 0): the optimizer's tensors, no copy.
    Method("collgrad_no_copy", _no_copy, of_result),
    Method("collgrad_iter", _iter, _of_stream, floor=_STREAM),
    # DeepSpeed's setter writes this rank's fragment (ZeRO-1/2) or partition (ZeRO-3) locally.
    Method(
        "deepspeed_set_loop",
        _set_loop,
        local_reading,
        # and against the write's floor: the most any write that agrees before it copies can gain
        versus=("collgrad_set", "collgrad_set_unchecked", "raw_write"),
        sources=DS,
    ),
    Method("collgrad_set", _set(check=True), of_result),
    Method("collgrad_set_unchecked", _set(check=False), of_result, floor=_WRITE),
    Method("collgrad_update", _update, of_result),
    Method("deepspeed_norm_loop", _loop(norm=True), _loop_reading, versus="collgrad_stats", sources=DS),
    Method("full_tensor_norm_loop", _loop(norm=True), _loop_reading, versus="collgrad_stats", sources=FSDP2),
    Method("collgrad_stats", _stats, of_result),
    *STATE_METHODS,  # the rest of the training state, the saves and the drop-in
    Method("raw_all_reduce", _raw_all_reduce, _raw_all_reduce_reading),
    Method("raw_all_gather", _raw_all_gather, _raw_all_gather_reading),
    Method("raw_write", _raw_write, _raw_write_reading),
)


def methods_for(source: str, only: tuple[str, ...] = (), stage: int | None = None) -> list[Method]:
    """The methods ``source`` runs, in report order; ``only``: just these (empty: all); ``stage``: a
    DeepSpeed run's ZeRO stage (None: every stage's). Those whose ``needs`` is not installed are left out."""
    return [
        m
        for m in METHODS
        if source in m.sources
        and (not only or m.name in only)
        and (stage is None or source != "deepspeed" or stage in m.stages)
        and all(importlib.util.find_spec(module) is not None for module in m.needs)
    ]


def floors() -> dict[str, Floor]:
    """Each method that has a floor, by name, in report order. Pure."""
    return {m.name: m.floor for m in METHODS if m.floor is not None}


def versus() -> list[tuple[str, str]]:
    """(loop, collgrad method) pairs, in report order. Pure."""
    return [
        (m.name, ours)
        for m in METHODS
        if m.versus is not None
        for ours in ((m.versus,) if isinstance(m.versus, str) else m.versus)
    ]
