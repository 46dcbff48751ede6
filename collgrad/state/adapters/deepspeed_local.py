"""What ``collgrad.launch.run_local``'s rank server does with DeepSpeed once, for every rank it forks:
imported by that server's preload (after the DeepSpeed adapter) and by nothing else, so that no other
process, and no rank a launcher started, is changed by it.

DeepSpeed's communication backend on its CPU accelerator JIT-builds a shared-memory all-reduce op at
every process's first ``init_distributed`` (0.19.8: ``deepspeed/comm/torch.py``, ``build_shm_op``),
which only ``inference_all_reduce`` uses (inference-mode AutoTP layers); training's collectives go
through ``torch.distributed``. The build is a C++ compile of a minute or two the first time on a machine
(every other rank waiting on its lock) and an up-to-date check of ~0.6 s in every process after. Local
ranks over Gloo never run ``inference_all_reduce``, so the server marks the op unavailable in the probe
its ranks inherit (``deepspeed.ops.__compatible_ops__``, probed by the adapter's import) and they skip
the build; DeepSpeed's ``inference_all_reduce`` falls back to ``torch.distributed.all_reduce`` there.
"""

from __future__ import annotations

import deepspeed.ops

__all__: list[str] = []

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
