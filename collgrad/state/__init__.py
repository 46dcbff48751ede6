"""The partitioned training state in memory, model-wide: kinds -> layout -> adapters -> call -> plan ->
execute. Nothing here touches a file: checkpoints are collgrad.checkpoint's, which builds on this. The
public functions are collgrad's (collgrad/__init__.py); this package only holds their modules.

kinds.py         the kinds of state as typed values: GRAD, FP32, WEIGHTS, OptimizerState(key)
layout.py        pure: which flat range of which parameter each rank holds, for any kind (frozen data)
adapters/        a model resolved once (``resolve``: a DeepSpeed engine, an FSDP2 root, a plain module)
                 into sources that say where this rank's part lies: base.py (Source, LocalGrads,
                 Problem), deepspeed.py (the only module that imports deepspeed; every kind of its state;
                 engine_hooks.py, swap.py), fsdp2.py (the only one that reaches into FSDP2)
plan.py          pure: layout + call arguments + agreed capabilities -> GradPlan (frozen)
steps.py         pure: each step of a plan as frozen data (cuts, reduce steps, copy plans, sliced steps)
cache.py         what a source keeps between calls: typed, LRU-bounded per call shape
model_cache.py   sources per dispatcher and model (weakly), each model's write count; a call's Context
call.py          opening a call: arguments checked, source taken, readiness agreed on every rank
placements.py    where a rank's pieces lie, as told in the readiness check
execute.py       the executor: one function per plan kind, each only moves bytes (runner.py: what they
                 share; gather_flat.py, gather_sliced.py, reduce.py)
read.py          safe_get_full_model_grads, iter_full_model_grads; FullState, FullGrads, FullStateStream
state.py         the fp32 master weights and optimizer states, read and written the same way
write.py         safe_set_full_model_grads, safe_update_full_model_grads
stats.py         safe_get_full_model_grad_stats: per-parameter statistics without any full gradient
                 (stat_blocks.py: pure blocks; stat_reduce.py: this rank's reductions)
hook.py          register_pre_step_hook: a function run inside DeepSpeed's fused step(), where they are valid
record.py        what a call did
"""
