"""DeepSpeed's own checkpoints (``engine.save_checkpoint``), read as untrusted input without DeepSpeed:
where every element of every tensor of the training state lies in the ranks' files.

    <dir>/latest                                         the tag (when none is given)
    <dir>/<tag>/mp_rank_00_model_states.pt               ZeRO-1/2: the module's weights whole, counters
    <dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO-3: one per rank (frozen fragments)
    <dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   each rank's partitions: fp32
                                                         masters and optimizer states, flat per group

Every file is loaded through a memory map (``torch.load(mmap=True, weights_only=True)``): its tensors
stay in the page cache, never in this process's own memory, and nothing is unpickled but containers,
tensors and four DeepSpeed classes, which are rebuilt as the inert records below (no DeepSpeed code
runs, DeepSpeed need not be installed). Every field is checked against the others before a byte is
trusted; every refusal is a ``CheckpointError`` naming the file and the reason.

The layouts (DeepSpeed 0.19, ``docs/notes/checkpoint-layouts.md`` B4-B6):

    ZeRO-1/2, BF16_Optimizer   one flat group per param group: its trainable parameters back to back
                               (``param_alignment_paddings`` after each), zero padding at the end; cut
                               into world equal partitions of P elements, rank r holding [rP, (r+1)P)
        flat   | a a a a a b b b b c c c c c c 0 0 |   world 3, P = 6
        rank   |    0        |    1       |    2   |   ZeRO-1/2 save each partition without its tail
                                                       padding (P = saved + group_paddings[r])
    ZeRO-3     one flat partition per sub-group on each rank: each of its parameters cut alone into
               world parts of ceil(numel / world), rank r holding part r, back to back
        param a (5 elements), b (4): rank 0 | a0 a1 | b0 b1 |, rank 1 | a2 a3 | b2 b3 |, rank 2 | a4 _ | _ _ |

``placements_zero12`` / ``placements_zero3`` are pure: each tensor as the runs of elements (``Piece``)
that lie in each rank's flat tensor, in the tensor's order.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from collgrad.errors import CheckpointError
from collgrad.state.layout import Split

__all__ = [
    "Piece",
    "Placement",
    "RankState",
    "DeepSpeedCheckpoint",
    "read_deepspeed_checkpoint",
    "placements_zero12",
    "placements_zero3",
    "parts_zero3",
]

#: What a tag may look like: a plain directory name (``global_step1200``), never a path.
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")


# ------------------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of a tensor lying in rank ``rank``'s flat tensor from element ``start``."""

    rank: int
    start: int
    numel: int


@dataclass(frozen=True)
class Placement:
    """One tensor of the state: its name and shape, the flat group it lies in (ZeRO-1/2: its param
    group; ZeRO-3: its sub-group), and its elements as pieces, in order."""

    name: str
    shape: tuple[int, ...]
    group: int
    pieces: tuple[Piece, ...]


def placements_zero12(
    shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    paddings: Sequence[Sequence[int]],
    partition: Sequence[int],
) -> list[Placement]:
    """ZeRO-1/2's (and BF16_Optimizer's) flat groups: group g's parameters ``shapes[g]`` back to back,
    ``paddings[g][j]`` elements after parameter j, cut into partitions of ``partition[g]`` elements, one
    per rank. Pure."""
    out = []
    for g, named in enumerate(shapes):
        size, at = partition[g], 0
        for j, (name, shape) in enumerate(named):
            numel = math.prod(shape)
            pieces, lo = [], at
            while lo < at + numel:
                take = min(at + numel - lo, size - lo % size)
                pieces.append(Piece(lo // size, lo % size, take))
                lo += take
            out.append(Placement(name, shape, g, tuple(pieces)))
            at += numel + paddings[g][j]
    return out


def placements_zero3(shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]], world: int) -> list[Placement]:
    """ZeRO-3's sub-groups: each parameter cut alone into ``world`` parts of ``ceil(numel / world)``
    elements (the last ones short or empty), part r at the same offset of rank r's flat partition of
    the sub-group, after the parts of the parameters before it. Pure."""
    out = []
    for k, named in enumerate(shapes):
        at = 0
        for name, shape in named:
            out.append(Placement(name, shape, k, parts_zero3(math.prod(shape), world, at)))
            at += -(-math.prod(shape) // world)
    return out


def parts_zero3(numel: int, world: int, at: int) -> tuple[Piece, ...]:
    """A ZeRO-3 parameter of ``numel`` elements as its ``world`` parts of ``ceil(numel / world)`` (the last
    ones short or empty: none for an empty one), part r at element ``at`` of rank r's flat tensor. Pure."""
    part = -(-numel // world)
    return tuple(Piece(r, at, min(part, numel - r * part)) for r in range(world) if r * part < numel)


def flat_sizes_zero3(shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]], world: int) -> list[int]:
    """Elements of each sub-group's flat partition on every rank (every rank the same). Pure."""
    return [sum(-(-math.prod(shape) // world) for _, shape in named) for named in shapes]


# ------------------------------------------------------------------------------------------- the records


class _Record:
    """What a pickled DeepSpeed object becomes here: its attributes, and nothing that runs."""

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots), as pickle's BUILD allows
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})


