"""The frameworks' own paths the benchmark measures collgrad against, how it builds their models, and
every checkpoint helper only the benchmark uses: the one module of the benchmark that imports deepspeed
and FSDP2 (lazily: each where it is used), so that the library's modules hold none of it.

    initialize, zero_to_fp32                 DeepSpeed: an engine; its offline fp32 export
    shard_whole, full_state_dict,            FSDP2: the model sharded; its own consolidation and
    load_full_state_dict, dcp_save, dcp_load   loading; PyTorch DCP's save and resume
    write_safetensors, read_all, read_plan   one process's whole file written or read (the anchors'
                                             side), and the byte ranges a load reads (its floor)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from collgrad.checkpoint import load
from collgrad.checkpoint.agree import position
from collgrad.checkpoint.safetensors import Checkpoint, Entry, lay_out_file
from collgrad.checkpoint.storage import Reader, Run, bytes_of
from collgrad.state import adapters
from collgrad.state.model_cache import Context

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

__all__ = [
    "initialize",
    "zero_to_fp32",
    "shard_whole",
    "full_state_dict",
    "load_full_state_dict",
    "dcp_save",
    "dcp_load",
    "write_safetensors",
    "read_all",
    "read_plan",
]


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> DeepSpeedEngine:
    """``deepspeed.initialize`` of the benchmark's model. Collective: every rank of the job calls it."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def zero_to_fp32(checkpoint_dir: str, out_dir: str) -> None:
    """DeepSpeed's own offline export of a ``save_checkpoint`` directory (the anchor for ``convert``):
    ``zero_to_fp32.py``'s ``convert_zero_checkpoint_to_state_dict``, its fp32 weights as safetensors.
    Local: one process."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    convert_zero_checkpoint_to_state_dict(checkpoint_dir, out_dir, safe_serialization=True)


def shard_whole(model: nn.Module, device_type: str, world: int) -> nn.Module:
    """``model`` sharded with ``fully_shard`` as one unit over all ``world`` ranks (the benchmark's
    FSDP2 model). Collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh(device_type, (world,)))
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """FSDP2's own consolidation, as users save today (the anchor): every parameter gathered whole, one
    at a time, onto rank 0's CPU (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``; the
    other ranks get an empty dict). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state: dict[str, Any] = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """FSDP2's own loading of a whole state dict held by rank 0 (the anchor, Accelerate's
    ``cpu_ram_efficient_loading``): ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``,
    every parameter broadcast from rank 0 and each rank keeping its shard. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, dict(state), options=options)


def dcp_save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """PyTorch's own checkpoint of the training state (the anchor): ``dcp.save`` of
    ``get_state_dict(model, optimizer)``, each rank its shards of every tensor. Collective."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, states = get_state_dict(model, optimizer)
    state_dict_saver.save({"model": weights, "optimizer": states}, checkpoint_id=path)


def dcp_load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """``dcp_save``'s checkpoint resumed as PyTorch documents it: ``dcp.load`` into ``get_state_dict``'s
    tensors, then ``set_state_dict``. Collective."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, states = get_state_dict(model, optimizer)
    state_dict_loader.load({"model": weights, "optimizer": states}, checkpoint_id=path)  # into them, in place
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=states)


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """``tensors`` written to ``path`` as one safetensors file by one process, flushed to the disk (a
    framework's consolidated state dict, the anchors' side); returns the bytes of tensor data."""
    shard = lay_out_file([Entry(n, tuple(t.shape), t.dtype) for n, t in tensors], metadata)
    with open(path, "wb") as f:
        f.write(shard.header)
        for _, t in tensors:
            if t.numel():
                f.write(bytes_of(t.detach().cpu().contiguous()))
        f.flush()
        os.fsync(f.fileno())
    return shard.data_bytes


def read_all(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint``, whole, as one process reads a checkpoint to hand it to a
    framework's loader (the anchors' side). Local."""
    with Reader() as reader:
        return {n: reader.read(t, 0, t.numel).reshape(t.shape) for n, t in checkpoint.tensors.items()}


def read_plan(model: object, path: str | os.PathLike[str]) -> tuple[Run, ...]:
    """The runs of byte ranges ``load_full_model(model, path, strict=False)`` reads on this rank, in
    order, without reading them (the floor of a load times the same reads raw): the load's own check
    and plan (checkpoint/load.py). Local: no communication."""
    entrance = adapters.enter(model)
    assert entrance.model is not None, entrance.error
    checked = load.check(Context.of(None), entrance.model, path, None, strict=False)
    return load.plan(checked, *position(entrance.model_group, entrance.me))
