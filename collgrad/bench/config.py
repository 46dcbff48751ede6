"""What one benchmark run measures: the configuration, and DeepSpeed's config built from it.

Pure data: nothing here touches a process group, a device or the environment, so it can be built
and checked anywhere (the command line builds it in the parent process, ranks receive it pickled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BenchConfig", "SOURCES", "DTYPES", "MODEL_NAMES", "deepspeed_config"]

#: Where the model's gradients live: a DeepSpeed ZeRO engine (``--stage``) or an FSDP2 ``fully_shard``.
SOURCES = ("deepspeed", "fsdp2")
#: The engine's training precision (``--dtype``); bf16 runs with fp32 gradient accumulation.
DTYPES = ("fp32", "bf16", "fp16")
#: The model measured (``--model``): GPT-2-shaped (mixed tensor sizes) or ``tensors`` equal tensors.
MODEL_NAMES = ("gpt2", "vector")


@dataclass
class BenchConfig:
    """One benchmark run. The defaults are the README's main job (ZeRO-2, fp32, a GPT-2-shaped model of
    400 tensors and 25 MB of gradient)."""

    stage: int = 2
    dtype: str = "fp32"  # fp32 | bf16 (with fp32 gradient accumulation) | fp16
    offload: bool = False
    model: str = "gpt2"  # gpt2 (mixed sizes) | vector (equal tensors)
    tensors: int = 400
    elements: int = 6_553_600
    bucket_mb: float = 25.0
    reps: int = 7
    #: pairs for each plan against its floor (cheap: tens of ms each); the loops use ``reps``
    pairs: int = 21
    warmup: int = 2
    stream_fraction: int = 8  # the streaming check uses a bucket of 1/8 of the model's gradient
    methods: tuple[str, ...] = ()  # empty: all
    world: int = 0  # local runs: ranks to spawn (0: --local, or 2)
    source: str = "deepspeed"  # deepspeed (ZeRO --stage) | fsdp2 (fully_shard)
    #: the model ``scale`` times ``elements`` (the same tensors): the state and save rows at 10x
    scale: float = 1.0
    #: ``save_full_model``'s ``max_shard_bytes`` in the save rows
    shard_mb: float = 25.0

    @property
    def model_elements(self) -> int:
        """The elements of the model built: ``elements`` times ``scale``."""
        return int(self.elements * self.scale)

    @property
    def shard_bytes(self) -> int:
        return int(self.shard_mb * 2**20)

    @property
    def bucket_bytes(self) -> int:
        """The ``bucket_bytes`` passed to collgrad's calls (``--bucket-mb``)."""
        return int(self.bucket_mb * 2**20)


def deepspeed_config(cfg: BenchConfig) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg``: ZeRO ``cfg.stage``, optional CPU optimizer offload, precision.
    Pure; call anywhere."""
    zero: dict[str, Any] = {"stage": cfg.stage}
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if cfg.dtype == "bf16":
        out["bf16"] = {"enabled": True}
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    elif cfg.dtype == "fp16":
        out["fp16"] = {"enabled": True}
    return out
