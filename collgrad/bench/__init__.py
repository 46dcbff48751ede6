"""``python -m collgrad bench``: full-model gradient access measured side by side, on one engine.

Methods (``collgrad.bench.methods.METHODS``), each timed barrier to barrier over ``--reps``
repetitions after warm-up:

  deepspeed_loop   ``deepspeed.utils.safe_get_full_grad`` for every parameter (the status quo;
                   ``full_tensor_loop`` for FSDP2)
  collgrad_<plan>  ``safe_get_full_model_grads`` for each plan the group allows (all_gather,
                   all_reduce, and the per-tensor fallback forced through the registry)
  collgrad_iter    ``iter_full_model_grads`` consumed to the end
  raw_all_reduce   one all_reduce of a flat buffer holding the model's gradient bytes (the floor)
  raw_all_gather   one all_gather of each rank's share of those bytes into the full buffer
  raw_write        one all_gather of a readiness row and the copies a gradient write makes (its floor)

and writing and statistics against the frameworks' per-parameter loops. Bytes are counted in the
dtype of what is moved. Reported per method: median, min and max (ms, rank 0's clock), the slowest
rank's time inside the call, bytes this rank sent into collectives, collectives issued, peak extra
memory (host bytes in use, sampled every ms; on a CUDA or XPU device, torch's peak allocation there:
see ``collgrad.bench.memory``), minor page faults, and ratios against the floor and the loops.

Modules: ``config`` (what a run measures), ``models`` (the model and engine; the bench's one door to
the DeepSpeed and FSDP2 adapters), ``memory`` and ``timing`` (measurement), ``methods`` (the typed
method table), ``run`` (one run on the ranks), ``report``, ``sweep``, ``cli`` (options, entry point).
Imports flow one way: cli -> run, sweep, report -> methods -> models -> config, and run -> timing -> memory.
"""

from __future__ import annotations

from collgrad.bench.cli import add_arguments, main
from collgrad.bench.config import BenchConfig
from collgrad.bench.memory import host_bytes_in_use
from collgrad.bench.methods import METHODS, Floor, Method, Reading
from collgrad.bench.models import VectorModel
from collgrad.bench.report import format_report
from collgrad.bench.run import run_bench

#: The name ``tests/deepspeed/test_no_side_effects.py`` imports (kept for it).
_host_bytes_in_use = host_bytes_in_use

__all__ = [
    "BenchConfig",
    "run_bench",
    "main",
    "add_arguments",
    "format_report",
    "VectorModel",
    "METHODS",
    "Method",
    "Floor",
    "Reading",
]
