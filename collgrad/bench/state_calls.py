"""The rows of the rest of the training state (fp32 master weights, optimizer states, saves, the
drop-in) and of what they are held against: the frameworks' per-parameter loops and consolidation.
``STATE_METHODS`` is their part of the table, in report order."""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import collgrad
from collgrad.bench import frameworks
from collgrad.bench.frameworks import read_all, read_plan, write_safetensors
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
    of_result,
    setter_loop,
)
from collgrad.checkpoint.safetensors import open_checkpoint

__all__ = ["STATE_METHODS"]

# How records are read.


def _state_loop_reading(s: Setting, call: Call) -> Reading:
    """The framework's per-parameter fp32 weights or states: one collective per parameter, fp32."""
    return loop_reading(s, 4)


def _of_saved(s: Setting, call: Call) -> Reading:
    """One more save; its streams' records, and a training state's exchanges of small slices."""
    saved: Any = call()
    records = saved.records
    moved = (getattr(saved, "collectives", 0), getattr(saved, "bytes_sent", 0))  # save_full_model's: none
    return Reading(sum(r.collectives for r in records) + moved[0], sum(r.bytes for r in records) + moved[1])


def _consolidated_reading(s: Setting, call: Call) -> Reading:
    """The frameworks' consolidation: not counted. What it sends depends on their internals (ZeRO-3
    gathers a module's parameters at a time, but not those it keeps whole, below its persistence
    threshold; FSDP2 each parameter); its time and memory are what the row is for."""
    return Reading(None, None)


def _weights_loop_reading(s: Setting, call: Call) -> Reading:
    """DeepSpeed's setter and its documented weight change per parameter: not counted (local below
    ZeRO-3; under it what ``GatheredParameters`` sends, a gather and a broadcast per parameter, depends
    on DeepSpeed's internals); its time is what the row is for."""
    return Reading(None, None)


# How calls are built.


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


def _fp32_set(check: bool) -> Callable[[Setting], Call]:
    def make(s: Setting) -> Call:
        return lambda: collgrad.safe_set_full_model_fp32_params(s.subject.engine, s.fp32, check=check)

    return make


def _fp32_set_loop(s: Setting) -> Call:
    return setter_loop(s, s.fp32, s.subject.set_fp32)


def _fp32_and_weights_loop(s: Setting) -> Call:
    """What a DeepSpeed user writes so that the next forward uses the new weights: the fp32 setter and
    the module's weight changed the documented way (``Subject.set_weight``), per parameter."""
    put, weight = s.subject.set_fp32, s.subject.set_weight
    both = None if put is None or weight is None else (lambda p, v: (put(p, v), weight(p, v)))
    return setter_loop(s, s.fp32, both)


def _state_set(check: bool) -> Callable[[Setting], Call]:
    def make(s: Setting) -> Call:
        engine, opt = s.subject.engine, s.subject.optimizer_obj
        return lambda: collgrad.safe_set_full_model_optimizer_states(
            engine, "exp_avg", s.exp_avg, optimizer=opt, check=check
        )

    return make


def _state_set_loop(s: Setting) -> Call:
    put = s.subject.set_state
    return setter_loop(s, s.exp_avg, None if put is None else (lambda p, v: put(p, v, "exp_avg")))


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


def _load(s: Setting) -> Call:
    """collgrad's load of the checkpoint into the engine as it is: each rank its own byte ranges."""
    path, engine = s.checkpoint(), s.subject.engine
    return lambda: collgrad.load_full_model(engine, path)


def _raw_reads(s: Setting) -> Call:
    """The floor of a load: the same byte ranges this rank's load reads (adjacent ones joined, as the load
    joins them), each one ``os.preadv`` from the same files into its own place in one preallocated buffer
    of all of them (the memory a load fills, in one piece; no checks, no conversion, no second copy)."""
    reads = read_plan(s.subject.engine, s.checkpoint())
    view = memoryview(bytearray(sum(r.nbytes for r in reads)))
    starts = [0]
    for r in reads[:-1]:
        starts.append(starts[-1] + r.nbytes)

    def call() -> Any:
        fds = {f: os.open(f, os.O_RDONLY) for f in dict.fromkeys(r.file for r in reads)}
        try:
            for r, at in zip(reads, starts):
                done = 0
                while done < r.nbytes:
                    done += os.preadv(fds[r.file], [view[at + done : at + r.nbytes]], r.offset + done)
        finally:
            for fd in fds.values():
                os.close(fd)
        return sum(r.nbytes for r in reads)

    return call


