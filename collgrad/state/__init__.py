"""Model-wide gradients: source -> plan -> steps -> execute.

sources/         where each rank's owned gradient lives: base.py (Source, LocalGrads, Problem, ...),
                 layout.py (plain data), deepspeed.py (the only module that imports deepspeed; its
                 engine hooks and NVMe swapping in engine_hooks.py, swap.py), fsdp2.py; the package
                 itself opens the right one. Read without communicating
plan.py          pure: layout + call arguments + agreed capabilities -> GradPlan (frozen)
steps.py         pure: each step of a plan as frozen data (cuts, reduce steps, copy plans, sliced steps)
cache.py         what a source keeps between calls: typed, LRU-bounded per call shape
model_cache.py   sources per dispatcher and model (weakly)
call.py          opening a call: arguments, cached source and plans, readiness agreed on every rank
placements.py    where a rank's pieces lie, as told in the readiness check
execute.py       the executor: one function per plan kind, each only moves bytes (runner.py: what they
                 share; gather_flat.py, gather_sliced.py, reduce.py)
read.py          safe_get_full_model_grads, iter_full_model_grads
state.py         the fp32 master weights and optimizer states, read and written the same way
                 (sources: deepspeed_state.py, fsdp2.py)
write.py         safe_set_full_model_grads, update_full_model_grads
stats.py         model_grad_stats: per-parameter statistics without building any full gradient
                 (stat_blocks.py: pure blocks; stat_reduce.py: this rank's reductions)
save.py          save_full_model: a consolidated checkpoint streamed into safetensors shards (shards.py)
hook.py          register_pre_step_hook: a function run inside DeepSpeed's fused step(), where they are valid
record.py        what a call did
"""

from collgrad.state.hook import PreStepHook, register_pre_step_hook
from collgrad.state.plan import PLANS, GradPlan, PlanKind
from collgrad.state.read import FullGrads, FullGradStream, iter_full_model_grads, safe_get_full_model_grads
from collgrad.state.record import FullGradRecord, GroupRecord
from collgrad.state.save import SavedModel, save_full_model
from collgrad.state.state import (
    iter_full_model_fp32_params,
    iter_full_model_optimizer_states,
    safe_get_full_model_fp32_params,
    safe_get_full_model_optimizer_states,
    safe_set_full_model_fp32_params,
    safe_set_full_model_optimizer_states,
)
from collgrad.state.stats import GradStat, GradStats, model_grad_stats
from collgrad.state.write import safe_set_full_model_grads, update_full_model_grads

__all__ = [
    "save_full_model",
    "SavedModel",
    "safe_get_full_model_grads",
    "safe_get_full_model_fp32_params",
    "iter_full_model_fp32_params",
    "safe_get_full_model_optimizer_states",
    "iter_full_model_optimizer_states",
    "safe_set_full_model_fp32_params",
    "safe_set_full_model_optimizer_states",
    "iter_full_model_grads",
    "FullGrads",
    "FullGradStream",
    "FullGradRecord",
    "GroupRecord",
    "GradPlan",
    "PlanKind",
    "PLANS",
    "model_grad_stats",
    "safe_set_full_model_grads",
    "update_full_model_grads",
    "GradStats",
    "GradStat",
    "register_pre_step_hook",
    "PreStepHook",
]
