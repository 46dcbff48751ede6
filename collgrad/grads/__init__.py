"""Model-wide gradients: source -> plan -> execute.

sources/     where each rank's owned gradient lives (layout.py: plain data; deepspeed.py: the
             only module that imports deepspeed), read without communicating
plan.py      pure: layout + call arguments + agreed capabilities -> GradPlan (frozen)
call.py      opening a call: arguments, cached source and plans, readiness agreed on every rank
execute.py   executors per plan kind: only move bytes
read.py      safe_get_full_model_grads, iter_full_model_grads
write.py     safe_set_full_model_grads, update_full_model_grads
stats.py     model_grad_stats: per-parameter statistics without building any full gradient
hook.py      register_pre_step_hook: a function run inside DeepSpeed's fused step(), where they are valid
record.py    what a call did
"""

from collgrad.grads.hook import PreStepHook, register_pre_step_hook
from collgrad.grads.plan import PLANS, GradPlan, PlanKind
from collgrad.grads.read import FullGrads, FullGradStream, iter_full_model_grads, safe_get_full_model_grads
from collgrad.grads.record import FullGradRecord, GroupRecord
from collgrad.grads.stats import GradStat, GradStats, model_grad_stats
from collgrad.grads.write import safe_set_full_model_grads, update_full_model_grads

__all__ = [
    "safe_get_full_model_grads",
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
