"""The manifest of a training state: what is where, and everything that is not a tensor of the model's
shape, as JSON. Pure: no process group, no framework.

    training_state/manifest.json
    {"format": "collgrad-training-state", "version": 2, "generation": "3f0c...",
     "saved_by": {"framework": "deepspeed", "layout": "deepspeed-zero2", "world_size": 2},
     "tensors": {"weights": {name: file}, "fp32": {name: file}, "optimizer": {key: {name: file}}},
                                             # files relative to the checkpoint's directory
     "param_groups": [{"params": [name, ...], "hyperparameters": VALUE}, ...],
     "param_states": {"values": [VALUE, ...], "of": {name: index}},
                                             # the optimizer's states that are not per element ("step"),
                                             # each distinct one once
     "lr_scheduler": VALUE or null,          # its state_dict()
     "counters": {name: number},             # the framework's own (a DeepSpeed engine's steps, loss scaler)
     "hashes": {"algorithm": "xxh3_64", "block": 4194304, "files": {hash file: hex}},
                                             # every writing rank's hash file and its digest (hashes.py)
     "digest": hex}                          # of the manifest's JSON without this field

The module's weights lie in the checkpoint's directory (what ``from_pretrained`` reads), the masters and
the optimizer's states beside the manifest in ``training_state/``, where no loader of a model directory
looks. Tensors lie in safetensors files (each file's header says where in it), every file named by
the save's generation, so a save never overwrites a file an earlier manifest names: the manifest is
replaced last, in one rename, and is the checkpoint. A VALUE is JSON where JSON can hold it; tuples,
lists, dicts (any keys) and small tensors are tagged (``encode``/``decode``): nothing is ever
unpickled. Every manifest read back is untrusted: ``read_manifest`` checks each field's type and every
file name (a plain name in the directory) before anything uses it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from collgrad import _compat
from collgrad.checkpoint import hashes
from collgrad.checkpoint.safetensors import SAFE_DTYPES, metadata_files, refused
from collgrad.errors import InvalidArgumentError

__all__ = [
    "STATE_DIR",
    "MANIFEST_NAME",
    "manifest_path",
    "FORMAT",
    "Manifest",
    "ParamGroup",
    "encode",
    "decode",
    "read_manifest",
    "plain_file",
]

#: Where a training state keeps what is not the module's weights, in its directory, and its manifest.
STATE_DIR = "training_state"
MANIFEST_NAME = f"{STATE_DIR}/manifest.json"
FORMAT = "collgrad-training-state"
VERSION = 2
#: The most elements a tensor held in the manifest may have (a step count, a scalar hyperparameter).
MAX_JSON_TENSOR = 4096
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in SAFE_DTYPES}
#: What a file the manifest names may look like: a plain name in the directory or in ``STATE_DIR``.
_FILE = re.compile(rf"^({STATE_DIR}/)?[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")


def manifest_path(directory: str) -> str:
    """Where the manifest of a training state in ``directory`` lies."""
    return os.path.join(directory, MANIFEST_NAME)


@dataclass(frozen=True)
class ParamGroup:
    """One param group of the optimizer: its parameters by name, and its hyperparameters (``lr``, ...)."""

    params: tuple[str, ...]
    hyperparameters: Mapping[str, Any]


@dataclass(frozen=True)
class Manifest:
    """A training state's manifest, as saved or as read back and checked."""

    generation: str
    saved_by: Mapping[str, Any]
    weights: Mapping[str, str]
    fp32: Mapping[str, str]
    optimizer: Mapping[str, Mapping[str, str]]
    param_groups: tuple[ParamGroup, ...]
    param_states: Mapping[str, Mapping[str, Any]]
    lr_scheduler: Mapping[str, Any] | None
    counters: Mapping[str, int | float]
    #: Every writing rank's hash file (hashes.py) and the digest of its bytes; None: a save without them.
    hashes: Mapping[str, int] | None = None

    def to_json(self) -> bytes:
        """The manifest as written (values encoded). InvalidArgumentError (this rank) for a value JSON
        cannot hold even tagged (an object of a class, a large tensor)."""
        document = {
            "format": FORMAT,
            "version": VERSION,
            "generation": self.generation,
            "saved_by": dict(self.saved_by),
            "tensors": {
                "weights": dict(self.weights),
                "fp32": dict(self.fp32),
                "optimizer": {k: dict(v) for k, v in self.optimizer.items()},
            },
            "param_groups": [
                {"params": list(g.params), "hyperparameters": encode(dict(g.hyperparameters), "a param group")}
                for g in self.param_groups
            ],
            "param_states": _deduplicated(self.param_states),
            "lr_scheduler": None
            if self.lr_scheduler is None
            else encode(dict(self.lr_scheduler), "the LR scheduler's state_dict()"),
            "counters": dict(self.counters),
        }
        if self.hashes is not None:
            document["hashes"] = hashes.listed(self.hashes)
        return hashes.signed(document)

    def files(self) -> tuple[str, ...]:
        """Every tensor file it names, each once, in order."""
        names = [*self.weights.values(), *self.fp32.values()]
        for mapped in self.optimizer.values():
            names.extend(mapped.values())
        return tuple(dict.fromkeys(names))