class _LossScaler(_Record):
    pass


class _DynamicLossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    pass


def _zero_stage(value: object) -> int:
    """``ZeroStageEnum(value)``, pickled as a call with its value: the value."""
    if type(value) is not int:
        raise TypeError(f"a ZeRO stage of {type(value).__name__}")
    return value


#: The only classes a DeepSpeed 0.19 checkpoint pickles (notes B7), each rebuilt as an inert record.
_ALLOWED: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


# ----------------------------------------------------------------------------------------- the checkpoint


@dataclass(frozen=True)
class RankState:
    """One rank's part of the optimizer's state: per flat group, its fp32 master partition (ZeRO-1/2:
    without its tail padding) and every state the optimizer keeps of it; ZeRO-3's frozen parameters'
    fragments by name."""

    fp32: tuple[torch.Tensor, ...]
    states: tuple[Mapping[str, Any], ...]
    frozen: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint, checked: ``layout`` ("zero1", "zero2", "zero3", "bf16-optimizer"), its data-
    parallel ``world``; rank 0's ``module`` state (the weights whole below ZeRO-3, empty placeholders under
    it; the persistent buffers), ``aliases`` (tied names -> the name kept); where every trainable
    parameter (``trainable``) and, under ZeRO-3, every frozen one (``frozen``) lies; each rank's part;
    the per-element optimizer state keys (``keys``, the same for every group, or none: it never
    stepped); each param group's flat groups and hyperparameters; each flat group's states that are not
    per element (rank 0's, checked the same on every rank); the LR scheduler's state and the engine's
    counters."""

    path: str
    tag: str
    layout: str
    world: int
    module: Mapping[str, torch.Tensor]
    buffers: tuple[str, ...]
    aliases: Mapping[str, str]
    trainable: tuple[Placement, ...]
    frozen: tuple[Placement, ...]
    ranks: tuple[RankState, ...]
    keys: tuple[str, ...]
    param_groups: tuple[tuple[tuple[int, ...], Mapping[str, Any]], ...]
    group_states: tuple[Mapping[str, Any], ...]
    lr_scheduler: Mapping[str, Any] | None
    counters: Mapping[str, int | float]
    #: Under tensor parallelism (AutoTP: ``mp_world_size`` T > 1) each tensor-parallel rank's part, a
    #: checkpoint of its own over the data-parallel ranks (``mp_rank_<t>`` files), in rank order: this one
    #: is the first (empty without tensor parallelism).
    parts: tuple[DeepSpeedCheckpoint, ...] = ()
    #: Of this part's parameters, the tensor-parallel shards and where each lies in its whole tensor.
    splits: Mapping[str, Split] = field(default_factory=dict)


def _refuse(where: str, reason: str) -> CheckpointError:
    return CheckpointError(f"{where}: {reason}; nothing was written")


def _tag(directory: str, tag: str | None) -> str:
    """The tag asked for, or the one ``latest`` names (as DeepSpeed's loader takes it), checked to be a
    plain directory name inside ``directory``."""
    if tag is None:
        latest = os.path.join(directory, "latest")
        try:
            with open(latest, "rb") as f:
                raw = f.read(1024)
        except FileNotFoundError:
            raise _refuse(directory, "has no 'latest' file naming a tag: pass the tag (--tag global_stepN)") from None
        except OSError as error:
            raise _refuse(latest, f"cannot be read ({error.strerror or error})") from error
        try:
            tag = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise _refuse(latest, "is not text") from None
    if not _TAG.match(tag):
        raise _refuse(directory, f"the tag {tag!r} is not a plain directory name")
    root = os.path.realpath(directory)
    inside = os.path.realpath(os.path.join(directory, tag))
    if os.path.commonpath([root, inside]) != root or not os.path.isdir(inside):
        raise _refuse(directory, f"the tag {tag!r} is not a directory inside it")
    return tag


def _load(path: str, root: str) -> dict[str, Any]:
    """One of DeepSpeed's ``.pt`` files, memory-mapped, with only the allowed classes rebuilt; a dict."""
    resolved = os.path.realpath(path)
    if os.path.commonpath([os.path.realpath(root), resolved]) != os.path.realpath(root):
        raise _refuse(path, "resolves outside the checkpoint's directory")
    if not os.path.isfile(resolved):
        raise _refuse(path, "is not there (every rank's file is needed)")
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            found = torch.load(resolved, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # torch's unpickler raises many kinds for a malformed or hostile file
        raise _refuse(
            path, f"cannot be loaded as a DeepSpeed checkpoint file ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(found, dict):
        raise _refuse(path, f"holds a {type(found).__name__}, not DeepSpeed's dict")
    return found


def _field(found: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = found.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise _refuse(where, f"its {key!r} is {type(value).__name__}, not what DeepSpeed writes")
    return value


def _shapes(found: Any, where: str, what: str) -> list[tuple[str, tuple[int, ...]]]:
    """A mapping of names to shapes (``torch.Size`` or lists of non-negative ints), in order."""
    if not isinstance(found, dict):
        raise _refuse(where, f"its {what} is not a mapping of names to shapes")
    out = []
    for name, shape in found.items():
        if not isinstance(name, str) or not isinstance(shape, (torch.Size, list, tuple)):
            raise _refuse(where, f"its {what} holds {name!r}: {type(shape).__name__}")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise _refuse(where, f"its {what} gives {name} the shape {list(shape)}")
        out.append((name, tuple(shape)))
    return out


def _flat(found: Any, where: str, what: str, numel: int | None = None) -> torch.Tensor:
    if not isinstance(found, torch.Tensor) or found.dim() != 1 or not found.dtype.is_floating_point:
        raise _refuse(where, f"its {what} is not a flat floating-point tensor")
    if numel is not None and found.numel() != numel:
        raise _refuse(where, f"its {what} holds {found.numel()} elements where its layout has {numel}")
    return found


def _files(path: str, layout_prefix: str, world: int, zero3: bool, mp: int = 0) -> tuple[list[str], list[str]]:
    """Every data-parallel rank's model-state and optimizer-state file names of tensor-parallel rank
    ``mp`` (computed here, never read from a file)."""
    optim = [
        os.path.join(path, f"{layout_prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt") for r in range(world)
    ]
    if zero3:
        model = [os.path.join(path, f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt") for r in range(world)]
    else:
        model = [os.path.join(path, f"mp_rank_{mp:02d}_model_states.pt")]
    return model, optim


def _model_file(path: str, mp: int = 0) -> str:
    """Data-parallel rank 0's model-state file of tensor-parallel rank ``mp``: ZeRO-3's, else ZeRO-0/1/2's."""
    for name in (f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt", f"mp_rank_{mp:02d}_model_states.pt"):
        if os.path.lexists(os.path.join(path, name)):
            return os.path.join(path, name)
    raise _refuse(path, f"holds no mp_rank_{mp:02d}_model_states.pt: not a DeepSpeed checkpoint's tag directory")


def read_deepspeed_checkpoint(directory: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedCheckpoint:
    """The DeepSpeed checkpoint ``directory`` holds under ``tag`` (default: the one ``latest`` names),
    every file memory-mapped and checked. Under AutoTP (``mp_world_size`` > 1) every tensor-parallel
    rank's part, each shard placed in its whole tensor (``_tensor_parallel``); MoE experts under their
    global names (``_experts``). CheckpointError for anything DeepSpeed would not have written, or a
    checkpoint of a kind this reader does not take (stage 0, pipeline parallelism, fused tensor-parallel
    layouts, MoE under tensor parallelism, elastic optimizer states, NVMe-offloaded states). Local: no
    process group."""
    root = os.fspath(directory)
    tag = _tag(root, tag)
    path = os.path.join(root, tag)
    first, model0 = _part(path, tag, 0)
    size = _field(model0, "mp_world_size", int, _model_file(path))
    dims = model0.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and dims.get("pp_degree", 1) != 1:
        raise _refuse(_model_file(path), f"was written with pipeline parallelism ({dims}), which convert does not read")
    if size == 1:
        return first
    if not 1 < size <= 4096:
        raise _refuse(_model_file(path), f"its mp_world_size is {size}")
    parts = [first] + [_part(path, tag, t)[0] for t in range(1, size)]
    splits = _tensor_parallel(parts, model0, _model_file(path))
    placed = tuple(replace(part, splits=s) for part, s in zip(parts, splits))
    return replace(placed[0], parts=placed)


def _part(path: str, tag: str, mp: int) -> tuple[DeepSpeedCheckpoint, dict[str, Any]]:
    """Tensor-parallel rank ``mp``'s checkpoint over the data-parallel ranks (the whole checkpoint without
    tensor parallelism), and its data-parallel rank 0's model-state file as loaded."""
    first = _model_file(path, mp)
    zero3 = os.path.basename(first).startswith("zero_pp_rank_")
    model0 = _load(first, path)
    world = _field(model0, "dp_world_size", int, first)
    if world < 1 or _field(model0, "mp_world_size", int, first) <= mp:
        raise _refuse(first, f"its dp_world_size {world} or mp_world_size do not fit tensor-parallel rank {mp}")
    module = _field(model0, "module", dict, first)
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in module.items()):
        raise _refuse(first, "its 'module' is not a state dict of tensors")
    prefix = "bf16_" if any(v.dtype == torch.bfloat16 for v in module.values()) else ""
    model_files, optim_files = _files(path, prefix, world, zero3, mp)
    if not os.path.lexists(optim_files[0]):
        raise _refuse(
            path,
            f"holds no {os.path.basename(optim_files[0])}: a stage-0 (or NVMe-offloaded, or other-precision) "
            "checkpoint, whose optimizer files convert does not read",
        )
    optims = [_load(f, path) for f in optim_files]
    states = [_field(o, "optimizer_state_dict", dict, f) for o, f in zip(optims, optim_files)]
    param_shapes = _field(model0, "param_shapes", list, first)
    shapes = [_shapes(g, first, f"param_shapes[{k}]") for k, g in enumerate(param_shapes)]
    if zero3:
        layout = "zero3"
        models = [model0] + [_load(f, path) for f in model_files[1:]]
        ranks, keys, scalars, groups = _zero3_ranks(states, optim_files, models, model_files, shapes, world)
        trainable = placements_zero3(shapes, world)
        frozen_shapes = _shapes(model0.get("frozen_param_shapes") or {}, first, "frozen_param_shapes")
        frozen = []
        for name, shape in frozen_shapes:  # each its own fragment on every rank (its ds_tensor)
            placement = Placement(name, shape, -1, parts_zero3(math.prod(shape), world, 0))
            frozen.append(placement)
            for r, rank in enumerate(ranks):
                got = rank.frozen.get(name)
                if got is None or got.numel() < sum(p.numel for p in placement.pieces if p.rank == r):
                    raise _refuse(model_files[r], f"holds no fragment of the frozen parameter {name} of its size")
    else:
        stage = states[0].get("zero_stage")
        layout = "bf16-optimizer" if stage is None else f"zero{stage}"
        if layout not in ("zero1", "zero2", "bf16-optimizer"):
            raise _refuse(optim_files[0], f"its zero_stage is {stage!r}, in a checkpoint of ZeRO-1/2's files")
        ranks, keys, scalars, groups, partition = _zero12_ranks(states, optim_files, shapes, stage is None)
        paddings = _paddings(states[0], optim_files[0], shapes)
        for g, named in enumerate(shapes):  # before any placement is built: a piece per rank at most
            if sum(math.prod(s) + pad for (_, s), pad in zip(named, paddings[g])) > partition[g] * world:
                raise _refuse(
                    optim_files[0], f"its group {g}'s partitions ({world} x {partition[g]}) cannot hold its parameters"
                )
        trainable = placements_zero12(shapes, paddings, partition)
        if model0.get("num_experts"):  # MoE experts spread over expert-parallel ranks
            if _field(model0, "mp_world_size", int, first) > 1:  # DeepSpeed folds expert groups across TP ones
                raise _refuse(first, "holds MoE experts under tensor parallelism, which convert does not read")
            trainable, module = _experts(trainable, model0, states[0], optim_files[0], path, world, module)
        for placement in trainable:  # every element inside what its rank saved (ZeRO-1/2 cut the tail padding)
            for piece in placement.pieces:
                if piece.start + piece.numel > ranks[piece.rank].fp32[placement.group].numel():
                    raise _refuse(
                        optim_files[piece.rank],
                        f"its fp32 partition {placement.group} ends before {placement.name} (the layout puts it there)",
                    )
        frozen = []
    names = [p.name for p in trainable]
    aliases = _field(model0, "shared_params", dict, first) if model0.get("shared_params") else {}
    if not all(isinstance(a, str) and isinstance(k, str) and k in module for a, k in aliases.items()):
        raise _refuse(first, "its shared_params do not name tied parameters of its module")
    buffers = model0.get("buffer_names") or []
    if not isinstance(buffers, list) or not all(isinstance(b, str) and b in module for b in buffers):
        raise _refuse(first, "its buffer_names do not name tensors of its module")
    lacking = [n for n in [*names, *(p.name for p in frozen)] if n not in module]
    if lacking or len(set(names)) != len(names):
        raise _refuse(first, f"its param_shapes name {lacking[:4] or 'a parameter twice'}, not in its module")
    if not zero3:
        wrong = [p.name for p in trainable if tuple(module[p.name].shape) != p.shape]
        if wrong:
            raise _refuse(first, f"its module's {wrong[:4]} are not shaped as its param_shapes say")
    scheduler = model0.get("lr_scheduler")
    if scheduler is not None and not isinstance(scheduler, dict):
        raise _refuse(first, "its lr_scheduler is not a state_dict")
    found = DeepSpeedCheckpoint(
        path,
        tag,
        layout,
        world,
        module,
        tuple(buffers),
        aliases,
        tuple(trainable),
        tuple(frozen),
        tuple(ranks),
        keys,
        groups,
        tuple(scalars),
        scheduler,
        _counters(model0, first, states[0], optim_files[0]),
    )
    return found, model0


_EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d{1,9})(\..+)$")


def _experts(
    trainable: list[Placement],
    model0: Mapping[str, Any],
    state0: Mapping[str, Any],
    where: str,
    path: str,
    world: int,
    module: dict[str, torch.Tensor],
) -> tuple[list[Placement], dict[str, torch.Tensor]]:
    """A MoE checkpoint's experts (DeepSpeed 0.19, ZeRO-1/2): each flat group partitioned over fewer ranks
    than the world (``partition_count``) is a MoE layer's experts, E = world / that many expert-parallel
    ranks; its parameters, as data-parallel rank 0 names them, are expert-parallel rank 0's local experts.
    Expert-parallel rank e's flat group holds the same local experts, global index ``e * local + i``,
    partitioned over its expert-data-parallel group (ranks e, E + e, 2E + e, ...: DeepSpeed's
    ``_create_expert_and_data_parallel`` without ``use_data_before_expert_parallelism``). Their weights
    are in ``layer_<l>_expert_<g>_mp_rank_00_model_states.pt``, under their global names. Returns every
    expert's placement (the other groups as they were) and the module's weights with the experts'."""
    config = model0.get("ds_config")
    if isinstance(config, dict) and config.get("use_data_before_expert_parallelism"):
        raise _refuse(
            where, "was written with use_data_before_expert_parallelism, an expert layout convert does not read"
        )
    counts = state0.get("partition_count")
    groups = 1 + max((p.group for p in trainable), default=-1)
    if not isinstance(counts, list) or len(counts) != groups or not all(type(c) is int and c >= 1 for c in counts):
        raise _refuse(where, f"its partition_count {counts!r} does not give one count per flat group")
    if any(world % c for c in counts):
        raise _refuse(where, f"its partition_count {counts!r} does not divide its world of {world}")
    local: dict[tuple[int, str], set[int]] = {}  # (group, layer prefix) -> the local indexes of its experts
    for placement in trainable:
        found = _EXPERT.match(placement.name)
        if world // counts[placement.group] > 1:
            if found is None:
                raise _refuse(where, f"its expert group holds {placement.name}, not an expert of a MoE layer")
            local.setdefault((placement.group, found[1]), set()).add(int(found[2]))
    out: list[Placement] = []
    for placement in trainable:
        size = world // counts[placement.group]
        found = _EXPERT.match(placement.name)
        if size == 1 or found is None:
            out.append(placement)
            continue
        if any(p.rank >= counts[placement.group] for p in placement.pieces):
            raise _refuse(
                where, f"its expert group {placement.group} holds more than its {counts[placement.group]} partitions"
            )
        each = len(local[(placement.group, found[1])])
        for e in range(size):  # expert-parallel rank e's copy of this local expert, its pieces on e's ranks
            name = f"{found[1]}{e * each + int(found[2])}{found[3]}"
            pieces = tuple(Piece(p.rank * size + e, p.start, p.numel) for p in placement.pieces)
            out.append(Placement(name, placement.shape, placement.group, pieces))
    experts = model0.get("num_experts")
    if not isinstance(experts, list) or not all(type(n) is int and 0 < n <= 65536 for n in experts):
        raise _refuse(where, f"its num_experts {experts!r} is not a count per MoE layer")
    module = dict(module)
    for layer, count in enumerate(experts):
        for g in range(count):
            file = os.path.join(path, f"layer_{layer}_expert_{g}_mp_rank_00_model_states.pt")
            held = _load(file, path)
            for name, tensor in held.items():
                found = _EXPERT.match(name) if isinstance(name, str) else None
                if found is None or int(found[2]) != g or name in module or not isinstance(tensor, torch.Tensor):
                    raise _refuse(file, f"holds {name!r}, not a weight of expert {g} alone")
                module[name] = tensor
    return out, module


#: What DeepSpeed 0.19's AutoTP records of its layout in each ``mp_rank_<t>`` model-state file
#: (``universal_checkpoint_info``, the categories its ``ds_to_universal`` reads): each a list of patterns.
_ROW_PARALLEL = "parameter_with_row_parallelism_patterns"  # split along dimension 1
_REPLICATED = "tp_replicated_parameter_patterns"  # the same on every tensor-parallel rank
_VOCABULARY = "vocabulary_parameter_patterns"  # split along dimension 0 (unevenly), as the default
#: Layouts that are not one slice of one dimension (fused sub-parameters, averaged copies, parameters
#: AutoTP could not describe): refused, naming the parameter.
_FUSED = (
    "parameter_with_sub_params",
    "parameter_with_2_sub_params_cat_dim_0",
    "parameter_to_average_patterns",
    "sub_param_shard_widths",
    "autotp_unsupported_parameter_patterns",
)


def _literal(pattern: object, where: str) -> str:
    """The one name an exact-name pattern (``^<re.escape(name)>$``, what AutoTP writes for each
    parameter) matches. Any other pattern is refused rather than evaluated: the file is untrusted, and
    a pattern can take exponential time to match."""
    if isinstance(pattern, str) and len(pattern) <= 4096 and pattern.startswith("^") and pattern.endswith("$"):
        name = re.sub(r"\\(.)", r"\1", pattern[1:-1])
        if re.escape(name) == pattern[1:-1]:
            return name
    raise _refuse(where, f"its universal_checkpoint_info holds the pattern {str(pattern)[:80]!r}, not an exact name")


def _tensor_parallel(
    parts: Sequence[DeepSpeedCheckpoint], model0: Mapping[str, Any], where: str
) -> list[dict[str, Split]]:
    """Where each tensor-parallel rank's shard of each parameter lies in its whole tensor, from what AutoTP
    recorded (``universal_checkpoint_info``: a row-parallel parameter is split along dimension 1, a
    replicated one not at all, any other along dimension 0; as DeepSpeed's ``ds_to_universal`` merges
    them) and from every part's shapes (each shard's size along the split: uneven vocabularies too). Every
    part must hold the same parameters, groups, optimizer keys and counters. CheckpointError naming the
    parameter for a fused layout, a shape that does not join, or a part that differs."""
    info = model0.get("universal_checkpoint_info")
    if not isinstance(info, dict):
        raise _refuse(where, "was written with tensor parallelism but records no universal_checkpoint_info (AutoTP's)")

    def named(key: str) -> set[str]:
        found = info.get(key) or []
        if not isinstance(found, (list, dict)):
            raise _refuse(where, f"its universal_checkpoint_info's {key} is not a list of patterns")
        # a fused layout's entry is its shape with the patterns it applies to (``{"patterns": [...], ...}``)
        listed = [q for p in found for q in (p.get("patterns") or [None] if isinstance(p, dict) else [p])]
        return {_literal(p, where) for p in listed}

    rows, replicated = named(_ROW_PARALLEL), named(_REPLICATED)
    named(_VOCABULARY)  # checked: split along dimension 0, as any other
    fused = set().union(*(named(key) for key in _FUSED))
    first = parts[0]

    def alike(part: DeepSpeedCheckpoint) -> tuple[object, ...]:
        """What every tensor-parallel part holds the same: one training state holds it once."""
        names = ([p.name for p in part.trainable], list(part.module), part.buffers, part.aliases)
        states = repr((part.param_groups, part.group_states, part.counters, part.lr_scheduler))
        return (part.layout, part.world, part.keys, states, names)

    for part in parts[1:]:
        if alike(part) != alike(first):
            raise _refuse(
                part.path, "its tensor-parallel parts differ in layout, ranks, parameters, optimizer or counters"
            )
    out: list[dict[str, Split]] = [{} for _ in parts]
    for name in first.module:
        if name in first.buffers or name in first.aliases:
            continue
        if name in fused:
            raise _refuse(where, f"AutoTP split {name} in a fused or undescribed layout, which convert does not join")
        shapes = [tuple(part.module[name].shape) for part in parts]
        if first.layout == "zero3":  # the module holds placeholders: the shapes are the placements'
            placed = [{p.name: p.shape for p in (*part.trainable, *part.frozen)} for part in parts]
            shapes = [held.get(name, s) for held, s in zip(placed, shapes)]
        if any(math.prod(s) == 0 for s in shapes):  # nothing to join (or a placeholder no layout shapes)
            raise _refuse(where, f"the tensor-parallel parts of {name} ({shapes}) hold no elements to join")
        dim = None if name in replicated else 1 if name in rows else 0
        if dim is None or len(shapes[0]) <= dim:
            if len(set(shapes)) > 1 or dim is not None:
                raise _refuse(where, f"the tensor-parallel parts of {name} ({shapes}) do not join")
            continue
        if any(s[:dim] + s[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :] for s in shapes):
            raise _refuse(where, f"the tensor-parallel parts of {name} ({shapes}) do not join along dimension {dim}")
        bounds = tuple(sum(s[dim] for s in shapes[:t]) for t in range(len(shapes) + 1))
        whole = shapes[0][:dim] + (bounds[-1],) + shapes[0][dim + 1 :]
        for t in range(len(parts)):
            out[t][name] = Split(dim, whole, bounds[t], bounds[t + 1], bounds)
    return out


def _per_element(found: Mapping[str, Any], numel: int) -> list[str]:
    """The keys of one flat group's optimizer state with one value per element of its partition."""
    return sorted(k for k, v in found.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel)


def _optimizer(
    inner: Any, where: str, sizes: Sequence[int]
) -> tuple[
    list[dict[str, Any]], tuple[str, ...], list[dict[str, Any]], tuple[tuple[tuple[int, ...], Mapping[str, Any]], ...]
]:
    """The torch optimizer's ``state_dict()`` DeepSpeed saved (its states keyed by flat group, each of
    ``sizes[k]`` elements): per group its states, the per-element keys, the rest, and the param groups."""
    if (
        not isinstance(inner, dict)
        or not isinstance(inner.get("state"), dict)
        or not isinstance(inner.get("param_groups"), list)
    ):
        raise _refuse(where, "its optimizer's state_dict has no state and param_groups (an elastic checkpoint?)")
    found = inner["state"]
    if set(found) - set(range(len(sizes))):
        raise _refuse(
            where,
            f"its optimizer holds states of {sorted(set(found) - set(range(len(sizes))))[:4]}, not of its flat groups",
        )
    per_group = [found.get(k) or {} for k in range(len(sizes))]
    if not all(isinstance(s, dict) and all(isinstance(key, str) for key in s) for s in per_group):
        raise _refuse(where, "its optimizer's states are not named values")
    kinds = {tuple(_per_element(s, sizes[k])) for k, s in enumerate(per_group)}
    if len(kinds) > 1:
        raise _refuse(where, f"its optimizer holds different per-element states for different groups ({sorted(kinds)})")
    keys = next(iter(kinds), ())
    scalars = [{k: v for k, v in s.items() if k not in keys} for s in per_group]
    groups = []
    listed: list[int] = []
    for g in inner["param_groups"]:
        params = g.get("params") if isinstance(g, dict) else None
        if not isinstance(params, list) or not all(type(i) is int for i in params):
            raise _refuse(where, "its optimizer's param_groups do not list their flat groups")
        listed += params
        groups.append((tuple(params), {k: v for k, v in g.items() if k != "params"}))
    if sorted(listed) != list(range(len(sizes))):
        raise _refuse(where, f"its optimizer's param_groups hold {sorted(listed)}, not its {len(sizes)} flat groups")
    return per_group, keys, scalars, tuple(groups)


def _same_everywhere(found: Sequence[Any], files: Sequence[str], what: str) -> None:
    """``found`` (one value per rank) the same on every rank: a resumed run holds it once."""
    first = repr(found[0])
    for value, where in zip(found[1:], files[1:]):
        if repr(value) != first:
            raise _refuse(where, f"its {what} differ from rank 0's, which a training state holds once")


def _zero12_ranks(
    states: Sequence[Mapping[str, Any]],
    files: Sequence[str],
    shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    bf16_optimizer: bool,
) -> tuple[
    list[RankState],
    tuple[str, ...],
    list[dict[str, Any]],
    tuple[tuple[tuple[int, ...], Mapping[str, Any]], ...],
    list[int],
]:
    """Each rank's ZeRO-1/2 (or BF16_Optimizer) partitions, checked against the layout: the partition of
    every group P elements on every rank (ZeRO-1/2 save it less its tail padding, ``group_paddings``;
    BF16_Optimizer whole), enough for the group's parameters."""
    ranks, partition, found = [], [0] * len(shapes), []
    for r, (state, where) in enumerate(zip(states, files)):
        fp32 = _field(state, "single_partition_of_fp32_groups", list, where)
        pads = _field(state, "group_paddings", list, where)
        if len(fp32) != len(shapes) or len(pads) != len(shapes) or not all(type(p) is int and p >= 0 for p in pads):
            raise _refuse(where, f"holds {len(fp32)} fp32 partitions and {len(pads)} paddings for {len(shapes)} groups")
        flats = [_flat(t, where, f"fp32 partition {g}") for g, t in enumerate(fp32)]
        sizes = [t.numel() if bf16_optimizer else t.numel() + pads[g] for g, t in enumerate(flats)]
        if r == 0:
            partition = sizes
        elif sizes != partition:
            raise _refuse(where, f"its partitions hold {sizes} elements, rank 0's {partition}")
        inner = state.get("base_optimizer_state")
        per_group, keys, scalars, groups = _optimizer(inner, where, partition)
        found.append((keys, scalars, groups))
        ranks.append(RankState(tuple(flats), tuple(per_group), {}))
    _same_everywhere([f[0] for f in found], files, "optimizer state keys")
    _same_everywhere([(f[1], f[2]) for f in found], files, "optimizer step counts and hyperparameters")
    keys, scalars, groups = found[0]
    return ranks, keys, scalars, groups, partition


def _paddings(
    state: Mapping[str, Any], where: str, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]]
) -> list[list[int]]:
    """The padding after each parameter of each group (``zero_optimization.parameter_alignment``); none
    where the file has none (BF16_Optimizer)."""
    found = state.get("param_alignment_paddings")
    if found is None:
        return [[0] * len(named) for named in shapes]
    if (
        not isinstance(found, list)
        or len(found) != len(shapes)
        or any(
            not isinstance(p, list) or len(p) != len(named) or not all(type(x) is int and x >= 0 for x in p)
            for p, named in zip(found, shapes)
        )
    ):
        raise _refuse(where, "its param_alignment_paddings do not give one padding per parameter")
    return found


def _zero3_ranks(
    states: Sequence[Mapping[str, Any]],
    files: Sequence[str],
    models: Sequence[Mapping[str, Any]],
    model_files: Sequence[str],
    shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    world: int,
) -> tuple[
    list[RankState], tuple[str, ...], list[dict[str, Any]], tuple[tuple[tuple[int, ...], Mapping[str, Any]], ...]
]:
    """Each rank's ZeRO-3 partitions (one flat fp32 partition per sub-group, exactly the size its
    parameters' parts take) and frozen fragments."""
    sizes = flat_sizes_zero3(shapes, world)
    ranks, found = [], []
    for r, (state, where) in enumerate(zip(states, files)):
        if _field(state, "partition_count", int, where) != world:
            raise _refuse(where, f"its partition_count is {state.get('partition_count')}, its world {world}")
        fp32 = _field(state, "fp32_flat_groups", list, where)
        if len(fp32) != len(shapes):
            raise _refuse(where, f"holds {len(fp32)} fp32 partitions for {len(shapes)} sub-groups")
        flats = [_flat(t, where, f"fp32 partition {k}", sizes[k]) for k, t in enumerate(fp32)]
        per_group, keys, scalars, groups = _optimizer(state.get("optimizer_state_dict"), where, sizes)
        found.append((keys, scalars, groups))
        model = models[r]
        fragments = model.get("frozen_param_fragments") or {}
        if not isinstance(fragments, dict) or not all(isinstance(t, torch.Tensor) for t in fragments.values()):
            raise _refuse(model_files[r], "its frozen_param_fragments are not tensors by name")
        if r and _field(model, "dp_world_size", int, model_files[r]) != world:
            raise _refuse(model_files[r], f"was written at another data-parallel size than rank 0's {world}")
        ranks.append(RankState(tuple(flats), tuple(per_group), {k: t.reshape(-1) for k, t in fragments.items()}))
    _same_everywhere([f[0] for f in found], files, "optimizer state keys")
    _same_everywhere([(f[1], f[2]) for f in found], files, "optimizer step counts and hyperparameters")
    keys, scalars, groups = found[0]
    return ranks, keys, scalars, groups


#: The engine's counters its checkpoint keeps (``micro_steps`` is not kept: DeepSpeed's own resume
#: starts it anew, as this one does).
_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
#: The fp16 loss scaler's state, as collgrad's DeepSpeed adapter names it (``loss_scaler.<name>``).
_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _counters(model0: Mapping[str, Any], where: str, state0: Mapping[str, Any], optim: str) -> dict[str, int | float]:
    out: dict[str, int | float] = {}
    for name in _COUNTERS:
        value = model0.get(name)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise _refuse(where, f"its {name} is {type(value).__name__}")
            out[name] = value
    config = model0.get("ds_config")
    fp16 = isinstance(config, dict) and isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled") is True
    scaler = state0.get("loss_scaler")
    if fp16 or isinstance(scaler, _DynamicLossScaler):
        for name in _SCALER:
            value = getattr(scaler, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"loss_scaler.{name}"] = value
    return out
