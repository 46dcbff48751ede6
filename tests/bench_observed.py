"""What the benchmark's methods send, observed: ``observe`` runs each method of the bench's table inside
a rank and returns what torch received beside what the bench reports.

What a rank sent into collectives is taken as torch's dispatcher sees it: every ``c10d`` and
``_c10d_functional`` collective op (so DTensor's functional collectives too, which never reach the
Python ``ProcessGroup`` methods that ``tests.counting`` wraps), counted with the bytes of its input
tensors. Inside ``tests.counting.count_collectives`` the calls made for collgrad's agreements are told
apart and left out, so what remains is the data."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.counting import Calls, count_collectives, count_planning

__all__ = ["DEEPSPEED_ROWS", "FSDP2_ROWS", "deepspeed_rows", "Sent", "sent", "observe"]

#: The rows the bench prints, in order, per source (what the tests expect of it).
DEEPSPEED_ROWS = [
    "deepspeed_loop",
    "collgrad_all_gather",
    "collgrad_all_reduce",
    "collgrad_per_tensor",
    "collgrad_no_copy",
    "collgrad_iter",
    "deepspeed_set_loop",
    "collgrad_set",
    "collgrad_set_unchecked",
    "collgrad_update",
    "deepspeed_norm_loop",
    "collgrad_stats",
    "deepspeed_fp32_loop",
    "collgrad_fp32",
    "deepspeed_exp_avg_loop",
    "deepspeed_exp_avg_sq_loop",
    "collgrad_exp_avg",
    "collgrad_exp_avg_sq",
    "deepspeed_fp32_set_loop",
    "collgrad_fp32_set",
    "collgrad_fp32_set_unchecked",
    "deepspeed_fp32_weights_set_loop",
    "deepspeed_exp_avg_set_loop",
    "collgrad_exp_avg_set",
    "collgrad_exp_avg_set_unchecked",
    "deepspeed_consolidated_save",
    "collgrad_save",
    "transformers_zero3_load",  # ZeRO-3 only
    "deepspeed_gathered_load",
    "collgrad_load",
    "raw_reads",
    "deepspeed_getters_loop",
    "dropin_getters_loop",
    "deepspeed_checkpoint_save",
    "deepspeed_synced_save",
    "collgrad_training_save",
    "deepspeed_checkpoint_load",
    "collgrad_training_load",
    "deepspeed_zero_to_fp32",  # ZeRO-2/3 only
    "collgrad_convert",  # ZeRO-2/3 only
    "raw_all_reduce",
    "raw_all_gather",
    "raw_write",
]
FSDP2_ROWS = [
    "full_tensor_loop",
    "collgrad_all_gather",
    "collgrad_all_reduce",
    "collgrad_per_tensor",
    "collgrad_no_copy",
    "collgrad_iter",
    "collgrad_set",
    "collgrad_set_unchecked",
    "collgrad_update",
    "full_tensor_norm_loop",
    "collgrad_stats",
    "full_tensor_fp32_loop",
    "collgrad_fp32",
    "full_tensor_exp_avg_loop",
    "full_tensor_exp_avg_sq_loop",
    "collgrad_exp_avg",
    "collgrad_exp_avg_sq",
    "collgrad_fp32_set",
    "collgrad_exp_avg_set",
    "fsdp2_state_dict_save",
    "collgrad_save",
    "fsdp2_broadcast_load",
    "collgrad_load",
    "raw_reads",
    "dcp_save",
    "collgrad_training_save",
    "dcp_load",
    "collgrad_training_load",
    "raw_all_reduce",
    "raw_all_gather",
    "raw_write",
]


def deepspeed_rows(stage: int) -> list[str]:
    """The rows a DeepSpeed run of ZeRO ``stage`` prints (Transformers' loader is a ZeRO-3 anchor; the
    converter and zero_to_fp32 run at ZeRO-2/3)."""
    stage3 = ("transformers_zero3_load",)
    stages23 = ("deepspeed_zero_to_fp32", "collgrad_convert")
    return [r for r in DEEPSPEED_ROWS if (stage == 3 or r not in stage3) and (stage in (2, 3) or r not in stages23)]


#: Ops that move no data of their own.
_NOT_DATA = {"barrier", "monitored_barrier", "wait_tensor", "_wrap_tensor_autograd"}
#: The schema names of the arguments a rank sends (the rest are outputs, groups and options).
_INPUTS = {"tensors", "input", "inputs", "input_tensor", "input_tensors", "input_list"}


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class Sent(TorchDispatchMode):
    """``calls``: data collectives issued; ``bytes``: their input bytes; ``ops``: their op names."""

    def __init__(self, tagged: Calls | None = None) -> None:
        super().__init__()
        self.tagged = tagged
        self.calls = 0
        self.bytes = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        namespace = func.namespace
        name = func._schema.name.split("::")[-1]
        agreement = self.tagged is not None and self.tagged.in_agreement
        if namespace in ("c10d", "_c10d_functional") and name not in _NOT_DATA and not agreement:
            self.calls += 1
            self.ops.append(name)
            for arg, value in zip(func._schema.arguments, args):
                if arg.name in _INPUTS:
                    self.bytes += _bytes(value)
        return func(*args, **(kwargs or {}))


@contextmanager
def sent(tagged: Calls | None = None) -> Iterator[Sent]:
    """Observe the block; ``tagged``: the ``count_collectives`` block around it, to leave agreements out."""
    with Sent(tagged) as seen:
        yield seen


def observe(rank: int, world: int, configs: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Inside a rank, per configuration (a ``BenchConfig``) and method: the data collectives torch received
    during one call and their bytes (``seen``), whether the call planned anything (``planned``), and the
    bench's reading of the same (``reported``). Each method is called once first: capabilities and plans
    are agreed on a first call."""
    from collgrad.bench.methods import make_setting, methods_for
    from collgrad.bench.models import build_subject

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for cfg in configs:
        setting = make_setting(build_subject(cfg), cfg)
        rows = out[f"{cfg.source} stage {cfg.stage} {cfg.dtype} {cfg.model}"] = {}
        for method in methods_for(cfg.source, (), cfg.stage):
            call = method.bind(setting)
            call()
            with count_planning() as planned, count_collectives() as calls, sent(calls) as seen:
                call()
            reading = method.read(setting, call)
            rows[method.name] = {
                "seen": (seen.calls, seen.bytes),
                "reported": (reading.collectives, reading.bytes),
                "planned": sum(planned.values()),
                "plan_cached": reading.plan_cached,
            }
        torch.distributed.barrier()  # as run_bench: every rank done with the save methods' directory
        if rank == 0:
            setting.close()  # what the save and load methods wrote (left in the temp dir before)
    return out