def _hashes(document: Mapping[str, Any], where: str) -> dict[str, int] | None:
    """The manifest's hash files and their digests, checked, after its own digest is checked against the
    rest of it; None for a manifest written without hashes."""
    if not hashes.checked_digest(document, where) or document.get("hashes") is None:
        return None
    return hashes.read_listed(document["hashes"], where)


def _deduplicated(states: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each parameter's states that are not per element, each distinct value once (``values``) and the
    index of its own by name (``of``): parameters that share a holder (ZeRO's groups), or whose step
    counts are equal, share one entry."""
    values: list[Any] = []
    of: dict[str, int] = {}
    by_text: dict[str, int] = {}
    by_id: dict[int, int] = {}
    by_value: dict[tuple[Any, ...], int] = {}  # a state seen before, by its values: not encoded again
    for name, held in states.items():
        index = by_id.get(id(held))
        if index is None:
            key = _values_key(held)
            index = by_value.get(key) if key is not None else None
            if index is None:
                encoded = encode(dict(held), f"the optimizer's state of {name}")
                index = by_text.setdefault(json.dumps(encoded, sort_keys=True), len(values))
                if index == len(values):
                    values.append(encoded)
                if key is not None:
                    by_value[key] = index
            by_id[id(held)] = index
        of[name] = index
    return {"values": values, "of": of}


def _values_key(held: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What ``encode`` gives ``held``, told apart cheaply where its values are numbers, strings and tensors
    (Adam's step counts: a 0-d tensor a parameter, 40,000 of them for a 3.9B-parameter model, each
    encoded and dumped took ~8 us): equal keys, equal encodings (a value's type, a tensor's dtype and
    shape, ``repr`` of the values, which tells -0.0 from 0.0 where ``==`` does not). None for anything
    else (encoded, then told apart by its JSON)."""
    out: list[Any] = []
    for k, v in held.items():
        if type(k) is not str:  # True, 1 and 1.0 are one key of a dict, three of the JSON
            return None
        if isinstance(v, torch.Tensor):
            if v.numel() > MAX_JSON_TENSOR or v.dtype not in SAFE_DTYPES:  # encode() refuses it, by name
                return None
            out.append((k, v.dtype, tuple(v.shape), repr(v.tolist())))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out.append((k, type(v), repr(v)))
        else:
            return None
    return tuple(out)


def encode(value: Any, what: str) -> Any:
    """``value`` as JSON: numbers, strings, booleans and None as they are, tuples, lists and dicts
    (keys of any of those kinds) and tensors of at most ``MAX_JSON_TENSOR`` elements tagged.
    InvalidArgumentError (this rank), naming ``what``, for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() > MAX_JSON_TENSOR or value.dtype not in SAFE_DTYPES:
            raise InvalidArgumentError(
                f"rank {_compat.rank()}: {what} holds a {value.dtype} tensor of {value.numel()} elements, which a "
                "training state keeps only as an optimizer state with one value per element"
            )
        flat = value.detach().to("cpu").reshape(-1)
        values = flat.float().tolist() if value.dtype in (torch.bfloat16, torch.float16) else flat.tolist()
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape), "values": values}
    if isinstance(value, tuple):
        return {"tuple": [encode(v, what) for v in value]}
    if isinstance(value, list):
        return {"list": [encode(v, what) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, what), encode(v, what)] for k, v in value.items()]}
    raise InvalidArgumentError(
        f"rank {_compat.rank()}: {what} holds a {type(value).__name__}, which a training state cannot keep (numbers, "
        "strings, tensors, and lists, tuples and dicts of them)"
    )


def decode(value: Any, where: str) -> Any:
    """What ``encode`` gave, back; CheckpointError, naming ``where``, for anything it cannot have given."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        raise refused(where, "holds an untagged list")
    if not isinstance(value, dict) or len(value) not in (1, 3):
        raise refused(where, f"holds {type(value).__name__} where a value was expected")
    if "tuple" in value and isinstance(value["tuple"], list):
        return tuple(decode(v, where) for v in value["tuple"])
    if "list" in value and isinstance(value["list"], list):
        return [decode(v, where) for v in value["list"]]
    if "dict" in value and isinstance(value["dict"], list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in value["dict"]):
            raise refused(where, "holds a dict that is not a list of [key, value] pairs")
        out = {}
        for k, v in value["dict"]:
            key = decode(k, where)
            if not isinstance(key, (bool, int, float, str, type(None), tuple)):
                raise refused(where, f"holds a dict key of type {type(key).__name__}")
            out[key] = decode(v, where)
        return out
    if set(value) == {"tensor", "shape", "values"}:
        dtype = _DTYPES.get(value["tensor"]) if isinstance(value["tensor"], str) else None
        shape, values = value["shape"], value["values"]
        if dtype is None or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise refused(where, f"holds a tensor of dtype {value['tensor']!r} and shape {shape!r}")
        if not isinstance(values, list) or len(values) != math.prod(shape) or len(values) > MAX_JSON_TENSOR:
            raise refused(where, f"holds a tensor of shape {shape} with the wrong number of values")
        if not all(isinstance(v, (bool, int, float)) for v in values):
            raise refused(where, "holds a tensor with values that are not numbers")
        return torch.tensor(values, dtype=torch.float64 if dtype.is_floating_point else None).to(dtype).reshape(shape)
    raise refused(where, f"holds an object tagged {sorted(value)}, which no training state writes")


def plain_file(name: str, where: str) -> str:
    """``name`` if it is a plain safetensors file name in the directory or in ``STATE_DIR`` (nothing
    hidden, no other directory); CheckpointError naming ``where`` otherwise."""
    if not isinstance(name, str) or not _FILE.match(name):
        raise refused(where, f"names the file {name!r}, which is not a plain .safetensors name in its directory")
    return name


def _mapping(found: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(found, dict) or not all(isinstance(k, str) for k in found):
        raise refused(where, f"{what} is not an object of names")
    return found


def _files(found: Any, where: str, what: str) -> dict[str, str]:
    mapped = _mapping(found, where, what)
    for file in set(mapped.values()) if all(isinstance(f, str) for f in mapped.values()) else mapped.values():
        plain_file(file, where)  # each file once (hundreds of tensors share a few files)
    return mapped


def _param_states(found: Any, where: str) -> dict[str, Mapping[str, Any]]:
    """``_deduplicated``'s form read back: every name's states, each distinct value decoded once (the
    names that share it share the one mapping)."""
    found = _mapping(found, where, "param_states")
    values, of = found.get("values"), _mapping(found.get("of"), where, "param_states.of")
    if not isinstance(values, list):
        raise refused(where, "param_states.values is not a list")
    decoded = []
    for k, value in enumerate(values):
        held = decode(value, f"{where}: param_states.values[{k}]")
        if not isinstance(held, dict) or not all(isinstance(key, str) for key in held):
            raise refused(where, f"param_states.values[{k}] is not named values")
        decoded.append(held)
    if not all(type(i) is int and 0 <= i < len(decoded) for i in of.values()):
        raise refused(where, "param_states.of names a value that is not there")
    return {name: decoded[i] for name, i in of.items()}


def read_manifest(directory: str) -> Manifest:
    """The manifest of the training state in ``directory``, every field checked (types, file names), read
    through ``safetensors.metadata_files()``; CheckpointError naming the file and the reason otherwise.
    Local."""
    where = manifest_path(directory)
    try:
        document = json.loads(metadata_files().whole(where).decode("utf-8"))
    except FileNotFoundError:
        raise refused(
            directory, f"holds no {MANIFEST_NAME}: not a training state (save one with save_training_state)"
        ) from None
    except OSError as error:
        raise refused(where, f"cannot be read ({error.strerror or error})") from error
    except (UnicodeDecodeError, ValueError) as error:
        raise refused(where, f"is not valid JSON ({error})") from None
    document = _mapping(document, where, "the manifest")
    if document.get("format") != FORMAT or document.get("version") != VERSION:
        raise refused(where, f"is not a {FORMAT} manifest of version {VERSION}")
    tensors = _mapping(document.get("tensors"), where, "tensors")
    optimizer = {
        k: _files(v, where, f"tensors.optimizer[{k!r}]")
        for k, v in _mapping(tensors.get("optimizer", {}), where, "tensors.optimizer").items()
    }
    groups = []
    found_groups = document.get("param_groups")
    if not isinstance(found_groups, list):
        raise refused(where, "param_groups is not a list")
    for k, group in enumerate(found_groups):
        group = _mapping(group, where, f"param group {k}")
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(n, str) for n in params):
            raise refused(where, f"param group {k} does not list its parameters by name")
        hyper = decode(group.get("hyperparameters"), f"{where}: param group {k}")
        if not isinstance(hyper, dict) or not all(isinstance(h, str) and h != "params" for h in hyper):
            raise refused(where, f"param group {k}'s hyperparameters are not named values")
        groups.append(ParamGroup(tuple(params), hyper))
    states = _param_states(document.get("param_states"), where)
    scheduler = decode(document.get("lr_scheduler"), f"{where}: lr_scheduler")
    if scheduler is not None and not isinstance(scheduler, dict):
        raise refused(where, "lr_scheduler is not a state_dict")
    counters = _mapping(document.get("counters", {}), where, "counters")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in counters.values()):
        raise refused(where, "counters are not numbers")
    generation = document.get("generation")
    if not isinstance(generation, str):
        raise refused(where, "has no generation")
    return Manifest(
        generation,
        _mapping(document.get("saved_by", {}), where, "saved_by"),
        _files(tensors.get("weights"), where, "tensors.weights"),
        _files(tensors.get("fp32", {}), where, "tensors.fp32"),
        optimizer,
        tuple(groups),
        states,
        scheduler,
        counters,
        _hashes(document, where),
    )