def _whole_on(path: str, ranks: str) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` read whole by rank 0 (``ranks="first"``) or by every rank, as users hand
    it to a framework's loader; the other ranks hold its shapes only (meta tensors). Local."""
    checkpoint = open_checkpoint(path)
    if ranks == "every" or dist.get_rank() == 0:
        return read_all(checkpoint)
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in checkpoint.tensors.items()}


def _gathered_load(s: Setting) -> Call:
    """The loop DeepSpeed documents for changing weights, as users load into an existing engine: rank 0
    reads the checkpoint, then per parameter ``GatheredParameters(p, modifier_rank=0)`` and a copy on
    rank 0 (a gather and a broadcast each; below ZeRO-3 every rank reads it and copies into the weight
    it holds). The fp32 masters are left as they were."""
    named, put, path = dict(s.subject.engine.module.named_parameters()), s.subject.set_weight, s.checkpoint()
    zero3 = any(hasattr(p, "ds_id") for p in named.values())

    def call() -> Any:
        state = _whole_on(path, "first" if zero3 else "every")
        assert put is not None
        for name, p in named.items():
            put(p, state[name])
        return len(named)

    return call


def _transformers_zero3_load(s: Setting) -> Call:
    """What Transformers' ``from_pretrained`` runs under ``HfDeepSpeedConfig`` (ZeRO-3) once rank 0 has
    read the checkpoint: per submodule, its parameters gathered, rank 0's values copied in, partitioned
    again (``collgrad.integrations.transformers.load_into_zero3``). The fp32 masters are left as they were."""
    from collgrad.integrations.transformers import load_into_zero3

    module, config, path = s.subject.engine.module, dict(s.ds_config or {}), s.checkpoint()
    return lambda: load_into_zero3(module, _whole_on(path, "first"), config)


def _broadcast_load(s: Setting) -> Call:
    """FSDP2's own loading from rank 0 (Accelerate's ``cpu_ram_efficient_loading``): rank 0 reads the
    checkpoint, ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``."""
    model, path = s.subject.engine, s.checkpoint()  # written on every rank at binding (collective)
    return lambda: frameworks.load_full_state_dict(model, _whole_on(path, "first") if dist.get_rank() == 0 else {})


def _of_loaded(s: Setting, call: Call) -> Reading:
    """One more load: the collectives that moved bytes other ranks read (small slices exchanged, what the
    ranks hold alike gathered; its two agreements are not counted); the bytes each rank read, gathered
    from every rank."""
    loaded: Any = call()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, loaded.bytes_read)
    data = sum(t.nbytes for t in open_checkpoint(s.checkpoint()).tensors.values())
    return Reading(loaded.collectives, loaded.bytes_sent, read_bytes=tuple(every), checkpoint_bytes=data)


def _training_save(s: Setting) -> Call:
    """collgrad's save of the whole training state: each rank its own ranges, at their offsets."""
    engine, opt, path = s.subject.engine, s.subject.optimizer_obj, os.path.join(s.save_dir, "training")
    return lambda: collgrad.save_training_state(engine, path, optimizer=opt, max_shard_bytes=s.shard)


def _framework_save(s: Setting) -> Call:
    """The framework's own save of the training state: DeepSpeed's ``save_checkpoint`` (per-rank files of
    its partitions), or DCP's ``dcp.save`` of ``get_state_dict`` (FSDP2)."""
    path = os.path.join(s.save_dir, s.subject.source)
    return lambda: _framework_saver(s)(path)


def _framework_saver(s: Setting) -> Callable[[str], Any]:
    sub = s.subject
    if sub.source == "fsdp2":
        return lambda path: frameworks.dcp_save(sub.engine, sub.optimizer_obj, path)
    return lambda path: sub.engine.save_checkpoint(path)


def _framework_save_synced(s: Setting) -> Call:
    """DeepSpeed's ``save_checkpoint`` made durable as collgrad's save is: then every file of the
    checkpoint flushed to the disk (``fsync``, on every rank: a file another rank flushed costs
    nothing more) and the directories (DeepSpeed's checkpoint engine flushes nothing itself)."""
    path = os.path.join(s.save_dir, "deepspeed-synced")
    save = _framework_saver(s)

    def call() -> Any:
        save(path)
        for where, _, names in os.walk(path):
            for name in [*names, "."]:
                fd = os.open(os.path.join(where, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    return call


def _training_load(s: Setting) -> Call:
    """collgrad's resume from its own checkpoint of the model as it is: each rank its own ranges."""
    engine, opt = s.subject.engine, s.subject.optimizer_obj
    path = s.resumable(
        "collgrad", lambda p: collgrad.save_training_state(engine, p, optimizer=opt, max_shard_bytes=s.shard)
    )
    return lambda: collgrad.load_training_state(engine, path, optimizer=opt)


def _framework_load(s: Setting) -> Call:
    """The framework's own resume: DeepSpeed's ``load_checkpoint`` of its ``save_checkpoint``, DCP's
    ``dcp.load`` into ``get_state_dict`` then ``set_state_dict`` (FSDP2)."""
    sub = s.subject
    path = s.resumable(sub.source, _framework_saver(s))
    if sub.source == "fsdp2":
        return lambda: frameworks.dcp_load(sub.engine, sub.optimizer_obj, path)
    return lambda: sub.engine.load_checkpoint(path)


def _offline(s: Setting, convert: Callable[[str, str], Any]) -> Call:
    """``convert(checkpoint, out)`` of DeepSpeed's own checkpoint of the model as it is, offline: on
    rank 0 (the others wait at the clock's barriers), in a directory of its own each call."""
    source = s.resumable("deepspeed", _framework_saver(s))
    out = os.path.join(s.save_dir, f"offline-{dist.get_rank()}")
    if dist.get_rank() != 0:
        return lambda: None

    def call() -> Any:
        shutil.rmtree(out, ignore_errors=True)
        return convert(source, out)

    return call


def _convert(s: Setting) -> Call:
    """collgrad's converter: the whole training state, each tensor piece by piece from the mapped files."""
    return _offline(s, lambda src, out: collgrad.convert_deepspeed_checkpoint(src, out, max_shard_bytes=s.shard))


def _zero_to_fp32(s: Setting) -> Call:
    """DeepSpeed's ``zero_to_fp32``: the fp32 weights only (no optimizer state), as safetensors."""
    return _offline(s, frameworks.zero_to_fp32)


def _of_training_loaded(s: Setting, call: Call) -> Reading:
    """One more resume: the collectives that moved bytes other ranks read (as ``_of_loaded``); the bytes
    each rank read, gathered from every rank."""
    loaded: Any = call()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, loaded.bytes_read)
    return Reading(loaded.collectives, loaded.bytes_sent, read_bytes=tuple(every))


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
        served = dropin.install(s.subject.engine, window_bytes=s.bucket)
        s.cleanups.append(dropin.uninstall)
        before = list(served.sent)
        _getters(s, served.functions)
        return served.sent[0] - before[0], served.sent[1] - before[1]

    return call


def _getters_reading(s: Setting, call: Call) -> Reading:
    """DeepSpeed's three getters per parameter: its gradient loop and two fp32 loops."""
    grads, states = loop_reading(s, s.subject.loop_element_size), _state_loop_reading(s, call)
    collectives = (grads.collectives or 0) + 2 * (states.collectives or 0)
    return Reading(collectives, (grads.bytes or 0) + 2 * (states.bytes or 0))


def _of_dropin(s: Setting, call: Call) -> Reading:
    """One more loop; what the drop-in sent (its windows, DeepSpeed's originals where it fell back)."""
    collectives, sent = call()
    return Reading(collectives, sent)


STATE_METHODS: tuple[Method, ...] = (
    # fp32 master weights and Adam's moments, read and written, against the per-parameter loops
    Method("deepspeed_fp32_loop", _state_loop(None), _state_loop_reading, versus="collgrad_fp32", sources=DS),
    Method("full_tensor_fp32_loop", _state_loop(None), _state_loop_reading, versus="collgrad_fp32", sources=FSDP2),
    Method("collgrad_fp32", _state(None), of_result),
    *(
        Method(f"{loop}_{key}_loop", _state_loop(key), _state_loop_reading, versus=f"collgrad_{key}", sources=where)
        for key in ("exp_avg", "exp_avg_sq")
        for loop, where in (("deepspeed", DS), ("full_tensor", FSDP2))
    ),
    Method("collgrad_exp_avg", _state("exp_avg"), of_result),
    Method("collgrad_exp_avg_sq", _state("exp_avg_sq"), of_result),
    # DeepSpeed's setters write this rank's part locally; the fp32 one leaves the module's weights as they
    # were, so it is also held against the loop that changes them the documented way
    Method("deepspeed_fp32_set_loop", _fp32_set_loop, local_reading, versus="collgrad_fp32_set", sources=DS),
    Method("collgrad_fp32_set", _fp32_set(check=True), of_result),
    Method("collgrad_fp32_set_unchecked", _fp32_set(check=False), of_result, sources=DS),
    Method(
        "deepspeed_fp32_weights_set_loop",
        _fp32_and_weights_loop,
        _weights_loop_reading,
        versus=("collgrad_fp32_set", "collgrad_fp32_set_unchecked"),
        sources=DS,
    ),
    Method(
        "deepspeed_exp_avg_set_loop",
        _state_set_loop,
        local_reading,
        versus=("collgrad_exp_avg_set", "collgrad_exp_avg_set_unchecked"),
        sources=DS,
    ),
    Method("collgrad_exp_avg_set", _state_set(check=True), of_result),
    Method("collgrad_exp_avg_set_unchecked", _state_set(check=False), of_result, sources=DS),
    # a consolidated checkpoint, against the frameworks' consolidation
    Method(
        "deepspeed_consolidated_save", _consolidated_save, _consolidated_reading, versus="collgrad_save", sources=DS
    ),
    Method("fsdp2_state_dict_save", _consolidated_save, _consolidated_reading, versus="collgrad_save", sources=FSDP2),
    Method("collgrad_save", _save, _of_saved),
    # loading a checkpoint into the engine as it is, against the frameworks' ways (rank 0 reads it all)
    Method(
        "transformers_zero3_load",
        _transformers_zero3_load,
        _consolidated_reading,
        versus="collgrad_load",
        sources=DS,
        stages=(3,),
        needs=("transformers",),
    ),
    Method("deepspeed_gathered_load", _gathered_load, _weights_loop_reading, versus="collgrad_load", sources=DS),
    Method("fsdp2_broadcast_load", _broadcast_load, _consolidated_reading, versus="collgrad_load", sources=FSDP2),
    Method("collgrad_load", _load, _of_loaded, floor=Floor("raw_reads", 1.5)),
    Method("raw_reads", _raw_reads, lambda s, call: Reading(0, 0)),
    # the documented loop of DeepSpeed's three getters, as it is and with collgrad installed in their place
    Method("deepspeed_getters_loop", _getters_loop, _getters_reading, versus="dropin_getters_loop", sources=DS),
    Method("dropin_getters_loop", _dropin_loop, _of_dropin, sources=DS),
    # the whole training state saved and resumed, against the frameworks' own checkpoints
    Method(
        "deepspeed_checkpoint_save", _framework_save, _consolidated_reading, versus="collgrad_training_save", sources=DS
    ),
    Method(
        "deepspeed_synced_save",
        _framework_save_synced,
        _consolidated_reading,
        versus="collgrad_training_save",
        sources=DS,
    ),
    Method("dcp_save", _framework_save, _consolidated_reading, versus="collgrad_training_save", sources=FSDP2),
    Method("collgrad_training_save", _training_save, _of_saved),
    Method(
        "deepspeed_checkpoint_load", _framework_load, _consolidated_reading, versus="collgrad_training_load", sources=DS
    ),
    Method("dcp_load", _framework_load, _consolidated_reading, versus="collgrad_training_load", sources=FSDP2),
    Method("collgrad_training_load", _training_load, _of_training_loaded),
    # DeepSpeed's own checkpoint made world-size-free offline, in one process (rank 0); at ZeRO-2/3, as
    # zero_to_fp32 refuses the checkpoints of BF16_Optimizer (the bench's ZeRO-1 bf16)
    Method(
        "deepspeed_zero_to_fp32",
        _zero_to_fp32,
        _consolidated_reading,
        versus="collgrad_convert",
        sources=DS,
        stages=(2, 3),
        needs=("safetensors", "huggingface_hub"),  # zero_to_fp32 writes safetensors shards with them
    ),
    Method("collgrad_convert", _convert, lambda s, call: Reading(0, 0), sources=DS, stages=(2, 3)),
)
